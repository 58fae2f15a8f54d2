"""The node-aware collective: reduce-scatter inside the node, all-reduce of the shards across nodes, all-gather."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._compat import all_gather_single, reduce_scatter_single
from .._handover import hand_over
from ..groups import NodeGroups
from .buckets import BucketPool, flat_pieces, pack, unpack

__all__ = ["reduce_node_aware", "sum_node_aware"]


def sum_node_aware(view: torch.Tensor, node: NodeGroups) -> None:
    """Replace ``view`` by its SUM over the subgroup of ``node``, in place: reduce-scatter over the node into a
    shard of ``view.numel() / node.local_size`` elements (``view`` padded to a multiple of it), all-reduce of the
    shards across nodes, all-gather over the node. Extra memory: one shard."""
    shard = torch.empty(view.numel() // node.local_size, dtype=view.dtype, device=view.device)
    reduce_scatter_single(shard, view, node.local)
    if node.cross is not None:
        dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=node.cross)
    all_gather_single(view, shard, node.local)


def reduce_node_aware(
    packed: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.dtype]]],
    node: NodeGroups,
    divisor: float,
    cap_bytes: int,
    pool: BucketPool,
) -> None:
    """Average through the bucket, node-aware: reduce-scatter in the node, all-reduce across, all-gather.

    A bucket of ``c`` elements (padded with zeros to a multiple of ``m = node.local_size``) is
    reduce-scattered over the node into a shard of ``c / m`` elements, the shards are all-reduced
    (SUM) across nodes, gathered back over the node, divided by ``divisor`` and unpacked. Each rank
    sends ``2 (m - 1) / m`` bucket inside its node and ``2 (q - 1) / q / m`` bucket across nodes
    (``q = node.cross_size``): each direction of a node's link carries ``2 (q - 1) / q`` times the
    payload per round (1x for two nodes), where a flat ring over all ``n = q m`` ranks carries
    ``2 (n - 1) / n`` times it. Extra memory: one bucket and one shard of it.
    """
    m = node.local_size
    for (device, wire), items in packed.items():
        cap = max(m, cap_bytes // torch.empty((), dtype=wire).element_size()) // m * m
        total = sum(t.numel() for t, _ in items)
        size = min(cap, -(-total // m) * m)
        bucket = pool.get(device, wire, size)
        for chunk in flat_pieces(items, cap):
            used = sum(n for _, _, n, _, _ in chunk)
            padded = -(-used // m) * m
            view = bucket[:padded]
            pack(chunk, view)
            view[used:].zero_()
            hand_over(view)
            sum_node_aware(view, node)
            unpack(chunk, view, divisor)

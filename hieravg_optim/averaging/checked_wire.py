"""The checked float16 wire: one buffer of the whole payload, all-reduced, checked for overflow, then written."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._handover import hand_over
from ..groups import NodeGroups
from .buckets import BucketPool, flat_pieces, pack, unpack
from .node_aware import sum_node_aware

__all__ = ["CHECKED_WIRE", "WireOverflowError", "reduce_staged"]


class WireOverflowError(RuntimeError):
    """A float16 all-reduce (``comm_dtype="float16"``) produced a NaN or an infinity; no tensor was written.

    Raised by :func:`average_tensors_` on every rank of the group alike: the all-reduced data is the
    same on every rank, so every rank decides the same way, without a collective.
    """


CHECKED_WIRE = (torch.float16,)
"""Wire dtypes whose all-reduced sums are checked for overflow before any tensor is written (float16's
largest value is 65504: a sum of a few replicas' values near it overflows, where a float32 or bfloat16 sum
would need values near 3.4e38)."""


def reduce_staged(
    packed: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.dtype]]],
    group: dist.ProcessGroup,
    divisor: float,
    pool: BucketPool,
    node: NodeGroups | None,
    what: str,
    *,
    contribute_zeros: bool = False,
) -> None:
    """Average ``packed`` (float16 on the wire) through one buffer per device, checked before any tensor is written.

    Every tensor is packed into one buffer holding the whole float16 payload (no bucket cap, no tensor
    reduced in its own storage), the buffer is all-reduced (SUM; node-aware: reduce-scatter in the node,
    all-reduce across nodes, all-gather), and its sum is formed in float32, which cannot overflow for
    float16 elements: the sum is finite exactly when every element is. Only then is the buffer divided by
    ``divisor`` and unpacked. Extra memory: the float16 payload, once (kept in ``pool``).
    ``contribute_zeros``: this rank's buffer holds zeros instead of its tensors (which are left as they are).

    Raises:
        WireOverflowError: if an all-reduced element is not finite, before any tensor is written.
    """
    m = 1 if node is None else node.local_size
    staged = []
    for (device, wire), items in packed.items():
        total = sum(t.numel() for t, _ in items)
        padded = -(-total // m) * m
        buffer = pool.get(device, wire, padded)[:padded]
        (chunk,) = flat_pieces(items, total)
        if contribute_zeros:
            buffer[:total].zero_()
        else:
            pack(chunk, buffer[:total])
        buffer[total:].zero_()
        hand_over(buffer)
        if node is None:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        else:
            sum_node_aware(buffer, node)
        staged.append((items, chunk, buffer[:total]))
    sums = [view.sum(dtype=torch.float32) for _, _, view in staged]
    if not bool(torch.isfinite(torch.stack([s.cpu() for s in sums])).all()):
        for items, _, view in staged:
            offset = 0
            for index, (t, _) in enumerate(items):
                piece = view[offset : offset + t.numel()]
                offset += t.numel()
                bad = int((~torch.isfinite(piece)).sum())
                if bad:
                    ranks = dist.get_process_group_ranks(group)
                    raise WireOverflowError(
                        f'{what}: the float16 all-reduce (comm_dtype "float16") over the group of ranks {ranks} '
                        f"produced {bad} non-finite value{'s' if bad > 1 else ''} in tensor {index} (shape "
                        f"{tuple(t.shape)}, dtype {str(t.dtype).removeprefix('torch.')}): a sum of the replicas' "
                        f"values beyond float16's largest, 65504 (a mean above 65504 / {divisor:g} = "
                        f"{65504 / divisor:g}), or a value beyond it rounded to float16. No tensor was written: "
                        "every rank of the group raises here. Send this level in float32 or bfloat16 "
                        '(comm_dtype="fp32" or "bf16", or {period: "bf16"} for this level only).'
                    )
        raise AssertionError("a non-finite float32 sum of float16 elements that are all finite")
    for _, chunk, view in staged:
        unpack(chunk, view, divisor)

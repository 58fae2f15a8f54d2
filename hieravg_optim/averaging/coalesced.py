"""The coalesced path (the default on GPUs): large tensors in place, the rest in one bucket, one group per dtype."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._handover import hand_over
from .buckets import BucketPool, flat_pieces, pack, unpack

__all__ = ["reduce_coalesced"]


def reduce_coalesced(
    direct: list[torch.Tensor],
    packed: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.dtype]]],
    group: dist.ProcessGroup,
    divisor: float,
    use_avg: bool,
    cap_bytes: int,
    pool: BucketPool,
    coalesce: bool,
) -> None:
    """One round: every ``direct`` tensor in place, and the first bucket of each wire dtype, in one group.

    Large contiguous tensors of their wire dtype are all-reduced in their own storage (no copy);
    the others are packed with one foreach copy per bucket. With ``coalesce`` (NCCL) the
    all-reduces are issued in one :func:`torch.distributed._coalescing_manager` group per dtype; otherwise
    (gloo, whose coalesced all-reduce takes one dtype and copies into one flat buffer) they are
    issued ``async_op=True`` one after the other and waited for together. With ``use_avg`` they use
    ``ReduceOp.AVG``, else ``SUM`` followed by one ``torch._foreach_div_`` by ``divisor``. Packed
    tensors beyond one bucket go through the same bucket in later rounds: extra memory stays one
    bucket per wire dtype, plus one temporary per non-contiguous direct tensor.
    """
    op = dist.ReduceOp.AVG if use_avg else dist.ReduceOp.SUM
    chunks = {}
    buckets = {}
    for (device, wire), items in packed.items():
        cap = max(1, cap_bytes // torch.empty((), dtype=wire).element_size())
        chunks[(device, wire)] = flat_pieces(items, cap)
        total = sum(t.numel() for t, _ in items)
        buckets[(device, wire)] = pool.get(device, wire, min(cap, total))
    targets: list[torch.Tensor] = []
    backs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in direct:
        if t.is_contiguous():
            targets.append(t.detach())  # an alias made here: only the backend adds references to it
        else:
            tmp = t.contiguous()
            targets.append(tmp)
            backs.append((t, tmp))
    firsts = []
    for key, key_chunks in chunks.items():
        chunk = key_chunks[0]
        view = buckets[key][: sum(n for _, _, n, _, _ in chunk)]
        pack(chunk, view)
        firsts.append((chunk, view))
    tensors = targets + [view for _, view in firsts]
    for t in tensors:
        hand_over(t)
    if coalesce and tensors:
        # One coalesced group per dtype (NCCL's coalesced all-reduce may require one dtype), all in
        # flight together; a single-dtype model issues exactly one group.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        managers = []
        for same in by_dtype.values():
            with dist._coalescing_manager(group, async_ops=True) as cm:
                for t in same:
                    dist.all_reduce(t, op=op, group=group)
            managers.append(cm)
        for cm in managers:
            cm.wait()
    else:
        works = [dist.all_reduce(t, op=op, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()
    if targets and not use_avg:
        torch._foreach_div_(targets, divisor)
    for dst, tmp in backs:
        dst.copy_(tmp)
    for chunk, view in firsts:
        unpack(chunk, view, None if use_avg else divisor)
    for key, key_chunks in chunks.items():
        for chunk in key_chunks[1:]:
            view = buckets[key][: sum(n for _, _, n, _, _ in chunk)]
            pack(chunk, view)
            hand_over(view)
            dist.all_reduce(view, op=op, group=group)
            unpack(chunk, view, None if use_avg else divisor)

"""The pipelined path (the default on CPU): large tensors in place, issued at once; the rest through two bucket halves."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .._handover import hand_over
from .buckets import DIRECT_MIN_BYTES, BucketPool

__all__ = ["average_pipelined", "direct_numel", "reduce_packed"]

_PIPELINE_MIN_BYTES = 1 << 20
"""Packed tensors of at least this many bytes in total go through the bucket as two pipelined halves."""


def average_pipelined(
    items: list[tuple[torch.Tensor, torch.dtype]],
    group: dist.ProcessGroup,
    divisor: float,
    bucket_cap_bytes: int,
    pool: BucketPool,
    direct_min_bytes: int | None,
    prescaled: frozenset[int] = frozenset(),
) -> None:
    """The pipelined path: tensors in place from a size on (issued at once), the rest through two bucket halves.

    ``prescaled``: the ``id`` of the tensors reduced in place that already hold their value divided by ``divisor``
    (:func:`hieravg_optim.averaging.prescale_checked_`): their SUM is the mean, not divided again.
    """
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t, w in items:
        by_key.setdefault((t.device, w), []).append(t)
    for (device, wire), group_tensors in by_key.items():
        itemsize = torch.empty((), dtype=wire).element_size()
        cap = max(1, bucket_cap_bytes // itemsize)
        direct = direct_numel(device, wire, bucket_cap_bytes, direct_min_bytes)
        packed: list[torch.Tensor] = []
        # Contiguous tensors reduced in place are all issued at once (async_op=True): the backend's worker threads
        # run them while this thread packs the bucket, and each is divided as soon as it is waited for.
        in_flight: list[tuple[dist.Work, torch.Tensor]] = []

        def drain() -> None:
            for work, t in in_flight:
                work.wait()
                if id(t) not in prescaled:
                    t.div_(divisor)
            in_flight.clear()

        for t in group_tensors:
            # Whether a tensor is reduced on its own or packed depends only on its dtype and size,
            # which the ranks agreed on (check_agreement), never on its strides: every rank issues the
            # same collectives, in the same order, even where one holds a transposed view and another a
            # contiguous tensor.
            if t.dtype == wire and t.numel() >= direct:
                if t.is_contiguous():
                    # An alias made here: only the backend adds references to it, whatever holds ``t``.
                    alias = t.detach()
                    hand_over(alias)
                    in_flight.append((dist.all_reduce(alias, op=dist.ReduceOp.SUM, group=group, async_op=True), t))
                else:
                    # One temporary contiguous copy of this tensor, reduced on its own, after those in flight
                    # (so that at most one such copy exists at a time).
                    drain()
                    tmp = t.contiguous()
                    hand_over(tmp)
                    dist.all_reduce(tmp, op=dist.ReduceOp.SUM, group=group)
                    if id(t) not in prescaled:
                        tmp.div_(divisor)
                    t.copy_(tmp)
                    del tmp
            else:
                packed.append(t)
        if packed:
            total = sum(t.numel() for t in packed)
            # Sliced to what this call needs: the chunking then depends only on the sizes the ranks
            # agreed on, never on how large this rank's pooled bucket grew in earlier calls.
            bucket = pool.get(device, wire, min(cap, total))[: min(cap, total)]
            reduce_packed(packed, bucket, group, divisor, before_wait=drain)
        drain()


def direct_numel(device: torch.device, wire: torch.dtype, bucket_cap_bytes: int, direct_min_bytes: int | None) -> int:
    """Elements from which a tensor of its wire dtype ``wire`` is all-reduced in its own storage on the pipelined path.

    On CPU a copy through the bucket costs about as much as sending the bytes, so tensors from
    ``DIRECT_MIN_BYTES["cpu"]`` on are reduced in place; elsewhere (GPU) copies are cheap and fewer, larger
    collectives win, so only tensors of a whole bucket are. ``direct_min_bytes`` overrides both.
    """
    itemsize = torch.empty((), dtype=wire).element_size()
    cap = max(1, bucket_cap_bytes // itemsize)
    if direct_min_bytes is not None:
        return max(1, direct_min_bytes // itemsize)
    return min(cap, max(1, DIRECT_MIN_BYTES["cpu"] // itemsize)) if device.type == "cpu" else cap


def reduce_packed(
    packed: list[torch.Tensor],
    bucket: torch.Tensor,
    group: dist.ProcessGroup,
    size: int | float,
    before_wait: Callable[[], None] | None = None,
) -> None:
    """Average ``packed`` (one wire dtype, any strides) through ``bucket``, pipelined.

    When the tensors do not fit in half the bucket, the bucket is used as two halves: while
    one half's all-reduce runs (``async_op=True``), the next half is packed; a half is
    unpacked only after its own all-reduce has completed, and is refilled only after that.
    Extra memory stays one bucket. Each half is packed with one ``torch.cat`` and unpacked
    with the division by ``size`` (the divisor) fused into the copy back (``torch.div(..., out=piece)``).
    A non-contiguous tensor is packed from one temporary contiguous copy, copied back once
    the half holding its last piece is unpacked. ``before_wait`` is called before each wait for a half
    (the caller's own collectives issued earlier complete first).
    """
    total = sum(t.numel() for t in packed)
    if total * bucket.element_size() >= _PIPELINE_MIN_BYTES and bucket.numel() >= 2:
        half = bucket.numel() // 2
        slots = (bucket[:half], bucket[half : 2 * half])
    else:  # too small to gain from overlap: one slot, each flush waits for the previous one
        half = bucket.numel()
        slots = (bucket,)
    # Per slot: (work, bucket view, pieces to unpack into, (tensor, temporary) to copy back).
    in_flight: list[tuple | None] = [None, None]

    def finish(i: int) -> None:
        record = in_flight[i]
        if record is None:
            return
        in_flight[i] = None
        work, view, pieces, backs = record
        if before_wait is not None:
            before_wait()
        work.wait()
        offset = 0
        for piece in pieces:
            n = piece.numel()
            torch.div(view[offset : offset + n], size, out=piece)
            offset += n
        for dst, src in backs:
            dst.copy_(src)

    cur = 0
    used = 0
    pending: list[torch.Tensor] = []
    backs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def flush() -> None:
        nonlocal cur, used, pending, backs
        finish(cur)
        view = slots[cur][:used]
        if len(pending) == 1:
            view.copy_(pending[0])
        else:
            torch.cat(pending, out=view)
        hand_over(view)
        work = dist.all_reduce(view, op=dist.ReduceOp.SUM, group=group, async_op=True)
        in_flight[cur] = (work, view, pending, backs)
        pending, backs, used = [], [], 0
        cur = (cur + 1) % len(slots)

    for t in packed:
        tmp = None if t.is_contiguous() else t.contiguous()
        flat = (t if tmp is None else tmp).view(-1)
        start = 0
        n = flat.numel()
        while start < n:
            take = min(n - start, half - used)
            pending.append(flat[start : start + take] if take < n else flat)
            used += take
            start += take
            if used == half:
                if tmp is not None and start == n:
                    backs.append((t, tmp))
                    tmp = None
                flush()
        if tmp is not None:
            backs.append((t, tmp))
        del tmp
    if used:
        flush()
    for _ in slots:  # the older slot first
        finish(cur)
        cur = (cur + 1) % len(slots)

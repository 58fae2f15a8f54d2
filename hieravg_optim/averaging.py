"""How to average: an in-place, bucketed all-reduce of a list of tensors.

This replaces ``torch.distributed.algorithms.model_averaging.utils.average_parameters``,
which concatenates every parameter into one new flat buffer (extra memory: the
whole model) and then *rebinds* ``p.data`` to slices of it. Rebinding breaks every
tensor that is a view into a flat buffer (FSDP flat parameters, DeepSpeed ZeRO
partitions): the buffer keeps the old values and the average is silently lost.

Here every result is written into each tensor's own storage with ``copy_``;
dtype, shape, strides and storage are kept, and views stay views.

Memory: one reusable bucket per (device, accumulation dtype), of at most
``bucket_cap_mb`` MB, plus, for a non-contiguous tensor, one temporary contiguous
copy of that tensor. Contiguous tensors of the accumulation dtype at least as large
as a bucket (on CPU: at least 4 MiB, where copying costs about as much as sending)
are all-reduced in place, with no copy. A bucket is used as two halves, so that one
half's all-reduce overlaps packing the other; a half is packed with one ``torch.cat``
and unpacked with the division by the group size fused into the copy back.

Accumulation dtype: float16 and bfloat16 tensors are summed in float32 buckets
(twice the traffic of those tensors, but no overflow and no loss of the low bits
when summing up to thousands of replicas); the mean is rounded once, back to the
tensor's dtype. float32 and float64 are summed in their own dtype. The sum is
divided by the group size after the all-reduce, so means of small integers are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._handover import hand_over

__all__ = ["BucketPool", "accumulation_dtype", "average_tensors_", "overlaps_itself"]

_HALF = (torch.float16, torch.bfloat16)

_PIPELINE_MIN_BYTES = 1 << 20
"""Packed tensors of at least this many bytes in total go through the bucket as two pipelined halves."""

_DIRECT_MIN_BYTES_CPU = 4 << 20
"""On CPU, tensors of the accumulation dtype of at least this many bytes are all-reduced in place
(no copy into a bucket); measured with ``bench/averaging.py`` (gloo, 2 and 4 ranks)."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which tensors of ``dtype`` are summed: float32 for float16 and bfloat16, else ``dtype``."""
    return torch.float32 if dtype in _HALF else dtype


class BucketPool:
    """Reusable communication buckets, one per (device, accumulation dtype).

    A bucket is allocated on first use with ``min(cap, elements needed)`` elements
    and grows, never beyond the cap, when a later round needs more.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(key, None)
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes held by all buckets."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Free every bucket."""
        self._buffers.clear()


def _reduce_packed(packed: list[torch.Tensor], bucket: torch.Tensor, group: dist.ProcessGroup, size: int) -> None:
    """Average ``packed`` (same accumulation dtype, any strides) through ``bucket``, pipelined.

    When the tensors do not fit in half the bucket, the bucket is used as two halves: while
    one half's all-reduce runs (``async_op=True``), the next half is packed; a half is
    unpacked only after its own all-reduce has completed, and is refilled only after that.
    Extra memory stays one bucket. Each half is packed with one ``torch.cat`` and unpacked
    with the division by ``size`` fused into the copy back (``torch.div(..., out=piece)``).
    A non-contiguous tensor is packed from one temporary contiguous copy, copied back once
    the half holding its last piece is unpacked.
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


def average_tensors_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    group_size: int,
    *,
    bucket_cap_bytes: int,
    pool: BucketPool,
    divisor: int | None = None,
) -> int:
    """Replace every tensor by its mean over ``group``, in place.

    .. warning::
        Collective: every rank of ``group`` must call this with tensors of the same
        number, shapes and dtypes, in the same order (see :func:`hieravg_optim.agreement.check_agreement`).

    Args:
        tensors: Floating-point (or complex) plain tensors, of any shape and strides; views are fine.
            Empty tensors are skipped.
        group: The process group to average over.
        group_size: ``group``'s size.
        bucket_cap_bytes: Upper bound of one bucket, in bytes.
        pool: Where the reusable buckets live.
        divisor: What the sum over ``group`` is divided by; ``None`` (default): ``group_size``. With
            ranks that contribute zeros (``nonfinite="skip_replica"``), the number of ranks that
            contribute, so that the result is the mean of their tensors.

    Returns:
        The payload this rank all-reduced, in bytes (accumulation dtype).

    Raises:
        TypeError: for a tensor that is not floating point or complex.
    """
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for index, t in enumerate(tensors):
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"Only floating-point tensors can be averaged, got dtype {t.dtype} of shape {tuple(t.shape)}.")
        if overlaps_itself(t):
            # Checked before any collective; ranks that differ in this fail check_agreement instead.
            raise TypeError(
                f"Tensor {index} to average (shape {tuple(t.shape)}, strides {t.stride()}) is internally overlapping "
                "(e.g. made by expand()): several of its elements share one memory location, so it cannot hold "
                "their means. Average the tensor it was expanded from, or pass a .clone()."
            )
        if t.numel() == 0:
            continue
        by_key.setdefault((t.device, accumulation_dtype(t.dtype)), []).append(t)

    if divisor is not None:
        group_size = divisor  # only ever used below to divide the sum
    payload = 0
    for (device, acc), group_tensors in by_key.items():
        itemsize = torch.empty((), dtype=acc).element_size()
        cap = max(1, bucket_cap_bytes // itemsize)
        # On CPU a copy through the bucket costs about as much as sending the bytes, so tensors
        # from _DIRECT_MIN_BYTES_CPU on are reduced in place; elsewhere (GPU) copies are cheap
        # and fewer, larger collectives win, so only tensors of a whole bucket are.
        direct = min(cap, max(1, _DIRECT_MIN_BYTES_CPU // itemsize)) if device.type == "cpu" else cap
        packed: list[torch.Tensor] = []
        for t in group_tensors:
            payload += t.numel() * itemsize
            # Whether a tensor is reduced on its own or packed depends only on its dtype and size,
            # which the ranks agreed on (check_agreement), never on its strides: every rank issues the
            # same collectives even where one holds a transposed view and another a contiguous tensor.
            if t.dtype == acc and t.numel() >= direct:
                if t.is_contiguous():
                    # An alias made here: only the backend adds references to it, whatever holds ``t``.
                    alias = t.detach()
                    hand_over(alias)
                    dist.all_reduce(alias, op=dist.ReduceOp.SUM, group=group)
                    t.div_(group_size)
                else:
                    # One temporary contiguous copy of this tensor, reduced on its own.
                    tmp = t.contiguous()
                    hand_over(tmp)
                    dist.all_reduce(tmp, op=dist.ReduceOp.SUM, group=group)
                    tmp.div_(group_size)
                    t.copy_(tmp)
                    del tmp
            else:
                packed.append(t)
        if not packed:
            continue
        total = sum(t.numel() for t in packed)
        # Sliced to what this call needs: the chunking then depends only on the sizes the ranks
        # agreed on, never on how large this rank's pooled bucket grew in earlier calls.
        _reduce_packed(packed, pool.get(device, acc, min(cap, total))[: min(cap, total)], group, group_size)
    return payload


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share a memory location (a stride of 0, as from ``expand()``)."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        return True
    return torch._debug_has_internal_overlap(t) == 1

"""How to average: an in-place, bucketed all-reduce of a list of tensors.

This replaces ``torch.distributed.algorithms.model_averaging.utils.average_parameters``,
which concatenates every parameter into one new flat buffer (extra memory: the
whole model) and then *rebinds* ``p.data`` to slices of it. Rebinding breaks every
tensor that is a view into a flat buffer (FSDP flat parameters, DeepSpeed ZeRO
partitions): the buffer keeps the old values and the average is silently lost.

Here every result is written into each tensor's own storage with ``copy_``;
dtype, shape, strides and storage are kept, and views stay views.

Wire dtype (``comm_dtype``): by default each tensor travels in its own dtype, as in
torch: bfloat16 tensors are summed in bfloat16, float32 in float32; float16, whose sum would
overflow near 65504, in float32. A level may send
every floating-point tensor in one dtype instead (``"float32"``: float16 / bfloat16
summed in float32; ``"bfloat16"``: float32 masters rounded to bfloat16 on the wire
only). See :mod:`hieravg_optim.comm_dtype`.

Two paths, the same results (exact means of small integers in every dtype):

* ``"coalesced"`` (the default on GPUs): contiguous tensors of their wire dtype of at
  least ``direct_min_bytes`` (1 MiB on GPU) are all-reduced in their own storage, with
  no copy; the others are packed into one bucket per wire dtype with one foreach copy.
  All of a round's all-reduces are issued in one coalesced group (NCCL, through
  :func:`torch.distributed._coalescing_manager`), with ``ReduceOp.AVG`` where the
  backend has it, else SUM followed by one ``torch._foreach_div_``; the bucket is
  unpacked with one foreach copy.
* ``"pipelined"`` (the default on CPU, where it measured faster, see
  ``bench/averaging.py``): tensors from 4 MiB on are all-reduced in place one by one;
  the others go through a bucket used as two halves, so that one half's all-reduce
  overlaps packing the other; a half is packed with one ``torch.cat`` and unpacked with
  the division fused into the copy back.

A level spanning several nodes may average node-aware (``node``): through the bucket,
reduce-scatter inside the node, all-reduce of the shards across nodes, all-gather
inside the node.

Memory: at most one reusable bucket per (device, wire dtype), of at most
``bucket_cap_mb`` MB (plus one shard of it, node-aware), plus, for a non-contiguous
tensor reduced in place, one temporary contiguous copy of that tensor. The sum is
divided by the group size (or a given divisor) after the all-reduce, so means of small
integers are exact.

A float16 wire (``comm_dtype="float16"``) is checked for overflow: its tensors go through one
buffer of their whole float16 payload (kept in the pool instead of a bucket), and a non-finite
all-reduced element raises :class:`WireOverflowError` on every rank before any tensor is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ._handover import hand_over
from .comm_dtype import COMM_DTYPES, wire_dtype

__all__ = [
    "BucketPool",
    "NodeGroups",
    "WireOverflowError",
    "accumulation_dtype",
    "average_tensors_",
    "overlaps_itself",
]

_HALF = (torch.float16, torch.bfloat16)

_PIPELINE_MIN_BYTES = 1 << 20
"""Packed tensors of at least this many bytes in total go through the bucket as two pipelined halves."""

_DIRECT_MIN_BYTES_CPU = 4 << 20
"""On CPU, tensors of the accumulation dtype of at least this many bytes are all-reduced in place
(no copy into a bucket); measured with ``bench/averaging.py`` (gloo, 2 and 4 ranks)."""


_DIRECT_MIN_BYTES = {"cpu": 4 << 20, "cuda": 1 << 20}
"""For the coalesced path: tensors of their wire dtype of at least this many bytes are all-reduced in place."""

_AUTO_PATH: dict[str, Path] = {"cpu": "pipelined"}
"""The path ``path="auto"`` takes per device type (others: ``"coalesced"``), measured with ``bench/averaging.py``."""


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


def _reduce_packed(
    packed: list[torch.Tensor], bucket: torch.Tensor, group: dist.ProcessGroup, size: int | float
) -> None:
    """Average ``packed`` (same accumulation dtype, any strides) through ``bucket``, pipelined.

    When the tensors do not fit in half the bucket, the bucket is used as two halves: while
    one half's all-reduce runs (``async_op=True``), the next half is packed; a half is
    unpacked only after its own all-reduce has completed, and is refilled only after that.
    Extra memory stays one bucket. Each half is packed with one ``torch.cat`` and unpacked
    with the division by ``size`` (the divisor) fused into the copy back (``torch.div(..., out=piece)``).
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


@dataclass(frozen=True, slots=True)
class NodeGroups:
    """The subgroups of a node-aware level, for this rank (see :func:`hieravg_optim.groups.build_level_groups`).

    The ``n = local_size * cross_size`` ranks of an averaging subgroup are split by node: the
    ``local_size`` of them on this rank's node form :attr:`local`, and the ``cross_size`` ranks
    with this rank's index on every node form :attr:`cross`.
    """

    local: dist.ProcessGroup
    """This rank's subgroup members on its own node (reduce-scatter and all-gather)."""
    local_size: int
    """Ranks in :attr:`local`, at least 2."""
    cross: dist.ProcessGroup | None
    """The members with this rank's index on every node (all-reduce of the shards); ``None`` for one node."""
    cross_size: int
    """Ranks in :attr:`cross`: the nodes the subgroup spans."""


def _flat_pieces(
    packed: list[tuple[torch.Tensor, torch.dtype]], cap: int, multiple: int = 1
) -> list[list[tuple[torch.Tensor, int, int, torch.Tensor | None, torch.Tensor]]]:
    """Split ``packed`` (tensor, wire dtype) into chunks of at most ``cap`` elements.

    Returns per chunk a list of ``(destination, offset, numel, copy_back_to, source)``; a tensor that fits
    in a chunk is its own destination (any strides: copies handle them), a tensor that straddles chunks
    is cut into flat slices of itself, or of one temporary contiguous copy when it is not contiguous
    (``copy_back_to`` is then the tensor, set on its last piece). The cut depends only on the sizes,
    which the ranks agreed on, never on the strides.
    """
    chunks: list[list] = [[]]
    used = 0
    for t, _ in packed:
        n = t.numel()
        if used + n <= cap:
            chunks[-1].append((t, used, n, None, t))
            used += n
            continue
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)
        start = 0
        while start < n:
            if used == cap:
                chunks.append([])
                used = 0
            take = min(n - start, cap - used)
            last = start + take == n
            back = t if last and flat.data_ptr() != t.data_ptr() else None
            chunks[-1].append((flat[start : start + take], used, take, back, flat))
            used += take
            start += take
    return chunks


def _pack(chunk: list, bucket: torch.Tensor) -> None:
    dsts = [bucket[o : o + n].view(d.shape) for d, o, n, _, _ in chunk]
    torch._foreach_copy_(dsts, [d for d, _, _, _, _ in chunk])


def _unpack(chunk: list, bucket: torch.Tensor, divisor: float | None) -> None:
    """Copy a reduced chunk back with one foreach copy, dividing by ``divisor`` in the wider of the two dtypes.

    Pieces whose dtype is at most as wide as the wire dtype are divided in the bucket, before the copy
    (one rounding); wider ones (float32 masters sent as bfloat16) after it, in their own dtype.
    """
    views = [bucket[o : o + n].view(d.shape) for d, o, n, _, _ in chunk]
    dsts = [d for d, _, _, _, _ in chunk]
    if divisor is not None:
        narrow = [v for v, d in zip(views, dsts) if d.element_size() <= bucket.element_size()]
        if len(narrow) == len(views):
            bucket.div_(divisor)
        elif narrow:
            torch._foreach_div_(narrow, divisor)
    torch._foreach_copy_(dsts, views)
    if divisor is not None:
        wide = [d for d in dsts if d.element_size() > bucket.element_size()]
        if wide:
            torch._foreach_div_(wide, divisor)
    for _, _, _, back, src in chunk:
        if back is not None:
            back.copy_(src.view(back.shape))


def _reduce_coalesced(
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
        chunks[(device, wire)] = _flat_pieces(items, cap)
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
        _pack(chunk, view)
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
        _unpack(chunk, view, None if use_avg else divisor)
    for key, key_chunks in chunks.items():
        for chunk in key_chunks[1:]:
            view = buckets[key][: sum(n for _, _, n, _, _ in chunk)]
            _pack(chunk, view)
            hand_over(view)
            dist.all_reduce(view, op=op, group=group)
            _unpack(chunk, view, None if use_avg else divisor)


def _reduce_node_aware(
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
        for chunk in _flat_pieces(items, cap):
            used = sum(n for _, _, n, _, _ in chunk)
            padded = -(-used // m) * m
            view = bucket[:padded]
            _pack(chunk, view)
            view[used:].zero_()
            shard = torch.empty(padded // m, dtype=wire, device=device)
            hand_over(view)
            _reduce_scatter(shard, view, node.local)
            if node.cross is not None:
                dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=node.cross)
            _all_gather(view, shard, node.local)
            _unpack(chunk, view, divisor)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=dist.ReduceOp.SUM, group=group)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


class WireOverflowError(RuntimeError):
    """A float16 all-reduce (``comm_dtype="float16"``) produced a NaN or an infinity; no tensor was written.

    Raised by :func:`average_tensors_` on every rank of the group alike: the all-reduced data is the
    same on every rank, so every rank decides the same way, without a collective.
    """


_CHECKED_WIRE = (torch.float16,)
"""Wire dtypes whose all-reduced sums are checked for overflow before any tensor is written (float16's
largest value is 65504: a sum of a few replicas' values near it overflows, where a float32 or bfloat16 sum
would need values near 3.4e38)."""


def _reduce_staged(
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
        (chunk,) = _flat_pieces(items, total)
        if contribute_zeros:
            buffer[:total].zero_()
        else:
            _pack(chunk, buffer[:total])
        buffer[total:].zero_()
        hand_over(buffer)
        if node is None:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        else:
            shard = torch.empty(padded // m, dtype=wire, device=device)
            _reduce_scatter(shard, buffer, node.local)
            if node.cross is not None:
                dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=node.cross)
            _all_gather(buffer, shard, node.local)
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
        _unpack(chunk, view, divisor)


Path = Literal["auto", "pipelined", "coalesced"]
ReduceOpName = Literal["auto", "avg", "sum"]


def average_tensors_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    group_size: int,
    *,
    bucket_cap_bytes: int,
    pool: BucketPool,
    comm_dtype: str | None = None,
    divisor: float | None = None,
    node: NodeGroups | None = None,
    path: Path = "auto",
    reduce_op: ReduceOpName = "auto",
    direct_min_bytes: int | None = None,
    coalesce: bool | None = None,
    check_wire: bool = True,
    what: str = "the averaging round",
    contribute_zeros: bool = False,
) -> int:
    """Replace every tensor by its mean over ``group`` (or its sum divided by ``divisor``), in place.

    .. warning::
        Collective: every rank of ``group`` must call this with tensors of the same
        number, shapes and dtypes, in the same order, and the same keyword arguments
        (see :func:`hieravg_optim.agreement.check_agreement`).

    Args:
        tensors: Floating-point (or complex) plain tensors, of any shape and strides; views are fine.
            Empty tensors are skipped.
        group: The process group to average over.
        group_size: ``group``'s size.
        bucket_cap_bytes: Upper bound of one bucket, in bytes.
        pool: Where the reusable buckets live.
        comm_dtype: The wire dtype name (a key of :data:`hieravg_optim.comm_dtype.COMM_DTYPES`);
            ``None`` sends each tensor in its own dtype. Tensors are rounded to it on the wire only.
        divisor: Divide the all-reduced SUM by this instead of ``group_size`` (for a mean over fewer
            replicas, whose excluded ranks contribute zeros); forces ``ReduceOp.SUM``.
        node: The node subgroups of ``group`` for a node-aware round (reduce-scatter in the node,
            all-reduce across nodes, all-gather); ``None`` for one flat all-reduce.
        path: ``"coalesced"``: large contiguous tensors in place in one group, the rest in one bucket,
            unpacked with foreach copies; ``"pipelined"``: through a bucket used as two pipelined halves,
            tensors of at least ``direct_min_bytes`` in place one by one; ``"auto"``: the faster measured
            one for the device (``bench/averaging.py``, ``bench/gpu_averaging.py``).
        reduce_op: ``"avg"``: ``ReduceOp.AVG`` (backends that have it, e.g. NCCL); ``"sum"``: SUM then
            division; ``"auto"``: AVG on NCCL when ``divisor`` is ``None``, else SUM.
        direct_min_bytes: Tensors of their wire dtype of at least this many bytes are all-reduced in
            their own storage; ``None``: the measured default of the device and path.
        coalesce: Coalesced path: issue the round's all-reduces in one
            :func:`torch.distributed._coalescing_manager` group per dtype (``True``), or one by one,
            asynchronously (``False``); ``None``: on NCCL only (gloo's coalesced all-reduce copies
            into one flat buffer).
        check_wire: Check the all-reduced sums of a float16 wire (``comm_dtype="float16"``) for overflow before
            any tensor is written. Those tensors then go through one buffer of the whole float16 payload
            (extra memory: that payload, once), all-reduced before the others, and an overflow raises
            :class:`WireOverflowError` on every rank with every tensor unchanged. ``False``: the float16
            wire is bucketed like the others and an overflow writes infinities (``nonfinite="ignore"``).
        what: Names the round in the error message (the averager passes the step count and the level).
        contribute_zeros: This rank adds zeros to the sum instead of its tensors, and gets the result like
            every rank (``nonfinite="skip_replica"``: a non-finite replica, with ``divisor`` the number of
            the others). Its tensors are zeroed only once the checked float16 wire, if any, has passed, so a
            :class:`WireOverflowError` leaves them unchanged too.

    Returns:
        The payload this rank all-reduced, in bytes of the wire dtypes.

    Raises:
        TypeError: for a tensor that is not floating point or complex.
        ValueError: for an unknown ``path``, ``reduce_op`` or ``comm_dtype``, or a non-positive ``divisor``.
        WireOverflowError: (a ``RuntimeError``) with ``check_wire``, on every rank of ``group``, if a float16
            all-reduce produced a NaN or an infinity; no tensor has been written.
    """
    if path not in ("auto", "pipelined", "coalesced"):
        raise ValueError(f'path must be "auto", "pipelined" or "coalesced", got {path!r}.')
    if reduce_op not in ("auto", "avg", "sum"):
        raise ValueError(f'reduce_op must be "auto", "avg" or "sum", got {reduce_op!r}.')
    if comm_dtype is not None and comm_dtype not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be one of {list(COMM_DTYPES)} or None, got {comm_dtype!r}.")
    if divisor is not None and not divisor > 0:
        raise ValueError(f"divisor must be a positive number of replicas, got {divisor!r}.")
    items: list[tuple[torch.Tensor, torch.dtype]] = []
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
        items.append((t, wire_dtype(t.dtype, comm_dtype)))
    payload = sum(t.numel() * torch.empty((), dtype=w).element_size() for t, w in items)
    if not items:
        return payload
    div = float(group_size if divisor is None else divisor)
    if check_wire and any(w in _CHECKED_WIRE for _, w in items):
        # First, so that an overflow raises before any other tensor is averaged either.
        staged: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.dtype]]] = {}
        for t, w in items:
            if w in _CHECKED_WIRE:
                staged.setdefault((t.device, w), []).append((t, w))
        _reduce_staged(staged, group, div, pool, node, what, contribute_zeros=contribute_zeros)
        items = [(t, w) for t, w in items if w not in _CHECKED_WIRE]
        if not items:
            return payload
    if contribute_zeros:
        for t, _ in items:
            t.zero_()
    by_key: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.dtype]]] = {}
    if node is not None:
        for t, w in items:
            by_key.setdefault((t.device, w), []).append((t, w))
        _reduce_node_aware(by_key, node, div, bucket_cap_bytes, pool)
        return payload
    device_type = items[0][0].device.type
    if path == "auto":
        path = _AUTO_PATH.get(device_type, "coalesced")
    if path == "pipelined":
        _average_pipelined(items, group, div, bucket_cap_bytes, pool, direct_min_bytes)
        return payload
    nccl = _backend(group) == "nccl"
    use_avg = reduce_op == "avg" or (reduce_op == "auto" and nccl and divisor is None)
    if use_avg and divisor is not None and divisor != group_size:
        raise ValueError(f'reduce_op="avg" divides by the group size ({group_size}), not divisor={divisor!r}.')
    threshold = _DIRECT_MIN_BYTES.get(device_type, 1 << 20) if direct_min_bytes is None else direct_min_bytes
    direct = []
    for t, w in items:
        # Whether a tensor is reduced in place depends only on its dtype and size, which the ranks agreed
        # on (check_agreement), never on its strides: every rank issues the same collectives.
        if t.dtype == w and t.numel() * t.element_size() >= threshold:
            direct.append(t)
        else:
            by_key.setdefault((t.device, w), []).append((t, w))
    _reduce_coalesced(
        direct, by_key, group, div, use_avg, bucket_cap_bytes, pool, coalesce=nccl if coalesce is None else coalesce
    )
    return payload


def _backend(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):  # pragma: no cover - a group torch cannot name
        return ""


def _average_pipelined(
    items: list[tuple[torch.Tensor, torch.dtype]],
    group: dist.ProcessGroup,
    divisor: float,
    bucket_cap_bytes: int,
    pool: BucketPool,
    direct_min_bytes: int | None,
) -> None:
    """The pipelined path: tensors in place one by one from a size on, the rest through two bucket halves."""
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t, w in items:
        by_key.setdefault((t.device, w), []).append(t)
    for (device, acc), group_tensors in by_key.items():
        itemsize = torch.empty((), dtype=acc).element_size()
        cap = max(1, bucket_cap_bytes // itemsize)
        # On CPU a copy through the bucket costs about as much as sending the bytes, so tensors
        # from _DIRECT_MIN_BYTES_CPU on are reduced in place; elsewhere (GPU) copies are cheap
        # and fewer, larger collectives win, so only tensors of a whole bucket are.
        if direct_min_bytes is not None:
            direct = max(1, direct_min_bytes // itemsize)
        else:
            direct = min(cap, max(1, _DIRECT_MIN_BYTES_CPU // itemsize)) if device.type == "cpu" else cap
        packed: list[torch.Tensor] = []
        for t in group_tensors:
            # Whether a tensor is reduced on its own or packed depends only on its dtype and size,
            # which the ranks agreed on (check_agreement), never on its strides: every rank issues the
            # same collectives even where one holds a transposed view and another a contiguous tensor.
            if t.dtype == acc and t.numel() >= direct:
                if t.is_contiguous():
                    # An alias made here: only the backend adds references to it, whatever holds ``t``.
                    alias = t.detach()
                    hand_over(alias)
                    dist.all_reduce(alias, op=dist.ReduceOp.SUM, group=group)
                    t.div_(divisor)
                else:
                    # One temporary contiguous copy of this tensor, reduced on its own.
                    tmp = t.contiguous()
                    hand_over(tmp)
                    dist.all_reduce(tmp, op=dist.ReduceOp.SUM, group=group)
                    tmp.div_(divisor)
                    t.copy_(tmp)
                    del tmp
            else:
                packed.append(t)
        if not packed:
            continue
        total = sum(t.numel() for t in packed)
        # Sliced to what this call needs: the chunking then depends only on the sizes the ranks
        # agreed on, never on how large this rank's pooled bucket grew in earlier calls.
        _reduce_packed(packed, pool.get(device, acc, min(cap, total))[: min(cap, total)], group, divisor)


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share a memory location (a stride of 0, as from ``expand()``)."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        return True
    return torch._debug_has_internal_overlap(t) == 1

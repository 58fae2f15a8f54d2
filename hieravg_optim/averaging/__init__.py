"""How to average: an in-place, bucketed all-reduce of a list of tensors.

Every result is written into each tensor's own storage with ``copy_`` (never by rebinding ``.data``);
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
  ``bench/averaging.py``): tensors from 4 MiB on are all-reduced in place, all issued at once (``async_op=True``);
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

The non-finite guard of a round (``nonfinite="raise"`` or ``"skip_replica"``) is fused into the division where it
can be: :func:`prescale_checked_` divides the tensors that the pipelined path reduces in place by the group size
before the SUM all-reduce instead of after it, with one fused pass that also checks them for NaN and infinities
(``torch._amp_foreach_non_finite_check_and_unscale_``, GradScaler's kernel), for a group size that is a power of
two, whose scaling is exact; only the other tensors are read by a separate check
(:func:`hieravg_optim.nonfinite.has_nonfinite`).

A float16 wire (``comm_dtype="float16"``) is checked for overflow: its tensors go through one
buffer of their whole float16 payload (kept in the pool instead of a bucket), and a non-finite
all-reduced element raises :class:`WireOverflowError` on every rank before any tensor is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from ..comm_dtype import COMM_DTYPES, wire_dtype
from ..groups import NodeGroups
from ..nonfinite import has_nonfinite
from ..tensors import overlaps_itself
from .buckets import DIRECT_MIN_BYTES, BucketPool
from .checked_wire import CHECKED_WIRE, WireOverflowError, reduce_staged
from .coalesced import reduce_coalesced
from .node_aware import reduce_node_aware
from .pipelined import average_pipelined, direct_numel

__all__ = [
    "BucketPool",
    "NodeGroups",
    "Prescaled",
    "WireOverflowError",
    "average_tensors_",
    "overlaps_itself",
    "prescale_checked_",
]
# NodeGroups (now in hieravg_optim.groups) and overlaps_itself (hieravg_optim.tensors) are re-exported
# for the old import path.

Path = Literal["auto", "pipelined", "coalesced"]
ReduceOpName = Literal["auto", "avg", "sum"]

_AUTO_PATH: dict[str, Path] = {"cpu": "pipelined"}
"""The path ``path="auto"`` takes per device type (others: ``"coalesced"``), measured with ``bench/averaging.py``."""


class Prescaled:
    """What :func:`prescale_checked_` did: the tensors it divided in place, by what, and whether any was non-finite.

    Pass it to :func:`average_tensors_` (``prescaled=``), which then does not divide those tensors again, or call
    :meth:`undo` first when the round does not run as planned (a non-finite replica, an error).
    """

    __slots__ = ("divisor", "ids", "nonfinite", "scaled")

    def __init__(self, scaled: list[torch.Tensor], divisor: int, nonfinite: bool) -> None:
        self.scaled = scaled
        """The tensors divided in place by ``divisor``."""
        self.divisor = divisor
        """The group size they were divided by, a power of two."""
        self.nonfinite = nonfinite
        """Whether any of the tensors checked (all of them, scaled or not) holds a NaN or an infinity."""
        self.ids = frozenset(id(t) for t in scaled)

    def undo(self) -> None:
        """Multiply the scaled tensors back by ``divisor``, in place (exact for a power of two, see
        :func:`prescale_checked_`), and forget them; a second call does nothing. Local, no collective."""
        if self.scaled:
            with torch.no_grad():
                torch._foreach_mul_(self.scaled, float(self.divisor))
        self.scaled = []
        self.ids = frozenset()


def prescale_checked_(
    tensors: Sequence[torch.Tensor],
    group_size: int,
    *,
    bucket_cap_bytes: int,
    comm_dtype: str | None = None,
    node: NodeGroups | None = None,
    path: Path = "auto",
    direct_min_bytes: int | None = None,
) -> Prescaled:
    """Check ``tensors`` for NaN and infinities, dividing in the same pass those that the round reduces in place.

    The non-finite guard fused into the division: a tensor that :func:`average_tensors_` with the same arguments
    all-reduces in its own storage (pipelined path, wire dtype its own, from ``direct_min_bytes`` or the device's
    default on) would be divided by ``group_size`` in a pass of its own after the SUM all-reduce. Divided before it
    instead, by one ``torch._amp_foreach_non_finite_check_and_unscale_`` call per device (the fused kernel of
    ``torch.amp.GradScaler``: one read and one write of each element, which it also checks), the guard costs no
    extra pass over these tensors; the others (packed through the bucket, where the division is fused into the
    copy back) are read once by :func:`hieravg_optim.nonfinite.has_nonfinite`. Local, no collective.

    Only for a ``group_size`` that is a power of two (2, 4, 8, ...), none of whose ranks is skipped, on the flat
    pipelined path: dividing by a power of two is exact, so the SUM of the divided tensors is bitwise the mean
    that the division after the SUM gives, and :meth:`Prescaled.undo` gives every tensor back bitwise. The one
    exception is the range of subnormal results: an element of magnitude below ``2**-126 * group_size``
    (float32 and bfloat16; ``2**-1022 * group_size`` in float64) whose quotient is not representable is rounded,
    by at most half a subnormal step (``2**-150`` in float32): such an element's mean and its value after
    :meth:`Prescaled.undo` can differ from the division after the SUM in that last subnormal bit. Otherwise (and
    for complex tensors) nothing is divided and every tensor is read by
    :func:`~hieravg_optim.nonfinite.has_nonfinite`.

    Args:
        tensors: The tensors of the round, as passed to :func:`average_tensors_`.
        group_size: The size of the group the round averages over.
        bucket_cap_bytes, comm_dtype, node, path, direct_min_bytes: As for :func:`average_tensors_`.

    Returns:
        A :class:`Prescaled`: the tensors divided (empty where none is) and whether any tensor is non-finite.
        A non-finite tensor that is divided stays non-finite (NaN stays NaN, an infinity an infinity).
    """
    candidates: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    resolved = path
    first = next((t for t in tensors if t.numel()), None)  # the tensor average_tensors_ resolves "auto" by
    if first is not None and path == "auto":
        resolved = _AUTO_PATH.get(first.device.type, "coalesced")
    fused = resolved == "pipelined" and node is None and group_size > 1 and group_size & (group_size - 1) == 0
    for t in tensors:
        if fused and t.is_floating_point() and t.numel() and not overlaps_itself(t):
            wire = wire_dtype(t.dtype, comm_dtype)
            if wire == t.dtype and wire not in CHECKED_WIRE and t.numel() >= direct_numel(
                t.device, wire, bucket_cap_bytes, direct_min_bytes
            ):
                candidates.append(t)
                continue
        rest.append(t)
    nonfinite = has_nonfinite(rest)  # first: if it raises, nothing has been divided
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in candidates:
        by_device.setdefault(t.device, []).append(t)
    scaled: list[torch.Tensor] = []
    with torch.no_grad():
        for device, members in by_device.items():
            found = torch.zeros(1, device=device)
            inverse = torch.full((1,), 1.0 / group_size, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(members, found, inverse)
            scaled += members
            nonfinite = nonfinite or bool(found.item())
    return Prescaled(scaled, group_size, nonfinite)


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
    prescaled: Prescaled | None = None,
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
            tensors of at least ``direct_min_bytes`` in place, all issued at once; ``"auto"``: the faster measured
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
        prescaled: What :func:`prescale_checked_` returned for these tensors and arguments: the tensors it divided
            are all-reduced and not divided again. Only with ``divisor=None`` and ``contribute_zeros=False``; if
            this call raises before its first collective, it first calls :meth:`Prescaled.undo`.

    Returns:
        The payload this rank all-reduced, in bytes of the wire dtypes.

    Raises:
        TypeError: for a tensor that is not floating point or complex.
        ValueError: for an unknown ``path``, ``reduce_op`` or ``comm_dtype``, or a non-positive ``divisor``.
        WireOverflowError: (a ``RuntimeError``) with ``check_wire``, on every rank of ``group``, if a float16
            all-reduce produced a NaN or an infinity; no tensor has been written.
    """
    try:
        items = _validated(tensors, path, reduce_op, comm_dtype, divisor)
        if prescaled is not None and prescaled.scaled and (
            divisor is not None or contribute_zeros or prescaled.divisor != group_size
        ):
            raise ValueError(
                f"prescaled holds tensors divided by {prescaled.divisor}: average them over a group of that size, with "
                f"divisor=None and contribute_zeros=False (got group_size={group_size}, divisor={divisor!r}, "
                f"contribute_zeros={contribute_zeros}), or call prescaled.undo() first."
            )
    except BaseException:
        if prescaled is not None:
            prescaled.undo()
        raise
    payload = sum(t.numel() * torch.empty((), dtype=w).element_size() for t, w in items)
    if not items:
        return payload
    div = float(group_size if divisor is None else divisor)
    if check_wire and any(w in CHECKED_WIRE for _, w in items):
        # First, so that an overflow raises before any other tensor is averaged either.
        staged: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.dtype]]] = {}
        for t, w in items:
            if w in CHECKED_WIRE:
                staged.setdefault((t.device, w), []).append((t, w))
        reduce_staged(staged, group, div, pool, node, what, contribute_zeros=contribute_zeros)
        items = [(t, w) for t, w in items if w not in CHECKED_WIRE]
        if not items:
            return payload
    if contribute_zeros:
        for t, _ in items:
            t.zero_()
    by_key: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.dtype]]] = {}
    if node is not None:
        for t, w in items:
            by_key.setdefault((t.device, w), []).append((t, w))
        reduce_node_aware(by_key, node, div, bucket_cap_bytes, pool)
        return payload
    device_type = items[0][0].device.type
    if path == "auto":
        path = _AUTO_PATH.get(device_type, "coalesced")
    if path == "pipelined":
        ids = frozenset() if prescaled is None else prescaled.ids
        average_pipelined(items, group, div, bucket_cap_bytes, pool, direct_min_bytes, ids)
        return payload
    # prescale_checked_ divides nothing for this path (nor for node-aware rounds).
    assert prescaled is None or not prescaled.scaled
    nccl = _backend(group) == "nccl"
    use_avg = reduce_op == "avg" or (reduce_op == "auto" and nccl and divisor is None)
    if use_avg and divisor is not None and divisor != group_size:
        raise ValueError(f'reduce_op="avg" divides by the group size ({group_size}), not divisor={divisor!r}.')
    threshold = DIRECT_MIN_BYTES.get(device_type, 1 << 20) if direct_min_bytes is None else direct_min_bytes
    direct = []
    for t, w in items:
        # Whether a tensor is reduced in place depends only on its dtype and size, which the ranks agreed
        # on (check_agreement), never on its strides: every rank issues the same collectives.
        if t.dtype == w and t.numel() * t.element_size() >= threshold:
            direct.append(t)
        else:
            by_key.setdefault((t.device, w), []).append((t, w))
    reduce_coalesced(
        direct, by_key, group, div, use_avg, bucket_cap_bytes, pool, coalesce=nccl if coalesce is None else coalesce
    )
    return payload


def _validated(
    tensors: Sequence[torch.Tensor],
    path: str,
    reduce_op: str,
    comm_dtype: str | None,
    divisor: float | None,
) -> list[tuple[torch.Tensor, torch.dtype]]:
    """:func:`average_tensors_`'s checks of its arguments, before any collective.

    Returns its non-empty tensors, each with its wire dtype."""
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
    return items


def _backend(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):  # pragma: no cover - a group torch cannot name
        return ""

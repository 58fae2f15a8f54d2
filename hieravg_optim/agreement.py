"""Whether the ranks agree: checks before a collective, and errors raised together on every rank.

A rank whose local check fails must not simply raise: the other ranks would wait for it in
their next collective until the process group's timeout. The functions here cost one small
collective each (one more, gathering the details, only on a failure or a disagreement); then
every rank of the group raises, the failed rank its own error, the others a ``RuntimeError``
naming that rank and its error, or the two ranks that disagree and their values.

* :func:`agree_across_ranks`: the ranks hold the same value (a config, a step count) and none
  failed its local checks; :func:`raise_on_every_rank` is its failure-only form.
* :func:`check_agreement`: the ranks of an averaging group are about to average the same
  tensors (number, shapes, dtypes) at the same step count; :func:`tensor_signature` is what
  they compare, :func:`digest` how, :func:`describe_difference` how a mismatch is reported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._compat import process_group_timeout
from ._handover import hand_over
from .faults import named_collective
from .nonfinite import has_nonfinite  # re-exported: its old import path
from .tensors import overlaps_itself

__all__ = [
    "agree_across_ranks",
    "check_agreement",
    "collective_device",
    "describe_difference",
    "digest",
    "has_nonfinite",
    "raise_on_every_rank",
    "tensor_signature",
]


def agree_across_ranks(
    what: str,
    value: object,
    process_group: dist.ProcessGroup | None,
    *,
    error: BaseException | None = None,
    fix: str = "Every rank must use the same settings and resume from the same checkpoint.",
) -> None:
    """Raise on every rank of ``process_group`` if one rank failed a local check or the ranks' ``value`` differ.

    A rank whose local validation failed passes its exception as ``error`` (and any ``value``): it
    re-raises it, and every other rank raises a ``RuntimeError`` naming that rank and its error,
    instead of waiting in the next collective until the process group's timeout. Costs one
    all-gather of two int64 per rank; the values and messages are gathered only on a failure.

    .. warning::
        Collective over ``process_group``: every rank of it must call this, at the same point.

    Raises:
        RuntimeError: naming the ranks, if another rank failed or the values differ.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    device = collective_device(group)
    mine = torch.tensor([digest(value), 0 if error is None else 1], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    hand_over(mine, *everyone)
    ranks = dist.get_process_group_ranks(group)
    timeout = process_group_timeout(group)
    timeout_s = None if timeout is None else timeout.total_seconds()
    with named_collective(f"the agreement on {what}", ranks, timeout_s=timeout_s):
        dist.all_gather(everyone, mine, group=group)
    failed = [i for i, t in enumerate(everyone) if int(t[1])]
    same = all(int(t[0]) == int(everyone[0][0]) for t in everyone)
    if not failed and same:
        return
    if error is not None and len(failed) == world_size:
        raise error  # every rank failed: each raises its own error, no further collective
    gathered: list = [None] * world_size
    message = None if error is None else f"{type(error).__name__}: {error}"
    with named_collective(f"the agreement on {what}", ranks, timeout_s=timeout_s):
        dist.all_gather_object(gathered, (None if error is not None else value, message), group=group)
    if error is not None:
        raise error
    if failed:
        index = failed[0]
        others = [ranks[i] for i in failed[1:]]
        raise RuntimeError(
            f"Rank {ranks[index]} failed while checking {what}"
            + (f" (ranks {others} failed too)" if others else "")
            + f": {gathered[index][1]} This rank ({dist.get_rank()}) raises too, so that no rank waits "
            f"in a collective the failed rank never enters. {fix}"
        )
    values = [v for v, _ in gathered]
    for index, other in enumerate(values):
        if other != values[0]:
            raise RuntimeError(
                f"Ranks disagree on {what}: rank {ranks[0]} has {values[0]!r}, rank {ranks[index]} has "
                f"{other!r}. {fix}"
            )
    raise AssertionError("digests differ but the gathered values are equal")


def raise_on_every_rank(error: BaseException, process_group: dist.ProcessGroup | None, what: str) -> None:
    """Raise ``error`` here, after letting the other ranks of ``process_group`` raise too (see :func:`agree_across_ranks`).

    Without an initialized process group this rank belongs to, it just raises.

    .. warning::
        Collective over ``process_group``: the other ranks must reach :func:`agree_across_ranks` over
        the same group at this point (e.g. the averager's agreement in its constructor).
    """
    try:
        member = dist.is_available() and dist.is_initialized() and dist.get_rank(process_group) >= 0
    except (RuntimeError, ValueError, TypeError, AttributeError):
        member = False
    if member:
        agree_across_ranks(what, None, process_group, error=error)
    raise error


def check_agreement(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    group_ranks: Sequence[int],
    *,
    context: dict[str, object],
    what: str,
    error: BaseException | None = None,
    nonfinite: bool | None = None,
) -> list[int]:
    """Check that every rank of ``group`` is about to average the same tensors.

    Costs one all-reduce of four int64 values (plus one per rank of ``group`` with ``nonfinite``).
    On a mismatch, or when a rank passes a local ``error``, it gathers the signatures (or the
    errors) and raises on every rank of the group, so no rank hangs in a collective of a different size.

    .. warning::
        Collective: every rank of ``group`` must call this.

    Args:
        tensors: The tensors this rank is about to average.
        group: The averaging process group.
        group_ranks: Global ranks of ``group``, in group-rank order.
        context: Anything else the ranks must agree on, by name (e.g. ``{"step count": 5}``).
        what: Names the averaging round in the error message.
        error: A local check of this rank that failed (e.g. the tensors are not the ones the next
            step reads); raised here, and as a ``RuntimeError`` naming this rank on the others.
        nonfinite: Whether this rank's tensors hold a NaN or an infinity (see :func:`has_nonfinite`),
            agreed on in the same all-reduce; ``None`` (no check) on every rank, or a bool on every rank.

    Returns:
        The global ranks of ``group`` that passed ``nonfinite=True``, ascending, the same list on every
        rank; empty when none did or ``nonfinite`` is ``None``.

    Raises:
        RuntimeError: naming two ranks that disagree and their first difference, or a rank whose
            local check failed.
        Exception: ``error``, on the ranks that passed one.
    """
    signature, signature_repr = _signature_with_repr(tensors)
    local = [context, signature]
    mine = _digest_text(f"[{context!r}, {signature_repr}]")  # == digest(local), the signature's repr cached
    # The same rule on every rank, whatever its tensors: a rank with none must not pick another device.
    device = collective_device(group)
    failed = 0 if error is None else 1
    flags = []
    if nonfinite is not None:  # one flag per rank of the group, this rank's own set: MAX yields them all
        flags = [0] * len(group_ranks)
        flags[list(group_ranks).index(dist.get_rank())] = int(nonfinite)
    probe = torch.tensor([mine, -mine, failed, -failed, *flags], dtype=torch.int64, device=device)
    hand_over(probe)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    if int(probe[2]):
        if int(probe[3]) == -1 and error is not None:
            raise error  # every rank failed: each raises its own error, no further collective
        messages: list = [None] * len(group_ranks)
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=group)
        if error is not None:
            raise error
        index = next(i for i, m in enumerate(messages) if m is not None)
        raise RuntimeError(
            f"Rank {group_ranks[index]} failed while checking {what}: {messages[index]} This rank "
            f"({dist.get_rank()}) raises too, so that no rank waits in a collective the failed rank never enters."
        )
    if int(probe[0]) == -int(probe[1]):
        return [rank for rank, flag in zip(group_ranks, probe[4:].tolist()) if flag]
    gathered: list = [None] * len(group_ranks)
    dist.all_gather_object(gathered, local, group=group)
    first = gathered[0]
    for index, other in enumerate(gathered[1:], start=1):
        if other != first:
            raise RuntimeError(
                f"Ranks {group_ranks[0]} and {group_ranks[index]} disagree on {what}: "
                f"{describe_difference(first, other)}. Every rank of an averaging group must average the same "
                "parameters (number, shapes, dtypes) at the same step count: build the model and the optimizer's "
                "parameter groups identically on every rank, and resume every rank from the same checkpoint."
            )
    raise AssertionError("digests differ but the gathered signatures are equal")


def tensor_signature(tensors: Sequence[torch.Tensor]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each tensor, in order: what the ranks of a group must agree on.

    An internally overlapping tensor (which :func:`average_tensors_` rejects) is marked in its
    dtype entry, so that ranks differing in this disagree here, before any averaging collective.
    """
    return [
        (
            tuple(t.shape),
            str(t.dtype).removeprefix("torch.") + (", internally overlapping" if overlaps_itself(t) else ""),
        )
        for t in tensors
    ]


_SIGNATURES: dict[tuple, tuple[list, str]] = {}
"""Per (shape, dtype, strides) of a round's tensors: their :func:`tensor_signature` and its ``repr``, which a
round's agreement would otherwise rebuild in Python from every tensor at every round (0.5 ms for 124 tensors);
reading the key costs a seventh of that. Cleared when it holds :data:`_SIGNATURES_KEPT` lists."""

_SIGNATURES_KEPT = 64


def _signature_with_repr(tensors: Sequence[torch.Tensor]) -> tuple[list, str]:
    # What tensor_signature reads: shapes, dtypes, and whether a tensor overlaps itself (from shape and strides).
    key = tuple((t.shape, t.dtype, t.stride()) for t in tensors)
    hit = _SIGNATURES.get(key)
    if hit is None:
        signature = tensor_signature(tensors)
        hit = (signature, repr(signature))
        if len(_SIGNATURES) >= _SIGNATURES_KEPT:
            _SIGNATURES.clear()
        _SIGNATURES[key] = hit
    return hit


def digest(obj: object) -> int:
    """A 62-bit hash of ``repr(obj)``, the same on every rank and in every process (unlike ``hash``)."""
    return _digest_text(repr(obj))


def _digest_text(text: str) -> int:
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & ((1 << 62) - 1)


def describe_difference(a: list, b: list) -> str:
    """The first difference between two ``[context, signature]`` pairs, in words."""
    for key in a[0]:
        if a[0][key] != b[0].get(key):
            return f"{key} {a[0][key]!r} vs {b[0].get(key)!r}"
    sig_a, sig_b = a[1], b[1]
    for i, (x, y) in enumerate(zip(sig_a, sig_b)):
        if x != y:
            return f"tensor {i}: shape {x[0]} dtype {x[1]} vs shape {y[0]} dtype {y[1]}"
    return f"{len(sig_a)} tensors vs {len(sig_b)} tensors"


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where small control tensors for ``group`` live: CPU for gloo, else the current CUDA device."""
    if "gloo" not in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

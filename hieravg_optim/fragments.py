"""Fragments as element ranges: the split of a level's tensors, the pieces a round covers, their views.

A level with ``fragments`` ``F > 1`` splits the concatenation of its tensors (this rank's local tensors, in order)
into ``F`` consecutive runs of elements of about equal bytes (:func:`split_fragments`). A run may start or end
inside a tensor, so one flat tensor (a DeepSpeed ZeRO-1/2 fp32 partition, an FSDP1 flat parameter) splits as well
as many small ones. A fragment is a tuple of *pieces* ``(position, start, stop)``: the elements ``start:stop`` of
``local_tensor(tensors[position]).view(-1)`` (:func:`piece_view`, a view, never a copy). At a count, each element
follows the largest level due for it (:func:`plan_pieces`). Everything here is pure, a function of the tensors'
sizes, element sizes and contiguity, so every rank holding the same local shapes computes the same plan.

Sources: Streaming DiLoCo (https://arxiv.org/abs/2501.18512: fragments synchronized at staggered steps), torchft's
``DiLoCo`` (fragments of a model's parameters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .schedule import AveragingLevel, fragment_offsets
from .tensors import local_tensor

__all__ = [
    "Piece", "fragment_of", "landing_error", "level_splits", "piece_view", "pieces_text", "plan_pieces",
    "split_fragments", "split_key", "tensor_marks", "whole_pieces",
]

Piece = tuple[int, int, int]
"""``(position, start, stop)``: the elements ``start:stop`` (``start < stop``) of the flattened local tensor at
``position`` in the list of averaged tensors."""


def fragment_of(count: int, period: int, fragments: int) -> int | None:
    """The fragment of a level whose round starts at ``count`` (``count % period`` is its offset), or ``None``."""
    offsets = fragment_offsets(period, fragments)
    phase = count % period
    return offsets.index(phase) if phase in offsets else None


def _nearest(target2f: int, fragments: int, first: int, first_byte: int, size: int, numel: int, divisible: bool) -> int:
    """The element boundary of one tensor nearest to the byte ``target2f / (2 * fragments)`` (ties: the later one),
    as a global element index; ``first`` / ``first_byte``: the tensor's first element and byte. Whole tensors only
    when not ``divisible``."""
    if not divisible:
        # 2 * F * (byte offset of the tensor's middle) against the target.
        middle2f = fragments * (2 * first_byte + numel * size)
        return first + (numel if target2f >= middle2f else 0)
    # round half up of (target - first_byte) / size, in integers
    k = (target2f - 2 * fragments * first_byte + fragments * size) // (2 * fragments * size)
    return first + min(max(k, 0), numel)


def split_fragments(
    numels: Sequence[int], element_sizes: Sequence[int], fragments: int, divisible: Sequence[bool] | None = None
) -> list[tuple[Piece, ...]]:
    """Split tensors of ``numels`` elements of ``element_sizes`` bytes each (in order) into ``fragments``
    consecutive, non-empty runs of elements of about equal bytes, as pieces. Pure.

    Boundary ``j`` (``0 < j < fragments``) is the element boundary nearest to byte ``j * total / fragments`` of the
    concatenation (ties: the later one), so each fragment's bytes are within one element of ``total / fragments``
    (within the largest element size when dtypes are mixed). A tensor that is not ``divisible`` (not contiguous:
    ``view(-1)`` would copy it) is never split: a boundary that would fall inside it moves to its nearer end. If
    two boundaries would meet, the later one moves one element on, so no fragment is empty.

    Args:
        numels: Elements per tensor (the local tensors, sharded like them).
        element_sizes: Bytes per element of each tensor.
        fragments: ``F``, at least 1.
        divisible: Per tensor, whether it may be split inside (default: all).

    Returns:
        ``F`` tuples of pieces ``(position, start, stop)``, in order; zero-element tensors are in none.

    Raises:
        ValueError: for more fragments than elements, or than the whole tensors a split must keep together.
    """
    n = len(numels)
    divisible = [True] * n if divisible is None else list(divisible)
    total_elements = sum(numels)
    if fragments > total_elements:
        raise ValueError(
            f"fragments={fragments} at this level, but its rounds average {total_elements} elements on this rank "
            f"({n} tensors): each fragment needs at least one element. Pass fragments={max(total_elements, 1)} or "
            "fewer for this level."
        )
    first_element, first_byte = [0], [0]
    for numel, size in zip(numels, element_sizes):
        first_element.append(first_element[-1] + numel)
        first_byte.append(first_byte[-1] + numel * size)
    total = first_byte[-1]
    bounds = [0]
    for j in range(1, fragments):
        target2f = 2 * j * total  # 2 * F * (j * total / F)
        i = next(k for k in range(n) if numels[k] and 2 * fragments * first_byte[k + 1] > target2f)
        g = _nearest(target2f, fragments, first_element[i], first_byte[i], element_sizes[i], numels[i], divisible[i])
        low, high = bounds[-1] + 1, total_elements - (fragments - j)
        g = min(max(g, low), high)
        i = next(k for k in range(n) if first_element[k + 1] > g - 1)  # the tensor holding element g - 1
        if not divisible[i] and first_element[i] < g < first_element[i + 1]:
            ends = [e for e in (first_element[i], first_element[i + 1]) if low <= e <= high]
            if not ends:
                raise ValueError(
                    f"fragments={fragments} at this level cannot be split: tensor {i} ({numels[i]} elements) is not "
                    "contiguous, so it is kept whole, and no boundary fits around it. Make the averaged tensors "
                    "contiguous, or pass fewer fragments for this level."
                )
            g = min(ends, key=lambda e: (abs(e - g), -e))
        bounds.append(g)
    bounds.append(total_elements)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        pieces = []
        for i in range(n):
            lo, hi = max(a, first_element[i]), min(b, first_element[i + 1])
            if lo < hi:
                pieces.append((i, lo - first_element[i], hi - first_element[i]))
        out.append(tuple(pieces))
    return out


def whole_pieces(numels: Sequence[int]) -> tuple[Piece, ...]:
    """One piece per tensor, the whole of it (zero-element tensors too, as ``(i, 0, 0)``). Pure."""
    return tuple((i, 0, n) for i, n in enumerate(numels))


def _subtract(pieces: Sequence[Piece], taken: dict[int, list[tuple[int, int]]]) -> list[Piece]:
    """``pieces`` minus the element ranges ``taken`` (per position), then add what is left to ``taken``."""
    out = []
    for i, a, b in pieces:
        spans = [(a, b)]
        for c, d in taken.get(i, ()):
            spans = [s for lo, hi in spans for s in ((lo, min(hi, c)), (max(lo, d), hi)) if s[0] < s[1]]
        out += [(i, lo, hi) for lo, hi in spans]
    for i, a, b in out:
        taken.setdefault(i, []).append((a, b))
    return sorted(out)


def plan_pieces(
    count: int,
    levels: Sequence[AveragingLevel],
    fragments: Sequence[int],
    numels: Sequence[int],
    split: dict[int, list[tuple[Piece, ...]]],
) -> list[tuple[int, int | None, tuple[Piece, ...]]]:
    """The rounds that start at ``count``: ``(level index, fragment or None, pieces)``, in level order.

    Each element follows the largest level due for it at ``count``: a level with one fragment at the multiples of
    its period (every element no higher level took), a fragment at its own counts (:func:`fragment_of`; its
    pieces minus those a higher level took). Without a higher fragment, a level with one fragment gets whole
    tensors, as the synchronous round. A level left with no element starts no round. Pure.

    Args:
        split: Per level with fragments, :func:`split_fragments` of the tensors.
    """
    taken: dict[int, list[tuple[int, int]]] = {}
    rounds = []
    for li in range(len(levels) - 1, -1, -1):
        period, f = levels[li].period, fragments[li]
        if f == 1:
            if count % period:
                continue
            if not taken:
                rounds.append((li, None, whole_pieces(numels)))
                break
            rest = _subtract(whole_pieces(numels), taken)
            if rest:
                rounds.append((li, None, tuple(rest)))
            break
        j = fragment_of(count, period, f)
        if j is not None:
            mine = _subtract(split[li][j], taken)
            if mine:
                rounds.append((li, j, tuple(mine)))
    return sorted(rounds)


def piece_view(tensors: Sequence[torch.Tensor], piece: Piece) -> torch.Tensor:
    """The tensor of ``piece``: ``tensors[position]`` itself when the piece is the whole local tensor, else the view
    ``local_tensor(tensors[position]).view(-1)[start:stop]`` (no copy; in-place writes reach the tensor)."""
    i, a, b = piece
    t = tensors[i]
    local = local_tensor(t)
    if a == 0 and b == local.numel():
        return t
    return local.view(-1)[a:b]


def pieces_text(pieces: Sequence[Piece], limit: int = 4) -> str:
    """``pieces`` for a message: ``tensor 0 [0:12), tensor 1 [0:3), ...``."""
    shown = [f"tensor {i} [{a}:{b})" for i, a, b in pieces[:limit]]
    if len(pieces) > limit:
        shown.append(f"... {len(pieces) - limit} more")
    return ", ".join(shown)


def split_key(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, int, bool], ...]:
    """What the split of ``tensors`` depends on: per local tensor, its elements, element size and contiguity."""
    local = [local_tensor(t) for t in tensors]
    return tuple((t.numel(), t.element_size(), t.is_contiguous()) for t in local)


def level_splits(key: Sequence[tuple[int, int, bool]], fragments: Sequence[int]) -> dict[int, list[tuple[Piece, ...]]]:
    """Per level index with ``fragments > 1``, :func:`split_fragments` of the tensors described by ``key``
    (:func:`split_key`). Pure.

    Raises:
        ValueError: from :func:`split_fragments`.
    """
    numels, sizes, divisible = [k[0] for k in key], [k[1] for k in key], [k[2] for k in key]
    return {i: split_fragments(numels, sizes, f, divisible) for i, f in enumerate(fragments) if f > 1}


def tensor_marks(tensors: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> tuple[tuple[int, int, str, int], ...]:
    """What identifies the tensors ``pieces`` fall in, per piece: the local tensor's address, elements and dtype,
    and the number of ``tensors``. A round keeps the marks of its start and compares them at its apply count
    (:func:`landing_error`): the same marks mean the same tensors (their storage), not merely tensors of the same
    shapes at the same positions. Local, no copy."""
    marks = []
    for i, _, _ in pieces:
        t = local_tensor(tensors[i])
        marks.append((t.data_ptr(), t.numel(), str(t.dtype), len(tensors)))
    return tuple(marks)


def landing_error(
    name: str,
    count: int,
    pieces: Sequence[Piece],
    tensors: Sequence[torch.Tensor],
    marks: Sequence[tuple] | None,
    shapes: Sequence[torch.Size] | None = None,
) -> RuntimeError | None:
    """Why a round started over ``pieces`` (with :func:`tensor_marks` ``marks``; ``None``: not known, a resumed
    round) cannot be applied to ``tensors`` at ``count``, or ``None`` if it can: a position past the list, a tensor
    with fewer elements, or another tensor (storage) than at the start, e.g. a parameter frozen while the round was
    in flight, which moves the others up the list; or, with ``shapes`` (each piece's shape at the start), a piece of
    another shape (a tensor reshaped, the same storage). Local."""
    fix = (
        "keep the averaged tensors fixed while a round is in flight (freeze or add parameters at a count without a "
        "round in flight, e.g. after apply_rounds_in_flight), or resume from a checkpoint."
    )
    last = max((i for i, _, _ in pieces), default=-1)
    if last >= len(tensors):
        return RuntimeError(
            f"{name} is applied at step {count} to {len(tensors)} tensors, but it started with tensor positions up "
            f"to {last}: {fix}"
        )
    for k, (i, _, stop) in enumerate(pieces):
        t = local_tensor(tensors[i])
        if stop > t.numel():
            return RuntimeError(
                f"{name}: tensor {i} has {t.numel()} elements at step {count}, but the round started with its "
                f"elements up to {stop}: {fix}"
            )
        if marks is not None and (t.data_ptr(), t.numel(), str(t.dtype), len(tensors)) != tuple(marks[k]):
            _, numel, dtype, n = marks[k]
            return RuntimeError(
                f"{name} is applied at step {count} to other tensors than it started with: tensor {i} of "
                f"{len(tensors)} is {t.numel()} {t.dtype} elements at another address, but was {numel} {dtype} "
                f"elements of {n} tensors at the start (the list changed, e.g. a parameter was frozen or added). "
                f"The round is not applied, on any rank: {fix}"
            )
        if shapes is not None:
            shape = local_tensor(piece_view(tensors, pieces[k])).shape
            if shape != shapes[k]:
                return RuntimeError(
                    f"{name}: tensor {i} has shape {tuple(shape)} at step {count}, but {tuple(shapes[k])} when the "
                    f"round started. The round is not applied, on any rank: {fix}"
                )
    return None

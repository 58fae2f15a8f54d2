"""One delayed or fragment round in flight on this rank: its copies, its collective, its saved form.

:class:`InFlightRound` is what :class:`hieravg_optim.delayed.DelayedRounds` keeps per level between a round's
start and its apply; :func:`pack_copies` makes the copies all-reduced in the background; :func:`saved_round` reads
one back from a state dict (``"in_flight"``). See ``docs/semantics.md`` (delayed rounds and fragments).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .comm_dtype import wire_dtype
from .compression.delayed import CompressedPayloads
from .faults import named_collective
from .fragments import Piece
from .groups import LevelGroup
from .rounds import round_name
from ._validation import is_int

__all__ = ["InFlightRound", "check_meaning", "pack_copies", "saved_round"]


def pack_copies(
    tensors: Sequence[torch.Tensor], comm_dtype: str | None, flats: list[torch.Tensor], *, zeros: bool
) -> list[torch.Tensor]:
    """Copy ``tensors`` into one new flat buffer per device and wire dtype (appended to ``flats``), in their wire
    dtype (:func:`hieravg_optim.comm_dtype.wire_dtype`); returns a view of it per tensor, in order. ``zeros``: the
    views hold zeros instead (a non-finite replica's contribution, ``nonfinite="skip_replica"``). Local."""
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, t in enumerate(tensors):
        by_key.setdefault((t.device, wire_dtype(t.dtype, comm_dtype)), []).append(k)
    views: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for (device, dtype), members in by_key.items():
        buffer = torch.empty(sum(tensors[k].numel() for k in members), dtype=dtype, device=device)
        offset = 0
        for k in members:
            n = tensors[k].numel()
            view = buffer[offset : offset + n].view(tensors[k].shape)
            view.zero_() if zeros else view.copy_(tensors[k])
            views[k], offset = view, offset + n
        flats.append(buffer)
    return views


@dataclass(eq=False)
class InFlightRound:
    """One round started and not yet applied, on this rank."""

    level_index: int
    fragment: int | None
    """The fragment's index (``None``: the level has one fragment)."""
    pieces: tuple[Piece, ...]
    """The round's pieces ``(position, start, stop)``: element ranges of the tensors the averager is given
    (:mod:`hieravg_optim.fragments`); a whole tensor is ``(position, 0, numel)``."""
    started: int
    """The count the round started at (its snapshot's count ``t``)."""
    apply_at: int
    """The count it is applied at (``t + tau``)."""
    name: str
    wire: list[torch.Tensor]
    """The copies all-reduced: the snapshot, then (after :meth:`wait`) the mean over the group."""
    snapshot: list[torch.Tensor] | None
    """This rank's ``theta_t`` (the ``"eager"`` correction), else ``None``."""
    replaced: bool = False
    """This rank's replica was non-finite at ``t`` (``nonfinite="skip_replica"``): it takes the mean as is."""
    divisor: int | None = None
    payload: int = 0
    seconds: float = 0.0
    thread: threading.Thread | None = None
    error: BaseException | None = None
    done: Any = None
    """A CUDA event recorded after the collective on its side stream, or ``None``."""
    finished: bool = False
    """Whether the collective has completed (after :meth:`wait`, or loaded from a checkpoint)."""
    timeout_s: float | None = None
    ranks: tuple[int, ...] = field(default=())
    works: list = field(default_factory=list)
    """The async all-reduces of the flat path (the backend progresses them), waited for by :meth:`wait`."""
    flats: list = field(default_factory=list)
    """The packed copies :attr:`wire` views, one per device and wire dtype, divided by :attr:`divide_by` after."""
    divide_by: float = 1.0
    marks: tuple | None = None
    """:func:`~hieravg_optim.fragments.tensor_marks` of the tensors at the start, checked at the apply (``None``:
    not known, a round resumed from a checkpoint)."""
    compressed: CompressedPayloads | None = None
    """A compressed level's payloads (``compress``): :attr:`wire` then holds the averaged buffers only, and
    stand-ins of the anchored tensors' shapes."""

    def nbytes(self) -> int:
        """Bytes this round holds on this rank: its copies (and the snapshot), or its payloads."""
        skip = set(self.compressed.anchored) if self.compressed is not None else set()
        held = [w for k, w in enumerate(self.wire) if k not in skip] + (self.snapshot or [])
        extra = self.compressed.nbytes() if self.compressed is not None else 0
        return extra + sum(t.numel() * t.element_size() for t in held)

    def wait(self) -> None:
        """Wait for the collective; re-raise its error, a failed collective as a ``CollectiveError`` naming the round.

        Raises:
            CollectiveError: (a ``RuntimeError``) for a dead or hung peer, within the group's timeout.
            WireOverflowError: as the synchronous round (float16 wire).
        """
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.works:
            works, self.works = self.works, []
            try:
                for work in works:
                    work.wait()
            except Exception as exc:  # noqa: BLE001 - named below
                self.error = exc
            else:
                with torch.no_grad():
                    for f in self.flats:
                        f.div_(self.divide_by)
            self.flats = []
        if self.error is not None:
            error, self.error = self.error, None
            with named_collective(f"{self.name} (waited for at step {self.apply_at})", self.ranks, timeout_s=self.timeout_s):
                raise error
        if self.done is not None:
            torch.cuda.current_stream(self.wire[0].device).wait_event(self.done)
            self.done = None
        self.finished = True


def _round_pieces(entry: Mapping[str, Any], result: Sequence[torch.Tensor]) -> tuple[Piece, ...] | None:
    """The pieces of a saved round, or ``None`` if malformed; ``"positions"`` (whole tensors) as saved before
    fragments were element ranges."""
    if "pieces" not in entry:
        positions = entry["positions"]
        if not isinstance(positions, (list, tuple)) or len(positions) != len(result) or not all(map(is_int, positions)):
            return None
        return tuple((int(i), 0, t.numel()) for i, t in zip(positions, result))
    pieces = entry["pieces"]
    if not isinstance(pieces, (list, tuple)) or len(pieces) != len(result):
        return None
    out = []
    for p, t in zip(pieces, result):
        if not isinstance(p, (list, tuple)) or len(p) != 3 or not all(map(is_int, p)):
            return None
        i, a, b = map(int, p)
        if i < 0 or not 0 <= a <= b or b - a != t.numel():
            return None
        out.append((i, a, b))
    return tuple(out)


def check_meaning(entry: Mapping[str, Any], present: Mapping[str, Any], where: str) -> None:
    """Check the settings a saved round in flight was started under (its ``"meaning"`` entry: the level's
    ``delay_steps``, ``delay_correction``, ``delay_mixing``, ``fragments``, its group's ranks (``group_ranks``); with
    ``compress``, the codec's ``describe()`` and ``ef_decay``) against ``present``, this averager's. An entry saved
    without ``"meaning"`` (before it was saved) is not checked. Local.

    Raises:
        ValueError: naming ``where``, the setting, its saved and its present value, and the fix.
    """
    saved = entry.get("meaning")
    if saved is None:
        return
    if not isinstance(saved, Mapping):
        raise ValueError(f"{where}: its 'meaning' entry must be a mapping, as state_dict() saves it.")
    for key, value in present.items():
        if key in saved and _plain(saved[key]) != _plain(value):
            raise ValueError(
                f"{where} was started with {key}={_plain(saved[key])!r}, but this averager has {key}="
                f"{_plain(value)!r}: resume with the saved run's {key}, or save at a count with no round in flight."
            )


def _plain(value: object) -> object:
    """``value`` with tuples as lists (a saved entry may hold either)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def saved_round(
    entry: object, where: str, step: int, delay: int, *, level_index: int, lg: LevelGroup, correction: str
) -> InFlightRound:
    """The round of one saved ``"in_flight"`` entry (:meth:`hieravg_optim.delayed.DelayedRounds.state_dict`'s
    form), checked against the saved count ``step``, the level's ``delay``, its group size and its
    ``delay_correction`` ``correction`` (the round is applied with this averager's: ``"none"`` drops a saved
    snapshot); finished (its collective done), its compressed payloads not read here. Local.

    Raises:
        ValueError: naming ``where``, for a malformed entry, counts that do not fit ``step`` and ``delay``, another
            group size (the saved mean is over another group), or ``correction="eager"`` for a round saved
            without its snapshot (``"none"``).
    """
    keys = {"fragment", "pieces", "started", "apply_at", "result", "snapshot", "replaced"}
    if not isinstance(entry, Mapping) or not keys - {"pieces"} <= set(entry) or not {"pieces", "positions"} & set(entry):
        raise ValueError(f"{where} must be a mapping with the keys {sorted(keys)}, as state_dict() saves it.")
    result, snapshot = entry["result"], entry["snapshot"]
    tensors_ok = isinstance(result, (list, tuple)) and all(torch.is_tensor(t) for t in result)
    if snapshot is not None:
        tensors_ok = tensors_ok and isinstance(snapshot, (list, tuple)) and len(snapshot) == len(result) and all(
            torch.is_tensor(t) and t.shape == w.shape for t, w in zip(snapshot, result)
        )
    pieces = _round_pieces(entry, result) if tensors_ok else None
    if pieces is None:
        raise ValueError(
            f"{where}: 'result', 'snapshot' and 'pieces' must be lists of one length, of tensors and of "
            "[position, start, stop] (stop - start elements each), as state_dict() saves them."
        )
    started, apply_at = entry["started"], entry["apply_at"]
    if not (is_int(started) and is_int(apply_at) and started < step <= apply_at == started + delay):
        raise ValueError(
            f"{where} started at count {started!r} and is applied at {apply_at!r}, which does not fit the saved "
            f"count {step} and delay_steps={delay} here: resume with the saved run's settings."
        )
    size = entry.get("group_size", lg.size)
    if size != lg.size:
        raise ValueError(
            f"{where} is the mean over a group of {size!r} ranks, but this level's group has {lg.size}: the round "
            "cannot be applied to another group. Resume with the saved run's world size and levels, or from a "
            "checkpoint saved without a round in flight (after apply_rounds_in_flight)."
        )
    if correction == "eager" and snapshot is None and not entry["replaced"]:
        raise ValueError(
            f"{where} was saved with delay_correction='none' (without the snapshot theta_t), but this averager "
            "applies it with delay_correction='eager', which needs theta_t: resume with the saved run's "
            "delay_correction, or from a checkpoint saved without a round in flight (after apply_rounds_in_flight)."
        )
    if correction != "eager":
        snapshot = None  # "none": the round's mean R alone, as this averager's setting says
    return InFlightRound(
        level_index=level_index, fragment=entry["fragment"], pieces=pieces, started=started,
        apply_at=apply_at, name=f"{round_name(started, lg)[:-1]}, delayed, resumed)",
        wire=list(result), snapshot=None if snapshot is None else list(snapshot),
        replaced=bool(entry["replaced"]), payload=int(entry.get("payload", 0)), finished=True, ranks=lg.ranks,
    )  # fmt: skip

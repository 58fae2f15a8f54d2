"""The averaging state in state dicts: its keys, the saved count, and the checks before anything is loaded.

* :data:`STATE_KEY`, :data:`GROUP_STEP_KEY`, :func:`split_count`: where a wrapper's state dict keeps the
  averaging state and the count (also as torch's top-level ``"step"``, and in every parameter group);
* :class:`AveragingStateMixin`: :meth:`hieravg_optim.HierarchicalAverager.state_dict` and its loads, with
  :func:`check_level_state` (one level's anchors and outer optimizer state, dry-run on meta tensors).

All of it is local: no collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from types import EllipsisType

import torch

from .anchors import OuterLevel, OuterLevels
from .fragments import Piece, pieces_text
from .config import AveragingConfig, is_int, warn_at_caller
from .outer import dry_step
from .schedule import period_of_key

__all__ = [
    "GROUP_STEP_KEY",
    "STATE_KEY",
    "AveragingStateMixin",
    "averaging_state",
    "check_level_state",
    "pop_group_step",
    "read_step",
    "split_count",
    "warn_schedule_changes",
]

STATE_KEY = "hierarchical_averaging"
"""Key under which :meth:`HierarchicalAveragingOptimizer.state_dict` stores the averaging state."""

GROUP_STEP_KEY = "hierarchical_averaging_step"
"""Key under which :meth:`HierarchicalAveragingOptimizer.state_dict` also writes the count into every
parameter group: torch's optimizer-state helpers (DCP's ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``, FSDP1's ``optim_state_dict`` / ``optim_state_dict_to_load``) keep only
``"state"`` and ``"param_groups"``, and keep a group's extra keys."""


def pop_group_step(state_dict: dict[str, Any]) -> int | None:
    """Remove the count from the param groups of ``state_dict`` (copied, not mutated) and return it, or ``None``.

    Raises:
        ValueError: if some groups carry it and others do not, or they carry different counts.
    """
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not any(
        isinstance(g, Mapping) and GROUP_STEP_KEY in g for g in groups
    ):
        return None
    values = [g.get(GROUP_STEP_KEY, "missing") if isinstance(g, Mapping) else "missing" for g in groups]
    plain = [int(v) if torch.is_tensor(v) and v.numel() == 1 and not v.is_floating_point() else v for v in values]
    if any(v != plain[0] for v in plain):
        raise ValueError(
            f"The parameter groups of the state dict disagree on the averaging step count '{GROUP_STEP_KEY}': "
            f"{plain} (one per group). Every group of a state dict saved by HierarchicalAveragingOptimizer carries "
            "the same count; load the unmodified state dict."
        )
    state_dict["param_groups"] = [
        {k: v for k, v in g.items() if k != GROUP_STEP_KEY} if isinstance(g, Mapping) else g for g in groups
    ]
    return plain[0]


def split_count(
    state_dict: Mapping[str, Any], averaging_step: int | None
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Split a wrapper state dict into the inner optimizer's part and the averaging state.

    The count is read from :data:`STATE_KEY`, else the top-level ``"step"`` (torch's
    ``PostLocalSGDOptimizer``), else :data:`GROUP_STEP_KEY` in the parameter groups, else
    ``averaging_step``. ``state_dict`` is not mutated.

    Returns:
        ``(inner state dict, averaging state for HierarchicalAverager.load_state_dict, where the count was
        found)``.

    Raises:
        ValueError: if there is no count anywhere and ``averaging_step`` is ``None``, naming the keys and
            the fix; if the parameter groups disagree on the count.
    """
    inner = dict(state_dict)
    ours = inner.pop(STATE_KEY, None)
    torch_step = inner.pop("step", None)
    group_step = pop_group_step(inner)
    if ours is not None:
        return inner, ours, f"'{STATE_KEY}'"
    if torch_step is not None:
        return inner, {"step": torch_step}, "the top-level 'step'"
    if group_step is not None:
        return inner, {"step": group_step}, f"the param_groups' '{GROUP_STEP_KEY}'"
    if averaging_step is not None:
        return inner, {"step": averaging_step}, "averaging_step"
    raise ValueError(
        f"The state dict has no averaging step count: no '{STATE_KEY}', no top-level 'step' (torch's "
        f"PostLocalSGDOptimizer) and no '{GROUP_STEP_KEY}' in its param_groups; it has keys "
        f"{sorted(map(str, state_dict))}. Load a state dict saved by this wrapper's state_dict(), or, to "
        "start from a plain inner-optimizer state dict on purpose, pass the count to resume at: "
        "load_state_dict(state_dict, averaging_step=N) (0 restarts the averaging schedule)."
    )


def averaging_state(step: int, config: AveragingConfig, outers: OuterLevels) -> dict[str, Any]:
    """The averaging state: the count, the schedule for checking on resume, and the anchors taken."""
    state: dict[str, Any] = {
        "step": step,
        "levels": [[lv.period, lv.group_size] for lv in config.levels],
        "warmup_steps": config.warmup_steps,
        "synchronous_warmup": config.synchronous_warmup,
    }
    outer = {o.period: o.state_dict() for o in outers if o.anchors is not None}
    if outer:
        state["outer"] = outer
    return state


def read_step(state: Mapping[str, Any]) -> int:
    """The count of an averaging state, checked: a non-negative integer (a one-element integer tensor too).

    Raises:
        ValueError: if ``state`` has no ``"step"``, or it is not a non-negative integer.
    """
    if not isinstance(state, Mapping) or "step" not in state:
        raise ValueError(
            f"The averaging state must be a mapping with the averaging step count under 'step', as "
            f"HierarchicalAverager.state_dict() returns, got {state!r}."
        )
    step = state["step"]
    if torch.is_tensor(step) and step.numel() == 1 and not step.is_floating_point():
        step = int(step)
    if not is_int(step) or step < 0:
        raise ValueError(
            f"The averaging step count 'step' in the state dict must be a non-negative integer (optimizer "
            f"steps), got {step!r} ({type(step).__name__}). Load the state dict this library or torch's "
            "PostLocalSGDOptimizer saved."
        )
    return int(step)


def warn_schedule_changes(state: Mapping[str, Any], step: int, config: AveragingConfig) -> None:
    """Warn (``UserWarning``, at the caller) for saved levels, ``warmup_steps`` or ``synchronous_warmup`` that
    differ from ``config``'s: the run continues with the new ones."""
    saved = [tuple(x) for x in state.get("levels", [])]
    current = [(lv.period, lv.group_size) for lv in config.levels]
    if saved and saved != current:
        warn_at_caller(
            f"Resuming hierarchical averaging at step {step} with levels {current}, but the checkpoint "
            f"was saved with levels {saved}. The schedule continues from the saved count with the new levels."
        )
    saved_warmup = state.get("warmup_steps")
    if saved_warmup is not None and saved_warmup != config.warmup_steps:
        warn_at_caller(
            f"Resuming hierarchical averaging at step {step} with warmup_steps={config.warmup_steps}, "
            f"but the checkpoint was saved with warmup_steps={saved_warmup}. The new warm-up applies."
        )
    saved_sync = state.get("synchronous_warmup")
    if saved_sync is not None and bool(saved_sync) != config.synchronous_warmup:
        # Warm-up counts average at the top level or not at all: another setting is another schedule.
        warn_at_caller(
            f"Resuming hierarchical averaging at step {step} with synchronous_warmup="
            f"{config.synchronous_warmup}, but the checkpoint was saved with synchronous_warmup={saved_sync}. "
            "The new setting applies to the remaining warm-up counts; pass the saved value to keep the schedule."
        )


def check_level_state(
    outer: OuterLevel,
    state: object,
    tensors: Sequence[torch.Tensor] | None = None,
    pieces: Sequence[Piece] | None | EllipsisType = ...,
) -> tuple[list[torch.Tensor], Mapping[str, Any], bool]:
    """Validate the saved state of ``outer``'s level: ``(anchors, optimizer state dict, synced, residuals)``
    (``residuals``: ``None`` when the level kept none). Changes nothing.

    Args:
        pieces: The split this rank's outer optimizer steps (:meth:`OuterLevels.pieces_of`; ``None``: whole
            anchors), if known (``...``: not known, the saved one is taken).

    Raises:
        ValueError: naming the period and the mismatch, for a malformed entry, anchors that are not
            float32, anchors whose number or shapes differ from the current ones (this rank's anchors,
            else ``tensors`` when given), or fragments split otherwise than here (both splits named).
    """
    where = f"The outer state of period {outer.period} in the averaging state dict"
    if not isinstance(state, Mapping) or "anchors" not in state or "optimizer" not in state:
        keys = f" with keys {sorted(map(str, state))}" if isinstance(state, Mapping) else ""
        raise ValueError(
            f"{where} must be a mapping with 'anchors' and 'optimizer', as HierarchicalAverager.state_dict() "
            f"returns, got {type(state).__name__}{keys}."
        )
    anchors = state["anchors"]
    if not isinstance(anchors, (list, tuple)) or not all(torch.is_tensor(a) for a in anchors):
        raise ValueError(f"{where}: 'anchors' must be a list of tensors, got {type(anchors).__name__}.")
    for i, a in enumerate(anchors):
        if a.dtype != torch.float32:
            raise ValueError(
                f"{where}: anchor {i} is {str(a.dtype).removeprefix('torch.')}, but anchors are float32 copies of "
                "the averaged tensors (as HierarchicalAverager.state_dict() saves them): load a checkpoint this "
                "library saved, unchanged; loading would round the anchors or fail at the next round."
            )
    if not isinstance(state["optimizer"], Mapping):
        raise ValueError(
            f"{where}: 'optimizer' must be the outer optimizer's state_dict(), got "
            f"{type(state['optimizer']).__name__}."
        )
    saved_pieces = _saved_pieces(where, state, anchors)
    if pieces is not ...:
        mine = None if pieces is None else tuple(pieces)
        if saved_pieces != mine:
            def shown(split, f):
                return "whole tensors (fragments=1)" if split is None else f"fragments={f}: {pieces_text(split)}"

            raise ValueError(
                f"{where} was saved with its outer optimizer over {shown(saved_pieces, state.get('fragments'))}, but "
                f"here it steps {shown(mine, outer.fragments)}: the outer state (momentum) is per piece. Resume with "
                "the saved run's fragments at this level and the same averaged tensors (model, sharding, ZeRO stage)."
            )
    params = anchors if saved_pieces is None else [torch.empty(b - a, device="meta") for _, a, b in saved_pieces]
    groups = state["optimizer"].get("param_groups")
    if isinstance(groups, (list, tuple)):
        held = sum(len(g.get("params", ())) for g in groups if isinstance(g, Mapping))
        if held != len(params):
            what = f"{len(anchors)} anchors" if saved_pieces is None else f"{len(params)} pieces of its anchors"
            raise ValueError(
                f"{where}: its outer optimizer state covers {held} tensors but it holds {what}: "
                "save and load the state dict HierarchicalAverager.state_dict() returns, unchanged."
            )
    reference = outer.anchors if outer.anchors is not None else tensors
    if reference is not None:
        if len(anchors) != len(reference):
            raise ValueError(
                f"{where} holds {len(anchors)} anchors, but this rank averages {len(reference)} tensors: load "
                "the checkpoint of the same model, with the same parameters averaged (and frozen)."
            )
        for i, (saved, mine) in enumerate(zip(anchors, reference)):
            if saved.shape != mine.shape:
                raise ValueError(
                    f"{where}: anchor {i} has shape {tuple(saved.shape)}, but this rank's tensor {i} has shape "
                    f"{tuple(mine.shape)}: load the checkpoint of the same model and sharding."
                )
    _check_loadable(outer, where, params, state["optimizer"])
    residuals = state.get("residuals")
    if residuals is not None and (
        not isinstance(residuals, (list, tuple))
        or not all(torch.is_tensor(r) and r.dtype == torch.float32 for r in residuals)
    ):
        raise ValueError(
            f"{where}: 'residuals' must be a list of float32 tensors (the error-feedback residuals of a compressed "
            "level), as HierarchicalAverager.state_dict() saves them: load a checkpoint this library saved, unchanged."
        )
    return list(anchors), state["optimizer"], bool(state.get("synced", True)), None if residuals is None else list(residuals)


def _saved_pieces(where: str, state: Mapping[str, Any], anchors: Sequence[torch.Tensor]) -> tuple[Piece, ...] | None:
    """The saved ``"pieces"`` of a level with fragments (``None`` without), checked against the saved anchors."""
    saved = state.get("pieces")
    if saved is None:
        return None
    out = []
    for p in saved if isinstance(saved, (list, tuple)) else [None]:
        if not (isinstance(p, (list, tuple)) and len(p) == 3 and all(isinstance(v, int) for v in p)):
            out = None
            break
        i, a, b = p
        if not (0 <= i < len(anchors) and 0 <= a < b <= anchors[i].numel()):
            out = None
            break
        out.append((i, a, b))
    if not out:
        raise ValueError(
            f"{where}: 'pieces' must be a list of [position, start, stop] element ranges of its anchors, as "
            "HierarchicalAverager.state_dict() saves them: load a checkpoint this library saved, unchanged."
        )
    return tuple(out)


def _check_loadable(
    outer: OuterLevel, where: str, anchors: Sequence[torch.Tensor], optimizer_state: Mapping[str, Any]
) -> None:
    """Raise ``ValueError`` if the outer optimizer rejects ``optimizer_state``: a dry run on meta tensors.

    The factory's optimizer is built over meta copies of ``anchors`` (no memory), loads the saved state
    and steps once, so that a state torch.optim rejects, or one of another optimizer class or with buffers
    of other shapes, fails here, before anything is loaded, and not halfway through loading or at the next
    round. Skipped if the optimizer cannot step on meta tensors without any state loaded.
    """
    try:
        dry_step(outer.factory, anchors, None)
    except Exception:  # noqa: BLE001 - an optimizer that needs real tensors: no dry run
        return
    try:
        dry_step(outer.factory, anchors, optimizer_state)
    except Exception as exc:  # noqa: BLE001 - whatever the optimizer raises names the fault
        raise ValueError(
            f"{where} is rejected by the outer optimizer outer_optimizers[{outer.period}] builds "
            f"({type(exc).__name__}: {exc}): load a checkpoint saved with the same outer optimizer (class and "
            "parameter groups) and the same model. Nothing was loaded."
        ) from exc


class AveragingStateMixin:
    """:class:`~hieravg_optim.HierarchicalAverager`'s state dict and its loads (a base class of it).

    Reads and sets the averager's ``step``, ``config``, ``_outers`` (:class:`~hieravg_optim.anchors.OuterLevels`)
    and ``_verify_step_pending`` (the count's check across ranks at the next step).
    """

    step: int
    config: AveragingConfig
    _outers: OuterLevels
    _verify_step_pending: bool

    def state_dict(self) -> dict[str, Any]:
        """The averaging state: the step count and, for checking on resume, the levels and the warm-up.

        With outer optimizers whose anchors are taken, also ``"outer"``: ``{period: {"anchors": [Tensor,
        ...], "optimizer": outer_optimizer.state_dict(), "synced": bool}}``, this rank's fp32 anchors (its
        shards; the tensors themselves, not copies) and outer optimizer state, per level with an outer optimizer.

        With a round in flight (``delay_steps``), also ``"in_flight"``: its collective is waited for first (no
        tensor changes), then per period the copies all-reduced, the snapshot and the apply count
        (:meth:`hieravg_optim.delayed.DelayedRounds.state_dict`), so that a resumed run applies it at the same count.

        Raises:
            CollectiveError: if the collective of a round in flight failed.
        """
        state = averaging_state(self.step, self.config, self._outers)
        delayed = getattr(self, "_delayed", None)
        in_flight = {} if delayed is None else delayed.state_dict()
        if in_flight:
            state["in_flight"] = in_flight
        return state

    def check_outer_state(
        self, state: Mapping[str, Any], tensors: Sequence[torch.Tensor] | None = None
    ) -> dict[int, tuple] | None:
        """Validate the ``"outer"`` entry of an averaging state; changes nothing. Local, no collective.

        Args:
            state: The averaging state dict.
            tensors: This rank's tensors to average (as :meth:`average` gets them), if known: anchors saved
                for other numbers or shapes are then rejected even before this rank has anchors of its own
                (during a warm-up), and anchors loaded then are put with these tensors (or on
                ``outer_state_device``), not wherever the checkpoint was mapped.

        Returns:
            What :meth:`load_outer_state` restores: ``{period: (anchors, optimizer state, synced, tensors)}``,
            or ``None`` when this averager has no outer optimizer.

        Warns (``UserWarning``) for saved periods that have no outer optimizer here: they are not loaded.

        Raises:
            ValueError: naming the period and the mismatch, for a malformed entry, anchors whose number or
                shapes differ from this rank's anchors (or ``tensors``), or an outer optimizer state the level's
                outer optimizer rejects (a dry run on meta tensors, see ``docs/outer.md``).
        """
        saved = state.get("outer") if isinstance(state, Mapping) else None
        if not self._outers.has_outer:
            if saved:
                warn_at_caller(
                    f"The averaging state dict holds anchors and outer optimizer state for periods "
                    f"{sorted(map(str, saved))}, but this averager has no outer optimizer: they are not loaded. Pass "
                    "the same outer_optimizers as the saved run to resume it."
                )
            return None
        if saved is None:
            return {}
        if not isinstance(saved, Mapping):
            raise ValueError(
                f"The 'outer' entry of the averaging state dict must be a mapping {{period: {{'anchors': ..., "
                f"'optimizer': ...}}}}, as HierarchicalAverager.state_dict() returns, got {type(saved).__name__}."
            )
        by_period = {}
        for key, value in saved.items():
            period = period_of_key(key) or key
            by_period[period] = value
        local = None if tensors is None else self._outers.part(tensors)
        parsed = {}
        for outer in self._outers:
            if outer.period in by_period:
                if outer.anchors is not None:
                    pieces = outer.pieces
                else:
                    pieces = ... if tensors is None else self._outers.pieces_of(outer, tensors)
                level = check_level_state(outer, by_period[outer.period], local, pieces)
                saved_pieces = _saved_pieces("", by_period[outer.period], level[0])
                parsed[outer.period] = (*level, local, saved_pieces)
        ignored = [p for p in by_period if p not in parsed]
        if ignored:
            warn_at_caller(
                f"The averaging state dict holds anchors and outer optimizer state for period"
                f"{'s' if len(ignored) > 1 else ''} {ignored}, which ha{'ve' if len(ignored) > 1 else 's'} no outer "
                f"optimizer here (outer optimizers at {list(self._outers.periods)}): not loaded."
            )
        return parsed

    def load_outer_state(self, parsed: dict[int, tuple] | None) -> None:
        """Restore :meth:`check_outer_state`'s output (anchors and outer optimizer state); local.

        A level with an outer optimizer that the checkpoint has no anchors for, past the warm-up, gets
        fresh anchors: every level's anchors are dropped and taken again (:attr:`needs_anchors`), with a
        ``UserWarning``.
        """
        if parsed is None:
            return
        missing = [o.period for o in self._outers if o.period not in parsed]
        for outer in self._outers:
            if outer.period in parsed:
                outer.load(*parsed[outer.period])
        if missing and self.step >= self.config.warmup_steps:
            self._outers.drop()
            warn_at_caller(
                f"Resuming hierarchical averaging at step {self.step}, but the checkpoint has no anchors or outer "
                f"optimizer state for period{'s' if len(missing) > 1 else ''} {missing}: every level with an outer "
                "optimizer takes fresh anchors from the current parameters before the next step, and its outer "
                "optimizer starts afresh (momentum lost). Save the checkpoint with state_dict() of a run with the "
                "same outer_optimizers to resume exactly."
            )

    def load_state_dict(self, state: Mapping[str, Any], tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Restore :meth:`state_dict`'s output. The count is checked across ranks at the next step.

        With outer optimizers, the anchors and outer optimizer state of ``"outer"`` are restored too
        (see :meth:`check_outer_state`, :meth:`load_outer_state`; ``tensors`` as there).

        Raises:
            ValueError: if ``state`` has no ``"step"``, or it is not a non-negative integer (a float,
                a string, ``None``: never silently truncated or reset); for a malformed ``"outer"`` entry or
                anchors of other numbers or shapes. Nothing is changed then.

        Warns (``UserWarning``, at the caller) when the saved levels, ``warmup_steps`` or
        ``synchronous_warmup`` differ from this averager's: the run continues with the new ones; when the
        checkpoint has no anchors for a level with an outer optimizer past the warm-up (fresh anchors).
        """
        outer = self.check_outer_state(state, tensors)
        self.load_step_state(state)
        self.load_outer_state(outer)

    def load_step_state(self, state: Mapping[str, Any]) -> None:
        """:meth:`load_state_dict` without the ``"outer"`` entry: the count and the schedule checks.

        Wrappers that must leave everything unchanged when the inner optimizer rejects its part call
        :meth:`check_outer_state` first, then this, then the inner load, then :meth:`load_outer_state`.
        """
        step = read_step(state)
        delayed = getattr(self, "_delayed", None)
        saved = state.get("in_flight") if isinstance(state, Mapping) else None
        if saved and delayed is None:
            raise ValueError(
                f"The averaging state dict holds rounds in flight (periods {sorted(map(str, saved))}), but this averager "
                "has no delay_steps: resume with the saved run's delay_steps and fragments, so that they are applied."
            )
        rounds = delayed.check_state(saved or {}, step) if delayed is not None else None
        self.step = step
        if delayed is not None:
            delayed.load_state(rounds)
        warn_schedule_changes(state, self.step, self.config)
        self._verify_step_pending = True

    @contextlib.contextmanager
    def restoring_count_on_error(self) -> Iterator[None]:
        """Load inside this block: if it raises, the count (and its check at the next step) is as before.

        For a wrapper that loads the count with :meth:`load_step_state` and then its inner optimizer, and must
        leave everything unchanged when either rejects its part.
        """
        delayed = getattr(self, "_delayed", None)
        previous = (self.step, self._verify_step_pending, None if delayed is None else dict(delayed.in_flight))
        try:
            yield
        except BaseException:
            self.step, self._verify_step_pending, in_flight = previous
            if delayed is not None:
                delayed.in_flight = in_flight
            raise

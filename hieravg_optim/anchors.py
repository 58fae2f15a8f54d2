"""Outer optimizers at run time: each level's fp32 anchors and outer optimizer, and the collection of them.

:class:`OuterLevel` is one level's state on this rank (take, step, reset, save and load), and
:class:`OuterLevels` the levels of one averager: taking and dropping the anchors of every level together,
what a round at a level agrees on and its local error, and the reset of the lower levels after a round.
:class:`OuterAnchorsMixin` is the averager's public face of them (``take_anchors``, ``outer_optimizer``, ...).
The factories and their checks are :mod:`hieravg_optim.outer`. Nothing here communicates, except
:meth:`OuterLevels.take` and :meth:`OuterLevels.agree_taken` (one agreement over the process group).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .agreement import agree_across_ranks
from .fragments import Piece, level_splits, pieces_text, split_key
from .outer import OuterFactory, build_outer_optimizer
from .schedule import AveragingLevel
from .tensors import local_tensor

__all__ = ["TAKE_ANCHORS", "OuterAnchorsMixin", "OuterLevel", "OuterLevels"]

TAKE_ANCHORS = "taking the anchors of the outer optimizers"
"""What :meth:`OuterLevels.take` agrees on (with ``agree_over``); ranks that take no anchors at that point
meet it with :meth:`OuterLevels.agree_taken`, the same collective."""

_TAKE_FIX = "Every rank must build its outer optimizers over its anchors without error."


def _tensor_bytes(value: object) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class OuterLevel:
    """One level's outer state on this rank: fp32 anchors (sharded like the tensors) and the outer optimizer.

    Local: no method here communicates. The anchors are taken with :meth:`take`, stepped with
    :meth:`step` after the level's all-reduce, and reset to a higher level's result with :meth:`reset`.

    Memory: one fp32 copy of this rank's averaged tensors (their local shards), plus the outer
    optimizer's state (SGD with momentum: one more fp32 copy), on ``device`` (else each tensor's own).
    :meth:`step` allocates one fp32 pseudo-gradient per tensor for the duration of the step.
    """

    def __init__(
        self,
        period: int,
        factory: OuterFactory,
        device: torch.device | None,
        group_size: int | None = None,
        fragments: int = 1,
    ) -> None:
        self.period = period
        self.fragments = fragments
        """The level's ``fragments``: above 1, the outer optimizer steps one view of the anchors per piece."""
        self.group_size = group_size
        """The level's group size, in ranks, for error messages (``None``: not known)."""
        self.factory = factory
        self.device = device
        self.anchors: list[torch.Tensor] | None = None
        self.pieces: tuple[Piece, ...] | None = None
        """At a level with ``fragments > 1``: every fragment's pieces, in order (:mod:`hieravg_optim.fragments`);
        the outer optimizer is then built over one view of the anchors per piece, so that a fragment's round steps
        its elements only. ``None``: over the anchors themselves."""
        self.params: list[torch.Tensor] | None = None
        """The tensors the outer optimizer steps: :attr:`anchors`, or their views at :attr:`pieces`."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.synced = False
        """Whether the anchors are known to be equal on every rank of the level's group (after a round)."""
        self.pseudo_grad_norm: float | None = None
        """L2 norm of this rank's pseudo-gradient at the level's last round (``None`` before the first)."""
        self.residuals: list[torch.Tensor] | None = None
        """A compressed level's error-feedback residuals on this rank (fp32, with the anchors; ``compress``):
        shaped like the anchors, or, node-aware, one flat tensor of the node's shard per fragment (one with
        ``fragments=1``; :func:`hieravg_optim.compression.round.residual_shapes`); ``None`` before its first
        compressed round, after :meth:`take`, or without error feedback."""

    # -- anchors -----------------------------------------------------------------------------------
    def take(self, tensors: Sequence[torch.Tensor], pieces: Sequence[Piece] | None = None) -> None:
        """Anchor = an fp32 copy of each tensor; build a fresh outer optimizer over the anchors, or, with
        ``pieces`` (a level with fragments), over the views ``anchor.view(-1)[start:stop]`` of each piece.

        Raises:
            TypeError, ValueError, RuntimeError: from :func:`build_outer_optimizer`, naming the level.
        """
        anchors = [
            t.detach().to(device=self.device or t.device, dtype=torch.float32, copy=True) for t in tensors
        ]
        params = anchors if pieces is None else [anchors[i].view(-1)[a:b] for i, a, b in pieces]
        optimizer = build_outer_optimizer(self.period, self.group_size, self.factory, params)
        self.anchors, self.optimizer, self.synced = anchors, optimizer, False
        self.pieces, self.params = (None if pieces is None else tuple(pieces)), params
        self.residuals = None

    @torch.no_grad()
    def reset(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` (a higher level's result, equal on every rank of this level's group) into the anchors.

        The outer optimizer's state (momentum) is kept, as in HALoS, and so are error-feedback residuals: what
        this level's rounds left unsent is in no tensor (a compressed round gives the tensors the decoded mean).
        """
        assert self.anchors is not None and len(tensors) == len(self.anchors)
        for a, t in zip(self.anchors, tensors):
            a.copy_(t)
        self.synced = True

    def mismatch(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """Why ``tensors`` cannot be stepped with these anchors (their number or shapes differ), or ``None``."""
        assert self.anchors is not None
        if len(tensors) != len(self.anchors):
            return f"{len(tensors)} tensors to average, but {len(self.anchors)} anchors"
        for i, (a, t) in enumerate(zip(self.anchors, tensors)):
            if a.shape != t.shape:
                return f"tensor {i} has shape {tuple(t.shape)}, its anchor {tuple(a.shape)}"
        return None

    # -- the outer step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tensors: Sequence[torch.Tensor], pieces: Sequence[Piece] | None = None) -> None:
        """``g = anchor - mean``; one outer step on the anchors; copy the anchors into ``tensors``.

        ``tensors`` hold the level's mean (after the all-reduce) and get the new anchors, cast to
        their dtype, in place. With ``pieces`` (a fragment's round, ``fragments``), ``tensors`` are the means of
        those pieces only (:meth:`param_indices`): the others get no pseudo-gradient, and the outer optimizer (which
        skips parameters without ``.grad``, as every ``torch.optim`` optimizer does) leaves them and their state
        unchanged. A round of every tensor at a level with fragments (``pieces`` ``None`` with :attr:`pieces` set:
        ``average_now``) steps every piece.
        """
        assert self.params is not None and self.optimizer is not None
        if pieces is None and self.pieces is not None:
            assert self.anchors is not None
            grads = [
                p - tensors[i].detach().reshape(-1)[a:b].to(device=p.device, dtype=torch.float32)
                for p, (i, a, b) in zip(self.params, self.pieces)
            ]
            self.step_with(grads, [torch.empty_like(p) for p in self.params])
            for a, t in zip(self.anchors, tensors):
                t.copy_(a.view(t.shape))
            return
        indices = None if pieces is None else self.param_indices(pieces)
        params = self.params if indices is None else [self.params[i] for i in indices]
        grads = [a - t.to(device=a.device, dtype=torch.float32).view(a.shape) for a, t in zip(params, tensors)]
        self.step_with(grads, tensors, indices)

    def param_indices(self, pieces: Sequence[Piece]) -> list[int]:
        """The positions in :attr:`params` of a round's ``pieces``: whole tensors without :attr:`pieces`, else
        pieces of the level's own split.

        Raises:
            RuntimeError: for a piece that is neither (the round's tensors differ from the anchors').
        """
        assert self.anchors is not None
        if self.pieces is None:
            whole = [i for i, a, b in pieces if a == 0 and b == self.anchors[i].numel()]
            if len(whole) == len(pieces):
                return whole
        else:
            where = {p: k for k, p in enumerate(self.pieces)}
            if all(p in where for p in pieces):
                return [where[p] for p in pieces]
        raise RuntimeError(
            f"The round at period {self.period} covers the pieces {pieces_text(list(pieces))}, which are not those "
            f"of its outer optimizer ({'whole tensors' if self.pieces is None else pieces_text(self.pieces)}): keep "
            "the averaged tensors fixed, or take the anchors again after changing them."
        )

    def at_params(self, per_anchor: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``per_anchor`` (tensors shaped like the anchors, e.g. the residuals) as :attr:`params` are: themselves,
        or their views ``t.view(-1)[start:stop]`` at :attr:`pieces`."""
        if self.pieces is None:
            return list(per_anchor)
        return [per_anchor[i].view(-1)[a:b] for i, a, b in self.pieces]

    @torch.no_grad()
    def step_with(
        self, grads: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], indices: Sequence[int] | None = None
    ) -> None:
        """One outer step on the anchors with the pseudo-gradients ``grads`` (fp32, shaped like :attr:`params`, on
        their devices; e.g. a compressed round's mean of decoded deltas); copy the stepped tensors into ``tensors``.
        With ``indices`` (a fragment's round, :meth:`param_indices`), ``grads`` and ``tensors`` are those of the
        :attr:`params` at those indices."""
        assert self.params is not None and self.optimizer is not None
        anchors = self.params if indices is None else [self.params[i] for i in indices]
        for a, g in zip(anchors, grads):
            a.grad = g
        # One host transfer per device, not one per tensor.
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(torch.linalg.vector_norm(g, dtype=torch.float64))
        squares = sum(float(torch.stack(norms).square().sum()) for norms in by_device.values())
        self.pseudo_grad_norm = math.sqrt(squares)
        try:
            self.optimizer.step()
        finally:  # the pseudo-gradient is never kept, not even when the outer step raises
            for a in self.params:
                a.grad = None
        for a, t in zip(anchors, tensors):
            t.copy_(a.view(t.shape))
        self.synced = True

    # -- accounting and checkpoints ----------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held on this rank: the anchors plus every tensor of the outer optimizer's state."""
        if self.anchors is None:
            return 0
        state = self.optimizer.state if self.optimizer is not None else {}
        held = _tensor_bytes(self.anchors) + _tensor_bytes(self.residuals or [])
        return held + sum(_tensor_bytes(s) for s in state.values())

    def state_dict(self) -> dict[str, Any]:
        """``{"anchors": [Tensor, ...], "optimizer": outer_optimizer.state_dict(), "synced": bool}``,
        ``"residuals": [Tensor, ...]`` when the level keeps error-feedback residuals (``compress``), and, at a level
        with fragments, ``"fragments"`` and ``"pieces"`` (:attr:`pieces`, as lists: the optimizer's state is per
        piece)."""
        assert self.anchors is not None and self.optimizer is not None
        state = {"anchors": list(self.anchors), "optimizer": self.optimizer.state_dict(), "synced": self.synced}
        if self.pieces is not None:
            state["fragments"], state["pieces"] = self.fragments, [list(p) for p in self.pieces]
        if self.residuals is not None:
            state["residuals"] = list(self.residuals)
        return state

    @torch.no_grad()
    def load(
        self,
        anchors: list[torch.Tensor],
        optimizer_state: Mapping[str, Any],
        synced: bool,
        residuals: list[torch.Tensor] | None = None,
        tensors: Sequence[torch.Tensor] | None = None,
        pieces: Sequence[Piece] | None = None,
    ) -> None:
        """Restore :meth:`check_state`'s output: into the current anchors and outer optimizer if any (the same
        objects, so references to them stay valid), else into new fp32 anchors and a new outer optimizer (over
        ``pieces``, the checked split of a level with fragments)."""
        if self.anchors is None or self.optimizer is None:
            # New anchors where take() puts them (outer_state_device, else with ``tensors``), not wherever the
            # checkpoint was mapped (map_location="cpu" would keep them in host memory for the rest of the run).
            self.take(tensors if tensors is not None else anchors, pieces)
        assert self.anchors is not None and self.optimizer is not None
        for mine, saved in zip(self.anchors, anchors):
            mine.copy_(saved)
        self.optimizer.load_state_dict(optimizer_state)
        self.synced = synced
        self.residuals = None
        if residuals is not None:
            device = self.anchors[0].device if self.anchors else None
            self.residuals = [r.detach().to(device=device or r.device, dtype=torch.float32, copy=True) for r in residuals]

    def drop(self) -> None:
        """Forget the anchors, the outer optimizer and any residuals (taken again with :meth:`take`)."""
        self.anchors, self.optimizer, self.synced, self.residuals = None, None, False, None
        self.pieces = self.params = None


class OuterLevels:
    """The outer state of an averager's levels on this rank: per level an :class:`OuterLevel`, or ``None`` for a
    level that averages plainly."""

    def __init__(
        self,
        levels: Sequence[AveragingLevel],
        factories: Mapping[int, OuterFactory],
        device: torch.device | None,
        fragments: Sequence[int] = (),
    ) -> None:
        self.device = device
        fragments = tuple(fragments) or (1,) * len(levels)
        self.by_level: list[OuterLevel | None] = [
            OuterLevel(lv.period, factories[lv.period], device, lv.group_size, f) if lv.period in factories else None
            for lv, f in zip(levels, fragments)
        ]
        self.has_outer = any(o is not None for o in self.by_level)
        """Whether some level has an outer optimizer (fixed at construction)."""
        self.skip_last = 0
        """How many tensors at the end of every list are averaged plainly (no anchor, no outer step)."""

    def __iter__(self):
        """The levels with an outer optimizer, in level order."""
        return (o for o in self.by_level if o is not None)

    @property
    def has_anchors(self) -> bool:
        return self.has_outer and all(o.anchors is not None for o in self)

    @property
    def periods(self) -> tuple[int, ...]:
        return tuple(o.period for o in self)

    def part(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The local tensors of ``tensors`` that the anchors follow (all but the last :attr:`skip_last`)."""
        return [local_tensor(t) for t in tensors[: len(tensors) - self.skip_last]]

    def pieces_of(self, outer: OuterLevel, tensors: Sequence[torch.Tensor]) -> tuple[Piece, ...] | None:
        """The pieces ``outer``'s optimizer steps for ``tensors`` (the whole list, as :meth:`take` gets it): every
        fragment's pieces of the anchored tensors, in order (the split is over all of ``tensors``, as the rounds'
        :meth:`hieravg_optim.delayed.DelayedRounds.plan`); ``None`` at a level with one fragment. Pure.

        Raises:
            ValueError: from :func:`hieravg_optim.fragments.split_fragments`.
        """
        if outer.fragments == 1:
            return None
        split = level_splits(split_key(tensors), (outer.fragments,))[0]
        anchored = len(tensors) - self.skip_last
        return tuple(p for fragment in split for p in fragment if p[0] < anchored)

    def segments(self, outer: OuterLevel, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Per fragment of ``outer``'s level, the number of its anchored elements on this rank (its pieces of all
        but the last :attr:`skip_last` of ``tensors``, the whole list): consecutive runs of the flattened anchored
        tensors, in order; one segment of them all at a level with one fragment. A node-aware compressed level
        keeps one residual shard per segment. Pure.

        Raises:
            ValueError: from :func:`hieravg_optim.fragments.split_fragments`.
        """
        if outer.fragments == 1:
            return [sum(t.numel() for t in self.part(tensors))]
        split = level_splits(split_key(tensors), (outer.fragments,))[0]
        anchored = len(tensors) - self.skip_last
        return [sum(b - a for i, a, b in fragment if i < anchored) for fragment in split]

    def params_of(self, outer: OuterLevel, pieces: Sequence[Piece], n_tensors: int) -> list[int | None]:
        """Per piece of a round over ``n_tensors`` averaged tensors: the index of its outer tensor in ``outer``'s
        :attr:`OuterLevel.params`, or ``None`` for a buffer (the last :attr:`skip_last` tensors, without anchors).

        Raises:
            RuntimeError: from :meth:`OuterLevel.param_indices`.
        """
        anchored = [k for k, (i, _, _) in enumerate(pieces) if i < n_tensors - self.skip_last]
        out: list[int | None] = [None] * len(pieces)
        for k, index in zip(anchored, outer.param_indices([pieces[k] for k in anchored])):
            out[k] = index
        return out

    def take(self, tensors: Sequence[torch.Tensor], *, agree_over: dist.ProcessGroup | None = None) -> None:
        """Take the anchors of every level at ``tensors``; on a failure, no level keeps any.

        With ``agree_over``, also agree over that process group that every rank took them (see
        :meth:`hieravg_optim.HierarchicalAverager.take_anchors`), raising on every rank.
        """
        error: BaseException | None = None
        try:
            local = self.part(tensors)
            for outer in self:
                outer.take(local, self.pieces_of(outer, tensors))
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank with agree_over
            self.drop()
            error = exc
        if agree_over is not None:
            self.agree_taken(agree_over, error)
        if error is not None:
            raise error

    def agree_taken(self, process_group: dist.ProcessGroup, error: BaseException | None = None) -> None:
        """The agreement of :meth:`take` (``agree_over``), for a rank that takes no anchors at that point."""
        agree_across_ranks(TAKE_ANCHORS, None, process_group, error=error, fix=_TAKE_FIX)

    def drop(self) -> None:
        for outer in self:
            outer.drop()

    def context(self, level_index: int) -> dict[str, object]:
        """What the ranks of a round at a level with an outer optimizer agree on besides the tensors.

        Whether its anchors are taken, and whether they are known to be equal across the group (else this
        round averages them first, one more all-reduce): a rank that took anchors the others did not
        (``take_anchors`` on some ranks, a checkpoint loaded on some ranks) is then a ``RuntimeError`` on every
        rank of the group, not a collective that only some ranks enter.
        """
        outer = self.by_level[level_index]
        if outer is None:
            return {}
        anchors = "not taken" if outer.anchors is None else "equal across the group" if outer.synced else "taken"
        return {f"the anchors of the outer optimizer (period {outer.period})": anchors}

    def error(
        self, level_index: int, tensors: Sequence[torch.Tensor], step: int, warmup_steps: int
    ) -> BaseException | None:
        """The local error of a round at a level with an outer optimizer, raised on every rank by its agreement."""
        outer = self.by_level[level_index]
        if outer is None:
            return None
        if outer.anchors is None:
            if step < warmup_steps:
                return None  # a synchronous warm-up round: plain averaging
            return RuntimeError(
                f"The level of period {outer.period} has an outer optimizer but no anchors at step {step} "
                "(past the warm-up): call HierarchicalAverager.take_anchors(tensors) once the replicas are "
                "equal (at construction, after any broadcast from the first replica), before the first round."
            )
        why = outer.mismatch(self.part(tensors))
        if why is None:
            return None
        return RuntimeError(
            f"The tensors averaged at step {step} (period {outer.period}) differ from the level's anchors: "
            f"{why}. The outer optimizer needs the same tensors at every round: keep the set of averaged (and "
            "frozen) parameters fixed, or, after changing it (add_param_group, a parameter frozen or unfrozen), take "
            "the anchors again on every rank (the outer optimizer restarts without momentum): "
            "opt.averager.take_anchors(opt.tensors_to_average()) on the optimizer wrapper, or "
            "HierarchicalAverager.take_anchors(tensors)."
        )

    def reset_lower(self, level_index: int, tensors: Sequence[torch.Tensor]) -> None:
        """After a round at ``level_index``: the anchors of every lower level with an outer optimizer := ``tensors``."""
        lower = [o for o in self.by_level[:level_index] if o is not None and o.anchors is not None]
        if lower:
            local = self.part(tensors)
            for o in lower:
                if o.mismatch(local) is None:
                    o.reset(local)


class OuterAnchorsMixin:
    """The outer optimizers of :class:`~hieravg_optim.HierarchicalAverager` (a base class of it).

    Reads the averager's ``_outers`` (:class:`OuterLevels`), ``_metrics``, ``step``, ``config`` and
    ``timed_process_group``.
    """

    _outers: OuterLevels
    _metrics: list
    step: int
    config: Any
    process_group: dist.ProcessGroup
    timed_process_group: dist.ProcessGroup

    @property
    def outer_skip_last(self) -> int:
        """How many tensors at the end of every list given to :meth:`take_anchors` and :meth:`average` are
        averaged plainly at levels with an outer optimizer: no anchor, no outer step. The optimizer wrapper
        (its ``buffers``) and the DeepSpeed adapter (``average_buffers``) set it to their number of buffers,
        whose running statistics (BatchNorm's ``running_var``) an outer step with momentum could push out of
        range (a negative variance)."""
        return self._outers.skip_last

    @outer_skip_last.setter
    def outer_skip_last(self, value: int) -> None:
        self._outers.skip_last = value

    @property
    def _outer(self) -> list:
        """Per level: its :class:`~hieravg_optim.anchors.OuterLevel`, or ``None`` for a level that averages plainly."""
        return self._outers.by_level

    @property
    def has_outer(self) -> bool:
        """Whether some level has an outer optimizer."""
        return self._outers.has_outer

    @property
    def has_anchors(self) -> bool:
        """Whether every level with an outer optimizer holds its anchors (``False`` if there is none)."""
        return self._outers.has_anchors

    @property
    def needs_anchors(self) -> bool:
        """Whether the anchors are due but missing: a level has an outer optimizer, the count is past the
        warm-up (``step >= warmup_steps``), and some anchor is not there (at construction with
        ``warmup_steps=0``, or after loading a checkpoint without them). A wrapper then calls
        :meth:`take_anchors` before its next inner step."""
        return self.has_outer and not self.has_anchors and self.step >= self.config.warmup_steps

    @property
    def outer_periods(self) -> tuple[int, ...]:
        """The periods of the levels with an outer optimizer, in level order."""
        return self._outers.periods

    def outer_optimizer(self, period: int) -> torch.optim.Optimizer | None:
        """The outer optimizer of the level of period ``period`` in use now; local, no collective.

        The factory is called more than once (on a one-element probe tensor at construction, on meta tensors
        to dry-run a loaded state, at each :meth:`take_anchors`), so keep no optimizer it returns: read the one
        in use here, e.g. to change its learning rate (``param_groups``) or attach a scheduler after the
        anchors are taken. Loading a state dict keeps the same object.

        Returns:
            The outer optimizer, or ``None`` before the level's anchors are taken.

        Raises:
            ValueError: if ``period`` is not a period with an outer optimizer (naming those that have one).
        """
        for outer in self._outers:
            if outer.period == period:
                return outer.optimizer
        raise ValueError(
            f"outer_optimizer({period!r}): no level of period {period!r} has an outer optimizer; those with one: "
            f"{list(self.outer_periods)}."
        )

    def take_anchors(self, tensors: Sequence[torch.Tensor], *, agree: bool = False) -> None:
        """Anchor every level with an outer optimizer at ``tensors``: fp32 copies, and fresh outer optimizers.

        Local, no collective (unless ``agree``). Each anchor is an fp32 copy of the tensor (this rank's local shard), on
        ``outer_state_device`` or else the tensor's device; each level's outer optimizer is rebuilt with
        ``factory(anchors)`` (its state starts empty). The anchors need not be equal across ranks: a
        level's first round after this averages its anchors over its group first (one extra all-reduce of
        the anchors, once), so the replicas of the group compute the same outer step.

        :meth:`step_and_average` calls it itself right after count ``warmup_steps - 1`` (after that
        count's synchronous warm-up round, if any); with ``warmup_steps=0`` the wrapper or adapter calls it
        at construction, after any broadcast from the first replica. A no-op without outer optimizers.

        Args:
            tensors: This rank's tensors, the same list, in the same order, as :meth:`average` will get.
            agree: Also agree with every rank of the process group that each took its anchors (one
                all-gather of two int64 per rank), so that a failure on some ranks only (a factory that
                raises there, no memory left for the anchors) is raised on every rank, not a hang at the
                next round. Every rank of the process group must then call it at the same point; the
                wrappers and adapters do, at construction and at the end of the warm-up.

        Raises:
            TypeError, ValueError, RuntimeError: if a factory fails on the anchors (raises, or returns something
                other than a ``torch.optim.Optimizer`` over exactly the anchors it is given), naming the level
                (period, group size) and the fix (:func:`hieravg_optim.outer.build_outer_optimizer`).
            Exception: whatever the anchors' allocation raises. With ``agree``, each error on the ranks where it
                happened, and a ``RuntimeError`` naming them on the others.
        """
        self._outers.take(tensors, agree_over=self.timed_process_group if agree else None)
        for m in self._metrics:
            m.pseudo_grad_norm = None

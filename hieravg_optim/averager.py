"""The stateful averager: the step count, the subgroups, the buckets and the metrics.

:class:`HierarchicalAverager` averages a list of tensors when the schedule says so,
once per optimizer step. It is the piece the optimizer wrapper
(:class:`~hieravg_optim.HierarchicalAveragingOptimizer`) and the DeepSpeed and FSDP
adapters drive, as torch's ``PostLocalSGDOptimizer`` drives a ``HierarchicalModelAverager``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import replica
from ._handover import hand_over
from .agreement import agree_across_ranks, check_agreement, has_nonfinite, raise_on_every_rank
from .averaging import BucketPool, average_tensors_
from .config import AveragingConfig, is_int, warn_at_caller
from .faults import named_collective
from .groups import LevelGroup, build_level_groups, process_group_timeout
from .outer import OuterFactory, OuterLevel, check_outer_optimizers, check_outer_state_device, probe_factory
from .replica import replica_any, replica_group_for
from .schedule import AveragingLevel, level_at, period_of_key

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

__all__ = [
    "HierarchicalAverager",
    "LevelMetrics",
    "bytes_sent",
    "check_log_metrics_every",
    "check_outer",
    "local_tensor",
]

TAKE_ANCHORS = "taking the anchors of the outer optimizers"
"""What :meth:`HierarchicalAverager.take_anchors` agrees on (``agree=True``); ranks that take no anchors at that
point call :func:`~hieravg_optim.agreement.agree_across_ranks` with it and ``None``, the same collective."""

logger = logging.getLogger(__package__ + ".optimizer")
"""The metrics of ``log_metrics_every`` go to the ``hieravg_optim.optimizer`` logger, the name documented for it."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank averages: the local shard of a DTensor, else ``t`` detached.

    Both share storage with ``t``; nothing is copied and nothing is rebound.
    """
    if isinstance(t, DTensor):
        return t.to_local().detach()
    return t.detach()


@dataclass(slots=True)
class LevelMetrics:
    """What one level of the hierarchy has done on this rank since construction."""

    period: int
    """The level's period, in steps."""
    group_size: int
    """The level's group size, in ranks."""
    subgroup_size: int
    """Ranks this rank averages with at this level (replicas holding the same shard)."""
    rounds: int = 0
    """Averaging rounds run, as the schedule gives them: a level whose subgroup is this rank alone
    (``subgroup_size`` 1, a single replica) counts its rounds too, with no communication
    (``payload_bytes`` and ``bytes_sent`` stay 0; an outer optimizer still steps)."""
    payload_bytes: int = 0
    """Bytes this rank all-reduced, in the level's wire dtypes (``comm_dtype``), summed over rounds."""
    bytes_sent: int = 0
    """Bytes this rank sent, estimated as ring collectives do: ``2 (n - 1) / n`` times the payload for a flat
    all-reduce; node-aware, ``2 (m - 1) / m`` of it inside the node plus ``2 (q - 1) / (q m)`` across nodes
    (``m`` ranks per node, ``q`` nodes)."""
    seconds: float = 0.0
    """Wall-clock seconds spent averaging, agreement check included (and the outer step, if any)."""
    outer_bytes: int = 0
    """Bytes this rank holds for the level's outer optimizer: its fp32 anchors plus the outer optimizer's
    state (0 without an outer optimizer, or before the anchors are taken)."""
    pseudo_grad_norm: float | None = None
    """L2 norm of this rank's pseudo-gradient (``anchor - mean``, over its shards) at the level's last round;
    ``None`` before the first round after the anchors were taken, or without an outer optimizer."""


def bytes_sent(payload: int, lg: LevelGroup) -> int:
    """Bytes one rank sends to all-reduce ``payload`` bytes at level ``lg``, as ring collectives do."""
    if lg.node is None:
        return 2 * (lg.size - 1) * payload // lg.size
    m, q = lg.node.local_size, lg.node.cross_size
    return 2 * (m - 1) * payload // m + 2 * (q - 1) * payload // (q * m)


def check_log_metrics_every(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is ``None`` or a positive integer number of steps."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"log_metrics_every must be a positive integer number of steps or None, got {value!r}. "
            "Pass e.g. log_metrics_every=100 to log the averaging metrics every 100 steps."
        )


def check_outer(
    config: AveragingConfig,
    outer_optimizers: Mapping[int | str, OuterFactory] | None,
    outer_state_device: str | torch.device | None,
) -> tuple[dict[int, OuterFactory], torch.device | None, dict[int, object]]:
    """Validate ``outer_optimizers`` and ``outer_state_device`` against ``config``; local, no collective.

    Each factory is probed on one small tensor (see :func:`hieravg_optim.outer.probe_factory`).

    Returns:
        ``(factories, device, kinds)``: ``{period: factory}``, the device or ``None``, and per period the
        outer optimizer's class and hyperparameters, which the ranks agree on at construction.

    Raises:
        TypeError, ValueError: see :func:`hieravg_optim.outer.check_outer_optimizers` and
            :func:`hieravg_optim.outer.check_outer_state_device`.
    """
    factories = check_outer_optimizers(outer_optimizers, config.levels)
    device = check_outer_state_device(outer_state_device)
    sizes = {lv.period: lv.group_size for lv in config.levels}
    kinds = {period: probe_factory(period, factory, sizes[period]) for period, factory in factories.items()}
    return factories, device, kinds


class HierarchicalAverager:
    """Hierarchical model averaging of a set of tensors, driven once per optimizer step.

    The schedule and the checks are those of torch's
    ``torch.distributed.algorithms.model_averaging.hierarchical_model_averager.HierarchicalModelAverager``
    (hierarchical SGD, https://arxiv.org/abs/2010.12998); the averaging itself is
    :func:`hieravg_optim.averaging.average_tensors_`, in place and bucketed.

    .. warning::
        The constructor is collective over ``process_group`` (by default the
        default group): every rank of it must call it with the same config, because
        it creates the subgroups with :func:`torch.distributed.new_group`. :meth:`step` is collective over the
        subgroup that averages at that step.

    Args:
        config: The validated settings.
        process_group: The overall process group; ``None`` means the default group.
        log_metrics_every: Log :meth:`metrics` through the ``hieravg_optim.optimizer`` logger at INFO every
            this many steps (at step counts that are multiples of it); ``None`` never logs.
        agreed: ``True`` when the caller has already checked ``config`` with
            :meth:`AveragingConfig.check_world_size` against the size of ``process_group`` and agreed on
            it across its ranks (:func:`hieravg_optim.deepspeed.initialize` does both, in its one
            agreement collective): the constructor then skips that check and its own agreement collective
            (the caller has then agreed on ``outer_optimizers``' periods and ``outer_state_device`` too).
        outer_optimizers: ``{period: factory}``: the levels with an outer optimizer (DiLoCo,
            https://arxiv.org/abs/2311.08105; HALoS, https://arxiv.org/abs/2506.04531). Each such level keeps
            fp32 anchors of the averaged tensors (taken by :meth:`take_anchors`) and an outer optimizer built by
            ``factory(anchors)``; its rounds then step the anchors with the pseudo-gradient ``anchor - mean`` and
            give the tensors the anchors' new value (see :meth:`average` and ``docs/outer.md``). Keys are periods
            (ints, or strings of digits as in JSON); ``None`` or a level without an entry averages plainly.
            See :func:`hieravg_optim.nesterov_outer`.
        outer_state_device: Where the anchors and the outer optimizer's state live, e.g. ``"cpu"`` to keep
            them off the accelerator (torchft's ``backup_device``); ``None`` (default): each tensor's own device.
        replica_group: This rank's replica group (its ``ranks_per_replica`` consecutive ranks), if one exists
            already, e.g. the DeepSpeed mpu's data-parallel group: used for the replica's finiteness vote and
            :meth:`average_within_replica` instead of building another; ``None``: built when needed.

    Raises:
        ValueError: from :meth:`AveragingConfig.check_world_size`, for a ``log_metrics_every``
            that is not a positive integer, an ``outer_optimizers`` key that is not a period, an outer
            optimizer with a non-finite hyperparameter or ``maximize=True``, or a bad
            ``outer_state_device``; on every rank, before any collective.
        TypeError: for an ``outer_optimizers`` that is not a mapping, a factory that is not callable or
            returns something other than a ``torch.optim.Optimizer`` over exactly the tensors it is given
            (probed on one small tensor), or an ``outer_state_device`` that is not a string or a
            ``torch.device``; on every rank, before any collective.
        RuntimeError: if the ranks were given different configs (or different periods with an outer optimizer,
            outer optimizers of different classes or hyperparameters (``defaults``), or different
            ``outer_state_device``), or another rank's config failed these checks (that rank
            raises the ValueError; the others a RuntimeError naming it, never a hang).
    """

    def __init__(
        self,
        config: AveragingConfig,
        process_group: dist.ProcessGroup | None = None,
        *,
        log_metrics_every: int | None = None,
        agreed: bool = False,
        outer_optimizers: Mapping[int | str, OuterFactory] | None = None,
        outer_state_device: str | torch.device | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            check_log_metrics_every(log_metrics_every)  # a bad value is named first, as with a process group
            check_outer(config, outer_optimizers, outer_state_device)
            raise RuntimeError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group() "
                "(or launch with torchrun / deepspeed) before creating the averager."
            )
        self.config = config
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if dist.get_rank(self.process_group) < 0:
            raise ValueError(
                f"Rank {dist.get_rank()} is not a member of the given process_group: create the averager "
                "only on the ranks of process_group (each rank passes the group it belongs to)."
            )
        self.world_size = dist.get_world_size(self.process_group)
        if agreed:
            check_log_metrics_every(log_metrics_every)
            factories, device, _ = check_outer(config, outer_optimizers, outer_state_device)
        else:
            # Local checks; a failure on some ranks only is raised on every rank by the agreement below.
            error: BaseException | None = None
            factories, device, kinds = {}, None, {}
            try:
                check_log_metrics_every(log_metrics_every)
                config.check_world_size(self.world_size)
                factories, device, kinds = check_outer(config, outer_optimizers, outer_state_device)
            except (TypeError, ValueError) as exc:
                error = exc
            agreed_value = {
                **asdict(config),
                "periods with an outer optimizer": sorted(factories),
                "outer_state_device": None if device is None else str(device),
                # The class and hyperparameters of each level's outer optimizer: replicas stepping with
                # different outer optimizers would drift apart silently.
                "outer optimizers (class, defaults)": kinds,
            }
            agree_across_ranks("the averaging config", agreed_value, self.process_group, error=error)
        self.level_groups: list[LevelGroup] = build_level_groups(config, self.process_group)
        # A sharded replica's ranks decide together whether it is finite (one int64 per round).
        self._replica_group = replica_group_for(config, self.process_group, self._group_timeout(), replica_group)
        self._replica_ranks = (
            [] if self._replica_group is None else dist.get_process_group_ranks(self._replica_group)
        )
        self.step = 0
        """The averaging step count: optimizer steps taken so far (``HierarchicalModelAverager.step``)."""
        self.pool = BucketPool()
        self.replaced_at_step: int | None = None
        """The count of the last round that replaced this rank's tensors by the finite replicas' mean
        (``nonfinite="skip_replica"``, this rank's replica non-finite); ``None`` if none has. Local."""
        self._metrics = [
            LevelMetrics(period=lg.level.period, group_size=lg.level.group_size, subgroup_size=lg.size)
            for lg in self.level_groups
        ]
        # The first step checks that every rank starts at the same count: a checkpoint loaded on some
        # ranks only is then a RuntimeError there, not a collective mismatch.
        self._verify_step_pending = True
        self.log_metrics_every: int | None = log_metrics_every
        """Log :meth:`metrics` through ``logging`` at INFO every this many steps (``None``: never)."""
        self.outer_state_device: torch.device | None = device
        """Where anchors and outer optimizer state live; ``None``: each tensor's own device."""
        # One entry per level: its outer state, or None for a level that averages plainly.
        self._outer: list[OuterLevel | None] = [
            OuterLevel(lv.period, factories[lv.period], device, lv.group_size) if lv.period in factories else None
            for lv in config.levels
        ]
        self.outer_skip_last: int = 0
        """How many tensors at the end of every list given to :meth:`take_anchors` and :meth:`average` are
        averaged plainly at levels with an outer optimizer: no anchor, no outer step. The optimizer wrapper
        (its ``buffers``) and the DeepSpeed adapter (``average_buffers``) set it to their number of buffers, whose running statistics (BatchNorm's ``running_var``) an
        outer step with momentum could push out of range (a negative variance)."""

    @property
    def levels(self) -> tuple[AveragingLevel, ...]:
        return self.config.levels

    @property
    def warmup_steps(self) -> int:
        return self.config.warmup_steps

    @property
    def has_outer(self) -> bool:
        """Whether some level has an outer optimizer."""
        return any(o is not None for o in self._outer)

    @property
    def has_anchors(self) -> bool:
        """Whether every level with an outer optimizer holds its anchors (``False`` if there is none)."""
        return self.has_outer and all(o.anchors is not None for o in self._outer if o is not None)

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
        return tuple(o.period for o in self._outer if o is not None)

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
        for outer in self._outer:
            if outer is not None and outer.period == period:
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
        error: BaseException | None = None
        try:
            tensors = self._outer_part(tensors)
            for outer in self._outer:
                if outer is not None:
                    outer.take(tensors)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank with agree
            for outer in self._outer:
                if outer is not None:
                    outer.drop()  # no level keeps anchors another level failed to take
            error = exc
        if agree:
            agree_across_ranks(
                TAKE_ANCHORS,
                None,
                self.process_group,
                error=error,
                fix="Every rank must build its outer optimizers over its anchors without error.",
            )
        if error is not None:
            raise error
        for m in self._metrics:
            m.pseudo_grad_norm = None

    def due_level(self) -> int | None:
        """Index of the level that averages at the current count, or ``None``.

        With :attr:`AveragingConfig.synchronous_warmup`, every warm-up count (below ``warmup_steps``)
        averages at the top level; otherwise :func:`~hieravg_optim.schedule.level_at` decides.
        """
        if self.config.synchronous_warmup and self.step < self.config.warmup_steps:
            return len(self.config.levels) - 1
        return level_at(self.step, self.config.levels, self.config.warmup_steps)

    def step_and_average(
        self,
        tensors: Callable[[], Sequence[torch.Tensor]],
        *,
        check: Callable[[], BaseException | None] | None = None,
        context: Callable[[], Mapping[str, object]] | None = None,
    ) -> int | None:
        """Average ``tensors()`` if the schedule says so at the current count, then advance the count.

        Call it once per optimizer step, after the inner optimizer has stepped.

        Args:
            tensors: Called only when averaging is due (and at the end of the warm-up, with outer
                optimizers); returns the tensors to average in place. If it, ``check`` or ``context``
                raises on some ranks only, every rank of the subgroup (of the process group, at the end
                of the warm-up) raises, before any averaging collective: those ranks their exception,
                the others a ``RuntimeError`` naming them.
            check: Called only when averaging is due, before ``tensors()``; returns the error of a
                local check that failed (or ``None``), raised on every rank of the subgroup by
                :meth:`average` before any averaging collective.
            context: Called only when averaging is due; returns what else the ranks of the subgroup
                must agree on, by name (see :meth:`average`).

        Returns:
            The index of the level that averaged, or ``None``.
        """
        self.verify_step_if_loaded()
        index = self.due_level()
        if index is not None:
            # A callback that raises on some ranks only is raised on every rank of the subgroup by the round's
            # agreement, instead of those ranks leaving while the others wait in it until the timeout.
            chosen: Sequence[torch.Tensor] = []
            extra = None
            try:
                error = None if check is None else check()
                extra = None if context is None else context()
                chosen = tensors()
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank of the subgroup
                error, extra, chosen = exc, None, []
            self.average(index, chosen, error=error, context=extra)
        if self.has_outer and self.step == self.config.warmup_steps - 1:
            try:
                chosen = tensors()
            except Exception as exc:  # noqa: BLE001 - the other ranks wait in take_anchors' agreement
                raise_on_every_rank(exc, self.process_group, "taking the anchors of the outer optimizers")
            self.take_anchors(chosen, agree=True)  # the end of the warm-up
        self.step += 1
        if self.log_metrics_every and self.step % self.log_metrics_every == 0:
            logger.info("hierarchical averaging at step %d: %s", self.step, self.metrics())
        return index

    def average(
        self,
        level_index: int,
        tensors: Sequence[torch.Tensor],
        *,
        error: BaseException | None = None,
        context: Mapping[str, object] | None = None,
    ) -> None:
        """Average ``tensors`` in place at level ``level_index`` now, whatever the count.

        ``level_index=-1`` averages at the top level: with ``ranks_per_replica=1``, over
        the whole process group.

        At a level with an outer optimizer whose anchors are taken (:meth:`take_anchors`), the round
        goes on after the in-place average gives ``mean``: the pseudo-gradient ``g = anchor - mean``
        (torchft's sign: outer SGD with lr 1 and no momentum gives back ``mean``) is set as the
        anchors' ``.grad``, the outer optimizer steps once, and the anchors are copied into ``tensors``
        in place (cast to their dtype). The level's first round after :meth:`take_anchors` first
        averages the anchors over the group too (one more all-reduce, in fp32). Then, after any level's
        round (outer or plain), the anchors of every lower level with an outer optimizer are reset to
        the new ``tensors``; higher levels keep theirs. Before the anchors are taken (warm-up rounds)
        the level averages plainly. The outer step is local: every rank of the group holds the same
        anchors, mean and outer state, so the replicas stay identical.

        .. warning::
            Collective over this rank's subgroup at that level.

        Args:
            level_index: Index of the level in :attr:`levels`; -1 for the top level.
            tensors: The tensors to average in place.
            error: A local check of this rank that failed: raised here instead of averaging, and as
                a ``RuntimeError`` on the other ranks of the subgroup, in the agreement collective.
            context: What else the ranks of the subgroup must agree on, by name (e.g. which parameters
                are frozen and skipped); part of the agreement check, so a disagreement is a
                ``RuntimeError`` naming it on every rank, not averaging of different tensors.

        With ``config.nonfinite`` other than ``"ignore"``, every rank first checks its tensors for NaN and
        infinities (one reduction per tensor, see :func:`hieravg_optim.agreement.has_nonfinite`); the ranks
        agree on the result in the agreement collective, with no extra round trip.

        Raises:
            RuntimeError: if the ranks of the subgroup disagree on the tensors or ``context``, or another
                rank passed an ``error`` (see :func:`hieravg_optim.agreement.check_agreement`); on every rank of the
                subgroup, naming the ranks and replicas, if some hold non-finite values under
                ``nonfinite="raise"``, or all of them under ``"skip_replica"``; if a collective of the
                round fails (a dead or hung peer, ranks out of step): naming the round, the step count
                and the subgroup's ranks, chained to the backend's error
                (:func:`hieravg_optim.faults.named_collective`).
            WireOverflowError: (a ``RuntimeError``) on every rank of the subgroup, with ``comm_dtype`` float16
                at this level and ``nonfinite`` other than ``"ignore"``, if the float16 sums overflowed; every
                tensor is left unchanged (see :func:`hieravg_optim.averaging.average_tensors_`).
            Exception: ``error``, if given.
        """
        level_index = range(len(self.level_groups))[level_index]
        lg = self.level_groups[level_index]
        metrics = self._metrics[level_index]
        outer = self._outer[level_index]
        if outer is not None and error is None:
            error = self._outer_error(outer, tensors)
        if outer is not None and outer.anchors is None:
            outer = None  # warm-up: no anchors yet, plain averaging
        if lg.group is None:
            if error is not None:
                raise error
            start = time.perf_counter()
            if outer is not None:
                outer.step(self._outer_part(tensors))
                metrics.pseudo_grad_norm = outer.pseudo_grad_norm
            self._reset_lower_anchors(level_index, tensors)
            metrics.rounds += 1
            metrics.seconds += time.perf_counter() - start
            return
        start = time.perf_counter()
        round_name = (
            f"the averaging round at step {self.step} (period {lg.level.period}, group size {lg.level.group_size})"
        )
        with torch.no_grad(), named_collective(round_name, lg.ranks, timeout_s=self._timeout_s(lg)):
            # Anchors not yet averaged over the group are local copies (taken at the end of the warm-up, or at
            # construction) and enter this round's mean of anchors: a non-finite one is checked as the tensors are.
            unsynced = outer is not None and not outer.synced
            nonfinite = None
            if self.config.nonfinite != "ignore":
                try:
                    local = has_nonfinite(tensors) or (unsynced and has_nonfinite(outer.anchors))
                except Exception as exc:  # noqa: BLE001 - raised on every rank of the group by the agreement
                    local, error = False, error or exc
                # Over this rank's replica, not the level's group: a hung peer there is named as such.
                with named_collective(
                    f"the agreement of the replica's ranks on whether it is finite, before {round_name}",
                    self._replica_ranks,
                    timeout_s=self.config.collective_timeout_s,
                ):
                    nonfinite = replica_any(local, self._replica_group)
            bad = check_agreement(
                tensors,
                lg.group,
                lg.ranks,
                context={
                    "step count": self.step,
                    "bucket_cap_mb": self.config.bucket_cap_mb,
                    **self._outer_context(level_index),
                    **(context or {}),
                },
                what=f"the parameters to average at step {self.step} (period {lg.level.period}, group size "
                f"{lg.level.group_size})",
                error=error,
                nonfinite=nonfinite,
            )
            divisor = self._skip_nonfinite(lg, bad, tensors, round_name, anchors=unsynced) if bad else None
            payload = average_tensors_(
                tensors,
                lg.group,
                lg.size,
                bucket_cap_bytes=self.config.bucket_cap_bytes,
                pool=self.pool,
                divisor=divisor,
                comm_dtype=self.config.comm_dtype[level_index] if self.config.comm_dtype else None,
                node=lg.node,
                check_wire=self.config.nonfinite != "ignore",
                what=round_name,
                contribute_zeros=dist.get_rank() in bad,
            )
            if dist.get_rank() in bad:
                self.replaced_at_step = self.step
            if outer is not None:
                if not outer.synced:
                    payload += self._sync_anchors(outer, lg, self._outer_part(tensors), bad, divisor)
                outer.step(self._outer_part(tensors))
                metrics.pseudo_grad_norm = outer.pseudo_grad_norm
        self._reset_lower_anchors(level_index, tensors)
        metrics.rounds += 1
        metrics.payload_bytes += payload
        metrics.bytes_sent += bytes_sent(payload, lg)
        metrics.seconds += time.perf_counter() - start

    def _outer_part(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The local tensors of ``tensors`` that levels with an outer optimizer anchor (all but :attr:`outer_skip_last`)."""
        return [local_tensor(t) for t in tensors[: len(tensors) - self.outer_skip_last]]

    def _outer_context(self, level_index: int) -> dict[str, object]:
        """What the ranks of a round at a level with an outer optimizer agree on besides the tensors.

        Whether its anchors are taken, and whether they are known to be equal across the group (else this
        round averages them first, one more all-reduce): a rank that took anchors the others did not
        (``take_anchors`` on some ranks, a checkpoint loaded on some ranks) is then a ``RuntimeError`` on every
        rank of the group, not a collective that only some ranks enter.
        """
        outer = self._outer[level_index]
        if outer is None:
            return {}
        anchors = "not taken" if outer.anchors is None else "equal across the group" if outer.synced else "taken"
        return {f"the anchors of the outer optimizer (period {outer.period})": anchors}

    def _outer_error(self, outer: OuterLevel, tensors: Sequence[torch.Tensor]) -> BaseException | None:
        """The local error of a round at a level with an outer optimizer, raised on every rank by its agreement."""
        if outer.anchors is None:
            if self.step < self.config.warmup_steps:
                return None  # a synchronous warm-up round: plain averaging
            return RuntimeError(
                f"The level of period {outer.period} has an outer optimizer but no anchors at step {self.step} "
                "(past the warm-up): call HierarchicalAverager.take_anchors(tensors) once the replicas are "
                "equal (at construction, after any broadcast from the first replica), before the first round."
            )
        why = outer.mismatch(self._outer_part(tensors))
        if why is None:
            return None
        return RuntimeError(
            f"The tensors averaged at step {self.step} (period {outer.period}) differ from the level's anchors: "
            f"{why}. The outer optimizer needs the same tensors at every round: keep the set of averaged (and "
            "frozen) parameters fixed, or, after changing it (add_param_group, a parameter frozen or unfrozen), take "
            "the anchors again on every rank (the outer optimizer restarts without momentum): "
            "opt.averager.take_anchors(opt.tensors_to_average()) on the optimizer wrapper, or "
            "HierarchicalAverager.take_anchors(tensors)."
        )

    def _sync_anchors(
        self, outer: OuterLevel, lg: LevelGroup, tensors: Sequence[torch.Tensor], bad: list[int], divisor: int | None
    ) -> int:
        """Average ``outer``'s anchors over ``lg`` (fp32, on the tensors' devices); returns the payload in bytes.

        Run at the level's first round after :meth:`take_anchors`, whose local copies may differ across
        replicas (e.g. without a synchronous warm-up). Ranks skipped for non-finite tensors add nothing.
        """
        assert outer.anchors is not None
        staged = [a if a.device == t.device else a.to(t.device) for a, t in zip(outer.anchors, tensors)]
        payload = average_tensors_(
            staged,
            lg.group,
            lg.size,
            bucket_cap_bytes=self.config.bucket_cap_bytes,
            pool=self.pool,
            divisor=divisor,
            node=lg.node,
            contribute_zeros=dist.get_rank() in bad,
        )
        for a, s in zip(outer.anchors, staged):
            if a is not s:
                a.copy_(s)
        outer.synced = True
        return payload

    def _reset_lower_anchors(self, level_index: int, tensors: Sequence[torch.Tensor]) -> None:
        """After a round at ``level_index``: the anchors of every lower level with an outer optimizer := ``tensors``."""
        lower = [o for o in self._outer[:level_index] if o is not None and o.anchors is not None]
        if lower:
            local = self._outer_part(tensors)
            for o in lower:
                if o.mismatch(local) is None:
                    o.reset(local)

    def broadcast_from_first_replica(
        self, tensors: Sequence[torch.Tensor], whole: Sequence[torch.Tensor] = ()
    ) -> None:
        """Overwrite ``tensors`` (this rank's shards) and ``whole`` in place with the first replica's.

        Each rank receives ``tensors`` from the rank of its top-level subgroup in replica 0, i.e. the rank
        holding the same shard there (with ``ranks_per_replica=1``, rank 0), and ``whole`` (tensors every
        rank holds whole, e.g. buffers) from the first rank of the process group; see
        :func:`hieravg_optim.replica.broadcast_from_first_replica`. The DeepSpeed and FSDP adapters call it
        at construction, so that every replica starts from the same weights.

        .. warning::
            Collective over the process group: one agreement, then one broadcast per tensor.

        Raises:
            RuntimeError: on every rank, before any broadcast, if the ranks disagree on the tensors' number,
                shapes or dtypes; if a collective fails (a dead or hung peer), naming it and the group's ranks.
        """
        top = self.level_groups[-1]
        replica.broadcast_from_first_replica(
            tensors, whole, top=top, process_group=self.process_group, timeout_s=self._timeout_s(top)
        )

    def average_within_replica(self, tensors: Sequence[torch.Tensor], level_index: int = -1) -> None:
        """Average ``tensors``, held whole by every rank (buffers), over this rank's replica, after a round.

        A round at ``level_index`` averaged them with the same-shard ranks of the other replicas; this
        gives them their mean over the level's whole block. Agreed and named, counted in that level's
        :meth:`metrics` (see :func:`hieravg_optim.replica.average_within_replica`). A no-op with
        ``ranks_per_replica=1``.

        .. warning::
            Collective over this rank's replica.
        """
        if self.config.ranks_per_replica == 1:
            return
        if self._replica_group is None:
            raise RuntimeError("average_within_replica needs the replica's group: pass replica_group= at construction.")
        metrics = self._metrics[level_index]
        start = time.perf_counter()
        what = f"the average within the replica after the round of period {metrics.period}, at step {self.step}"
        payload = replica.average_within_replica(
            tensors, self._replica_group, step=self.step, what=what, bucket_cap_bytes=self.config.bucket_cap_bytes,
            pool=self.pool,
        )
        n = self.config.ranks_per_replica
        metrics.payload_bytes += payload
        metrics.bytes_sent += 2 * (n - 1) * payload // n
        metrics.seconds += time.perf_counter() - start

    def _group_timeout(self) -> timedelta | None:
        """The timeout of groups created here: ``collective_timeout_s``, else that of the process group."""
        if self.config.collective_timeout_s is not None:
            return timedelta(seconds=self.config.collective_timeout_s)
        return process_group_timeout(self.process_group)

    def _timeout_s(self, lg: LevelGroup) -> float | None:
        """The timeout of ``lg``'s group in seconds, for error messages: the configured one, else the group's."""
        if self.config.collective_timeout_s is not None:
            return self.config.collective_timeout_s
        timeout = process_group_timeout(lg.group) if lg.group is not None else None
        return None if timeout is None else timeout.total_seconds()

    def _skip_nonfinite(
        self, lg: LevelGroup, bad: list[int], tensors: Sequence[torch.Tensor], round_name: str, *, anchors: bool
    ) -> int:
        """Apply :attr:`AveragingConfig.nonfinite` to the ranks ``bad`` of ``lg`` whose tensors are non-finite.

        Every rank of the group gets the same ``bad`` (from :func:`check_agreement`), so every rank raises,
        or every rank goes on to the same collective. Returns the number of finite replicas to divide by;
        a non-finite rank then adds zeros to the sum (``average_tensors_(contribute_zeros=True)``). ``anchors``: the round also checked the level's anchors
        (not yet averaged over the group), named in the messages.
        """
        rpr = self.config.ranks_per_replica
        replicas = sorted({dist.get_group_rank(self.process_group, r) // rpr for r in bad})
        named = f"rank{'s' if len(bad) > 1 else ''} {bad} (replica{'s' if len(replicas) > 1 else ''} {replicas})"
        if anchors:
            named = f"{named} (or in the anchors of the outer optimizer, taken there and not yet averaged)"
        finite = lg.size - len(bad)
        if self.config.nonfinite == "raise" or finite == 0:
            cause = (
                "every replica of the group holds non-finite values, so there is no finite replica to average"
                if finite == 0
                else 'averaging would spread them to every replica of the group (nonfinite="raise")'
            )
            raise RuntimeError(
                f"Non-finite values (NaN or infinity) in the tensors of {named} before {round_name}, in the group of "
                f"ranks {list(lg.ranks)}: {cause}. Every rank of the group raises. Lower the learning rate or clip "
                'the gradients, resume from an earlier checkpoint, or pass nonfinite="skip_replica" to average the '
                "finite replicas only and give the others that mean."
            )
        if dist.get_rank() == lg.ranks[0]:
            logger.warning(
                "%s: non-finite values in %s; averaging the %d finite replicas of the group of ranks %s, and giving "
                "the others their mean (nonfinite=\"skip_replica\")",
                round_name,
                named,
                finite,
                list(lg.ranks),
            )
        return finite

    def metrics(self) -> dict[int, dict[str, Any]]:
        """What each level has done on this rank since construction; local, no collective.

        Returns:
            A new dict per call, keyed by period (steps), in level order; each value is
            :class:`LevelMetrics` as a plain dict of ints, floats and ``None``: ``period``,
            ``group_size``, ``subgroup_size``, ``rounds``, ``payload_bytes``, ``bytes_sent``
            (bytes), ``seconds``, ``outer_bytes`` (bytes of fp32 anchors plus outer optimizer state
            held now) and ``pseudo_grad_norm`` (at the level's last round, or ``None``). Example
            for ``{4: 2, 8: 4}`` after 16 steps on 4 ranks
            of float32 parameters of 1,000 elements: ``{4: {"rounds": 2, "payload_bytes": 8000,
            "bytes_sent": 8000, ...}, 8: {"rounds": 2, "payload_bytes": 8000, "bytes_sent": 12000, ...}}``.
        """
        for m, outer in zip(self._metrics, self._outer):
            m.outer_bytes = 0 if outer is None else outer.nbytes()
        return {m.period: asdict(m) for m in self._metrics}

    def state_dict(self) -> dict[str, Any]:
        """The averaging state: the step count and, for checking on resume, the levels and the warm-up.

        With outer optimizers whose anchors are taken, also ``"outer"``: ``{period: {"anchors": [Tensor,
        ...], "optimizer": outer_optimizer.state_dict(), "synced": bool}}``, this rank's fp32 anchors (its
        shards; the tensors themselves, not copies) and outer optimizer state, per level with an outer optimizer.
        """
        state: dict[str, Any] = {
            "step": self.step,
            "levels": [[lv.period, lv.group_size] for lv in self.config.levels],
            "warmup_steps": self.config.warmup_steps,
            "synchronous_warmup": self.config.synchronous_warmup,
        }
        outer = {o.period: o.state_dict() for o in self._outer if o is not None and o.anchors is not None}
        if outer:
            state["outer"] = outer
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
        if not self.has_outer:
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
        local = None if tensors is None else self._outer_part(tensors)
        parsed = {}
        for outer in self._outer:
            if outer is not None and outer.period in by_period:
                parsed[outer.period] = (*outer.check_state(by_period[outer.period], local), local)
        ignored = [p for p in by_period if p not in parsed]
        if ignored:
            warn_at_caller(
                f"The averaging state dict holds anchors and outer optimizer state for period"
                f"{'s' if len(ignored) > 1 else ''} {ignored}, which ha{'ve' if len(ignored) > 1 else 's'} no outer "
                f"optimizer here (outer optimizers at {list(self.outer_periods)}): not loaded."
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
        missing = [o.period for o in self._outer if o is not None and o.period not in parsed]
        for outer in self._outer:
            if outer is not None and outer.period in parsed:
                outer.load(*parsed[outer.period])
        if missing and self.step >= self.config.warmup_steps:
            for outer in self._outer:
                if outer is not None:
                    outer.drop()
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
        self.step = int(step)
        saved = [tuple(x) for x in state.get("levels", [])]
        current = [(lv.period, lv.group_size) for lv in self.config.levels]
        if saved and saved != current:
            warn_at_caller(
                f"Resuming hierarchical averaging at step {self.step} with levels {current}, but the checkpoint "
                f"was saved with levels {saved}. The schedule continues from the saved count with the new levels."
            )
        saved_warmup = state.get("warmup_steps")
        if saved_warmup is not None and saved_warmup != self.config.warmup_steps:
            warn_at_caller(
                f"Resuming hierarchical averaging at step {self.step} with warmup_steps={self.config.warmup_steps}, "
                f"but the checkpoint was saved with warmup_steps={saved_warmup}. The new warm-up applies."
            )
        saved_sync = state.get("synchronous_warmup")
        if saved_sync is not None and bool(saved_sync) != self.config.synchronous_warmup:
            # Warm-up counts average at the top level or not at all: another setting is another schedule.
            warn_at_caller(
                f"Resuming hierarchical averaging at step {self.step} with synchronous_warmup="
                f"{self.config.synchronous_warmup}, but the checkpoint was saved with synchronous_warmup={saved_sync}. "
                "The new setting applies to the remaining warm-up counts; pass the saved value to keep the schedule."
            )
        self._verify_step_pending = True

    def verify_step_if_loaded(self) -> None:
        """After a load, check once that every rank resumed at the same count (collective over the group)."""
        if self._verify_step_pending:
            self._verify_step_pending = False
            # A failed collective here is named by agree_across_ranks (faults.named_collective).
            agree_across_ranks(
                "the averaging step count after load_state_dict (checked at the first step after construction "
                "or loading)",
                self.step,
                self.process_group,
                fix="Load the same checkpoint on every rank (or on none) before stepping.",
            )

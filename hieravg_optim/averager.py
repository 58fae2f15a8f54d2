"""The stateful averager: construction, the step count, the due level and the one step driver.

:class:`HierarchicalAverager` averages a list of tensors when the schedule says so, once per optimizer step;
the wrapper and the adapters drive it (``begin_step``, then ``step_and_average``) as torch's
``PostLocalSGDOptimizer`` drives a ``HierarchicalModelAverager``. A round is :mod:`~hieravg_optim.rounds`; the
outer optimizers, state dict and metrics are base classes from ``anchors``, ``checkpoint`` and ``metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from . import replica
from ._compat import eager_under_compile
from .agreement import agree_across_ranks, raise_on_every_rank
from .anchors import TAKE_ANCHORS, OuterAnchorsMixin, OuterLevels
from .averaging import BucketPool
from .checkpoint import AveragingStateMixin
from .config import AveragingConfig, check_log_metrics_every
from .delayed import DelayedRounds
from .fragments import piece_view
from .groups import LevelGroup, build_level_groups, group_timeout, timed_process_group, timeout_seconds
from .metrics import LevelMetrics, MetricsMixin, bytes_sent
from .nonfinite import repair_skipped_replica_state
from .outer import OuterFactory
from .replica import replica_group_for
from .rounds import average_round, average_round_within_replica
from .schedule import AveragingLevel, level_at
from .tensors import local_tensor

__all__ = [
    "TAKE_ANCHORS",
    "HierarchicalAverager",
    "LevelMetrics",
    "bytes_sent",
    "check_log_metrics_every",
    "local_tensor",
]
# Re-exported for their old import path: TAKE_ANCHORS (anchors), LevelMetrics and bytes_sent
# (metrics), check_log_metrics_every (config), local_tensor (tensors).


# The step driver's methods are eager under compile (_compat.eager_under_compile): under torch.compile (a compiled function calling
# optimizer.step()), Dynamo graph-breaks there and the count, the schedule and the collectives run eagerly,
# never traced (a process group is an opaque object to Dynamo).


class HierarchicalAverager(OuterAnchorsMixin, AveragingStateMixin, MetricsMixin):
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
        # The keywords of 0.1, folded into the config (drop at 0.2): checked there, factories probed once.
        given = {"log_metrics_every": log_metrics_every, "outer_optimizers": outer_optimizers,
                 "outer_state_device": outer_state_device}  # fmt: skip
        given = {k: v for k, v in given.items() if v is not None}
        if not dist.is_available() or not dist.is_initialized():
            config.updated(**given)  # a bad value is named first, as with a process group
            raise RuntimeError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group() "
                "(or launch with torchrun / deepspeed) before creating the averager."
            )
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if dist.get_rank(self.process_group) < 0:
            raise ValueError(
                f"Rank {dist.get_rank()} is not a member of the given process_group: create the averager "
                "only on the ranks of process_group (each rank passes the group it belongs to)."
            )
        self.world_size = dist.get_world_size(self.process_group)
        if agreed:
            config = config.updated(**given) if given else config
        else:
            # Local checks; a failure on some ranks only is raised on every rank by the agreement below.
            error: BaseException | None = None
            value: object = None
            try:
                config = config.updated(**given) if given else config
                config.check_world_size(self.world_size)
                value = config.agreement_value()
            except Exception as exc:  # noqa: BLE001 - any error of the checks (a warning as error too)
                error = exc
            agree_across_ranks("the averaging config", value, self.process_group, error=error)
        self.config = config
        factories, device = config.outer_factories, config.outer_state_device
        self.level_groups: list[LevelGroup] = build_level_groups(config, self.process_group)
        self.timed_process_group: dist.ProcessGroup = timed_process_group(config, self.process_group, self.level_groups)
        """The ranks of :attr:`process_group` with the averaging's timeout (``collective_timeout_s``): the group
        of every collective over all of them after construction; :attr:`process_group` itself without it."""
        # A sharded replica's ranks decide together whether it is finite (one int64 per round).
        timeout = group_timeout(config, self.process_group)
        self._replica_group = replica_group_for(config, self.process_group, timeout, replica_group)
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
        self.log_metrics_every: int | None = config.log_metrics_every
        """Log :meth:`metrics` through ``logging`` at INFO every this many steps (``None``: never)."""
        self.outer_state_device: torch.device | None = device
        """Where anchors and outer optimizer state live; ``None``: each tensor's own device."""
        self._outers = OuterLevels(config.levels, factories, device, config.fragments)
        self._delayed: DelayedRounds | None = (
            DelayedRounds(config, self.process_group, self.level_groups)
            if config.delay_steps or config.fragments
            else None
        )
        """The delayed and fragment rounds (``delay_steps``, ``fragments``); ``None`` with the defaults, whose rounds
        run the synchronous path only."""

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """This rank's replica group (its ``ranks_per_replica`` consecutive ranks), with the averaging's timeout
        (or the one given at construction); ``None`` with one rank per replica."""
        return self._replica_group

    @property
    def levels(self) -> tuple[AveragingLevel, ...]:
        return self.config.levels

    @property
    def warmup_steps(self) -> int:
        return self.config.warmup_steps

    def due_level(self) -> int | None:
        """Index of the level that averages at the current count, or ``None``.

        With :attr:`AveragingConfig.synchronous_warmup`, every warm-up count (below ``warmup_steps``)
        averages at the top level; otherwise :func:`~hieravg_optim.schedule.level_at` decides.
        """
        if self.config.synchronous_warmup and self.step < self.config.warmup_steps:
            return len(self.config.levels) - 1
        return level_at(self.step, self.config.levels, self.config.warmup_steps)

    @eager_under_compile
    def begin_step(self, tensors: Callable[[], Sequence[torch.Tensor]]) -> None:
        """Before the inner step of a wrapper: the checks of the first step after construction or a load.

        Checks once that every rank resumed at the same count (:meth:`verify_step_if_loaded`). With outer
        optimizers, takes the anchors a loaded checkpoint did not hold (:attr:`needs_anchors`): at the first
        step, agreed across the process group, so that a factory failing on some ranks only raises on every
        rank here, not as a hang at the next round; the ranks that need no anchors meet that agreement (the
        same collective).

        .. warning::
            Collective over the process group at the first step after construction or a load.

        Args:
            tensors: Called only when anchors are taken; returns the tensors :meth:`take_anchors` gets.
        """
        first = self._verify_step_pending
        if not first and not self._outers.has_outer:
            return  # every step after the first, without outer optimizers
        self.verify_step_if_loaded()
        if self.needs_anchors:
            self.take_anchors(tensors(), agree=first)
        elif first and self.has_outer:
            self._outers.agree_taken(self.timed_process_group)

    @eager_under_compile
    def step_and_average(
        self,
        tensors: Callable[[], Sequence[torch.Tensor]],
        *,
        check: Callable[[], BaseException | None] | None = None,
        context: Callable[[], Mapping[str, object]] | None = None,
        inner_optimizer: object | None = None,
    ) -> int | None:
        """Average ``tensors()`` if the schedule says so at the current count, then advance the count.

        Call it once per optimizer step, after the inner optimizer has stepped (and, in a wrapper, after
        :meth:`begin_step` before it).

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
            inner_optimizer: The optimizer that stepped, if its state should be repaired when the round gave
                this rank the finite replicas' mean (``nonfinite="skip_replica"``): its NaN and infinities are
                set to 0 (:func:`hieravg_optim.nonfinite.repair_skipped_replica_state`), else the next inner
                step would write them back. Local; :attr:`replaced_at_step` tells the same to other callers.

        Returns:
            The index of the level that averaged, or ``None``.
        """
        self.verify_step_if_loaded()
        count = self.step
        index = self.due_level()
        if self._delayed is not None and self._delayed.handles(count, index):
            index = self._step_delayed(count, tensors, check, context)
        elif index is not None:
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
                raise_on_every_rank(exc, self.timed_process_group, TAKE_ANCHORS)
            self.take_anchors(chosen, agree=True)  # the end of the warm-up
        self.step += 1
        self._log_metrics_if_due()
        if inner_optimizer is not None and self.replaced_at_step == count:
            repair_skipped_replica_state(inner_optimizer, count)
        return index

    def _step_delayed(
        self,
        count: int,
        tensors: Callable[[], Sequence[torch.Tensor]],
        check: Callable[[], BaseException | None] | None,
        context: Callable[[], Mapping[str, object]] | None,
    ) -> int | None:
        """:meth:`step_and_average` at a count with a delayed or fragment round to apply or start.

        First the rounds due at ``count`` are applied (in level order), then the rounds of :meth:`DelayedRounds.plan`
        start (in level order): at a level with neither a delay nor fragments, the synchronous round over its part of
        the tensors. Returns the highest level that applied or started a round, or ``None``.

        If ``tensors``, ``check`` or ``context`` raises, the error is raised on every rank of the group of the first
        round applied at ``count`` (in the agreement before the apply, :meth:`DelayedRounds.apply`), else of the
        first round that starts at ``count`` (in its agreement); no round is applied then.
        """
        delayed = self._delayed
        assert delayed is not None
        chosen: Sequence[torch.Tensor] = []
        extra = None
        try:
            error = None if check is None else check()
            extra = None if context is None else context()
            chosen = list(tensors())
        except Exception as exc:  # noqa: BLE001 - raised below, in the first round's agreement
            error, extra, chosen = exc, None, []
        touched: list[int] = []
        for li in sorted(li for li, r in delayed.in_flight.items() if r.apply_at == count):
            round_ = delayed.in_flight.pop(li)
            delayed.apply(round_, chosen, outers=self._outers, metrics=self._metrics[li], error=error)
            if round_.replaced:
                self.replaced_at_step = count
            touched.append(li)
        if error is not None:
            rounds = [(first, None, ()) for first in delayed.first_level(count)]
            if not rounds:
                raise error
        else:
            rounds = delayed.plan(count, chosen)
        for li, fragment, positions in rounds:
            touched.append(li)
            if not delayed.active(li):
                part = [piece_view(chosen, p) for p in positions]  # the tensors themselves where whole
                self.average(li, part, error=error, context=extra)
                continue
            round_ = delayed.start(
                li, fragment, positions, chosen, count=count, outers=self._outers, metrics=self._metrics[li],
                pool=self.pool, replica_group=self._replica_group, replica_ranks=self._replica_ranks, error=error,
                context=extra,
            )  # fmt: skip
            if round_.apply_at == count:  # the round's agreement was that of its start, just now
                delayed.apply(round_, chosen, outers=self._outers, metrics=self._metrics[li], agree=False)
                if round_.replaced:
                    self.replaced_at_step = count
            else:
                delayed.in_flight[li] = round_
        return max(touched, default=None)

    def _level_index(self, level_index: object) -> int:
        """``level_index`` as an index into :attr:`level_groups` (negative ones count from the top). Local.

        Raises:
            ValueError: for anything but an integer in ``[-L, L)``, ``L`` the number of levels, naming the levels.
        """
        n = len(self.level_groups)
        if isinstance(level_index, bool) or not isinstance(level_index, int) or not -n <= level_index < n:
            periods = [lg.level.period for lg in self.level_groups]
            raise ValueError(
                f"level_index must be an integer from {-n} to {n - 1} (the levels of the periods {periods}, -1 the top "
                f"one), got {level_index!r}."
            )
        return level_index % n

    @eager_under_compile
    def apply_rounds_in_flight(self, tensors: Sequence[torch.Tensor]) -> int:
        """Wait for every delayed round in flight and apply it to ``tensors`` now, before its apply count.

        For the end of training (or before an evaluation on the averaged weights): a round started at count ``t``
        is otherwise applied at ``t + delay_steps`` only. The round is applied as at its count
        (:attr:`AveragingConfig.delay_correction`, :attr:`AveragingConfig.delay_mixing`), the local progress being
        the steps taken since ``t``. Every rank of the process group has the same rounds in flight: call it on
        every rank at the same count (each round's apply starts with a small agreement over its level's group,
        :meth:`DelayedRounds.apply`).

        Args:
            tensors: The tensors the rounds average (as ``step_and_average``'s ``tensors()`` returns them).

        Returns:
            The number of rounds applied (0 without ``delay_steps`` or with none in flight).

        Raises:
            CollectiveError: if a round's collective failed (a dead or hung peer), naming it.
            RuntimeError: on every rank of a round's group, if on some rank ``tensors`` are not those the round
                started with.

        .. warning::
            Collective over the groups of the levels with a round in flight.
        """
        delayed = self._delayed
        if delayed is None:
            return 0
        applied = 0
        for li in sorted(delayed.in_flight):
            round_ = delayed.in_flight.pop(li)
            delayed.apply(round_, list(tensors), outers=self._outers, metrics=self._metrics[li])
            if round_.replaced:
                self.replaced_at_step = self.step
            applied += 1
        return applied

    @eager_under_compile
    def average(
        self,
        level_index: int,
        tensors: Sequence[torch.Tensor],
        *,
        error: BaseException | None = None,
        context: Mapping[str, object] | None = None,
    ) -> bool:
        """Average ``tensors`` in place at level ``level_index`` now, whatever the count.

        ``level_index=-1`` averages at the top level: with ``ranks_per_replica=1``, over
        the whole process group.

        At a level with an outer optimizer whose anchors are taken, the mean gives the pseudo-gradient of one
        outer step instead (see :func:`hieravg_optim.rounds.average_round` for the whole round).

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

        Returns:
            Whether the round gave this rank the finite replicas' mean instead of averaging its tensors
            (``nonfinite="skip_replica"``, this rank's replica non-finite); also recorded in
            :attr:`replaced_at_step`.

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
            ValueError: if ``level_index`` is not the index of a level (before any collective).
            Exception: ``error``, if given.
        """
        level_index = self._level_index(level_index)
        replaced = average_round(
            tensors,
            config=self.config,
            process_group=self.process_group,
            level_index=level_index,
            lg=self.level_groups[level_index],
            step=self.step,
            outers=self._outers,
            metrics=self._metrics[level_index],
            pool=self.pool,
            replica_group=self._replica_group,
            replica_ranks=self._replica_ranks,
            error=error,
            context=context,
        )
        if replaced:
            self.replaced_at_step = self.step
        return replaced

    @eager_under_compile
    def broadcast_from_first_replica(
        self, tensors: Sequence[torch.Tensor], whole: Sequence[torch.Tensor] = ()
    ) -> None:
        """Overwrite ``tensors`` (this rank's shards) and ``whole`` in place with the first replica's.

        ``tensors`` come from the same-shard rank of replica 0 (with ``ranks_per_replica=1``, rank 0), ``whole``
        (held whole by every rank, e.g. buffers) from the first rank of the process group (see
        :func:`hieravg_optim.replica.broadcast_from_first_replica`). The adapters call it at construction.

        .. warning::
            Collective over the process group: one agreement, then one broadcast per tensor.

        Raises:
            RuntimeError: on every rank, before any broadcast, if the ranks disagree on the tensors' number,
                shapes or dtypes; if a collective fails (a dead or hung peer), naming it and the group's ranks.
        """
        top = self.level_groups[-1]
        replica.broadcast_from_first_replica(
            tensors, whole, top=top, process_group=self.timed_process_group,
            timeout_s=timeout_seconds(self.config, top.group),
        )  # fmt: skip

    @eager_under_compile
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
        average_round_within_replica(
            tensors, self._replica_group, config=self.config, step=self.step, metrics=self._metrics[level_index],
            pool=self.pool,
        )  # fmt: skip

    def verify_step_if_loaded(self) -> None:
        """After a load, check once that every rank resumed at the same count (collective over the group)."""
        if self._verify_step_pending:
            self._verify_step_pending = False
            # A failed collective here is named by agree_across_ranks (faults.named_collective).
            agree_across_ranks(
                "the averaging step count after load_state_dict (checked at the first step after construction "
                "or loading)",
                self.step,
                self.timed_process_group,
                fix="Load the same checkpoint on every rank (or on none) before stepping.",
            )

"""Where averaging plugs in: the stateful averager and the optimizer wrapper.

:class:`HierarchicalAverager` holds the step count, the subgroups and the buckets,
and averages a list of tensors when the schedule says so. It is the piece the
DeepSpeed and FSDP adapters drive. :class:`HierarchicalAveragingOptimizer` wraps any
``torch.optim.Optimizer`` with it, like torch's ``PostLocalSGDOptimizer`` wraps a
``HierarchicalModelAverager``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._handover import hand_over
from .averaging import BucketPool, _collective_device, _digest, average_tensors_, check_agreement
from .config import AveragingConfig, _is_int, _warn_at_caller
from .groups import LevelGroup, averaging_subgroup_ranks, build_level_groups
from .schedule import AveragingLevel, level_at

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

__all__ = ["HierarchicalAverager", "HierarchicalAveragingOptimizer", "LevelMetrics", "local_tensor"]

logger = logging.getLogger(__name__)

STATE_KEY = "hierarchical_averaging"
"""Key under which :meth:`HierarchicalAveragingOptimizer.state_dict` stores the averaging state."""


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
    """Averaging rounds run."""
    payload_bytes: int = 0
    """Bytes this rank all-reduced (in the accumulation dtype), summed over rounds."""
    bytes_sent: int = 0
    """Bytes this rank sent, estimated as a ring all-reduce does: ``2 (n - 1) / n`` times the payload."""
    seconds: float = 0.0
    """Wall-clock seconds spent averaging, agreement check included."""


def _check_log_metrics_every(value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"log_metrics_every must be a positive integer number of steps or None, got {value!r}. "
            "Pass e.g. log_metrics_every=100 to log the averaging metrics every 100 steps."
        )


def _agree_across_ranks(
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
    device = _collective_device(group)
    mine = torch.tensor([_digest(value), 0 if error is None else 1], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    hand_over(mine, *everyone)
    dist.all_gather(everyone, mine, group=group)
    failed = [i for i, t in enumerate(everyone) if int(t[1])]
    same = all(int(t[0]) == int(everyone[0][0]) for t in everyone)
    if not failed and same:
        return
    if error is not None and len(failed) == world_size:
        raise error  # every rank failed: each raises its own error, no further collective
    gathered: list = [None] * world_size
    message = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(gathered, (None if error is not None else value, message), group=group)
    if error is not None:
        raise error
    ranks = dist.get_process_group_ranks(group)
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


def _raise_on_every_rank(error: BaseException, process_group: dist.ProcessGroup | None, what: str) -> None:
    """Raise ``error`` here, after letting the other ranks of ``process_group`` raise too (see ``_agree_across_ranks``).

    Without an initialized process group this rank belongs to, it just raises.
    """
    try:
        member = dist.is_available() and dist.is_initialized() and dist.get_rank(process_group) >= 0
    except (RuntimeError, ValueError, TypeError, AttributeError):
        member = False
    if member:
        _agree_across_ranks(what, None, process_group, error=error)
    raise error


_HALF = (torch.float16, torch.bfloat16)

_FSDP_FIX = (
    "Use hieravg_optim.fsdp instead: shard each replica over its own ranks with shard_replica(module, mesh) and "
    "wrap the optimizer with FSDPHierarchicalAveragingOptimizer, which averages each shard only among the ranks "
    "holding that same shard."
)


def _unique_params(param_groups: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, torch.Tensor]]:
    """``(group index, index in group, parameter)`` of each parameter of ``param_groups``, once, in order."""
    seen: set[int] = set()
    out = []
    for g, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((g, i, p))
    return out


def _same_shard_ranks(t: DTensor) -> tuple[list[int], set[int]] | None:
    """The mesh dims that split ``t`` across ranks, and the ranks of its mesh holding the same local tensor.

    ``None`` if this rank is not on ``t``'s mesh. A dim splits ``t`` unless its placement is ``Replicate``
    (``Shard`` and ``Partial`` do): the ranks holding this rank's local tensor are those with this rank's
    coordinate on every splitting dim.
    """
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    split = [d for d, placement in enumerate(t.placements) if not placement.is_replicate()]
    index = tuple(coordinate[d] if d in split else slice(None) for d in range(mesh.ndim))
    return split, {int(r) for r in mesh.mesh[index].flatten().tolist()}


def _check_dtensor_layout(
    params: Sequence[tuple[int, int, torch.Tensor]], subgroups: Sequence[tuple[AveragingLevel, Sequence[int]]]
) -> None:
    """Raise if a DTensor of ``params`` has another shard on a rank of one of this rank's averaging ``subgroups``.

    Local, no collective: a DTensor's mesh tells which ranks hold which shard.

    Raises:
        TypeError: naming the parameter, its mesh dims and placements, the ranks and the fix.
    """
    cache: dict[tuple[int, tuple], tuple[list[int], set[int]] | None] = {}
    for g, i, p in params:
        if not isinstance(p, DTensor):
            continue
        key = (id(p.device_mesh), tuple(p.placements))
        if key not in cache:
            cache[key] = _same_shard_ranks(p)
        layout = cache[key]
        if layout is None or not layout[0]:
            continue
        split, same = layout
        mesh_ranks = {int(r) for r in p.device_mesh.mesh.flatten().tolist()}
        for level, ranks in subgroups:
            others = sorted((mesh_ranks - same) & set(ranks))
            if others:
                names = p.device_mesh.mesh_dim_names
                dims = [f"{d} ({names[d]!r})" if names else str(d) for d in split]
                raise TypeError(
                    f"Parameter param_groups[{g}]['params'][{i}] (global shape {tuple(p.shape)}, local shape "
                    f"{tuple(p.to_local().shape)}) is a DTensor split over mesh dim(s) {', '.join(dims)} with "
                    f"placements {tuple(p.placements)}: ranks {others} hold other shards of it, but they are in "
                    f"rank {dist.get_rank()}'s averaging subgroup {list(ranks)} (period {level.period}, group size "
                    f"{level.group_size}). Averaging local shards there would mix different parts of the parameter. "
                    + _FSDP_FIX
                )


def _own_subgroups(
    config: AveragingConfig, process_group: dist.ProcessGroup | None
) -> list[tuple[AveragingLevel, tuple[int, ...]]]:
    """This rank's averaging subgroup at each level, as global ranks, without creating any group.

    Empty if ``config`` does not fit the process group (the averager then raises) or this rank is not in it.
    """
    pg = process_group if process_group is not None else dist.group.WORLD
    try:
        global_ranks = dist.get_process_group_ranks(pg)
        config.check_world_size(len(global_ranks))
    except (ValueError, RuntimeError):
        return []
    me = dist.get_rank()
    out = []
    for level in config.levels:
        for local in averaging_subgroup_ranks(len(global_ranks), level.group_size, config.ranks_per_replica):
            ranks = tuple(sorted(global_ranks[i] for i in local))
            if me in ranks:
                out.append((level, ranks))
    return out


def _master_copy(optimizer: torch.optim.Optimizer) -> tuple[int, int, torch.Tensor, object] | None:
    """The first optimizer state tensor that looks like an fp32 master copy of a float16 / bfloat16 parameter.

    A master copy: a float32 state tensor of the parameter's shape whose values, rounded to the parameter's
    dtype, equal the parameter right after a step (apex's and Transformer Engine's ``FusedAdam`` with
    ``master_weights=True``). Adam's moments never equal the weights, so they do not match; an all-zero
    parameter is skipped (its moments may be zero too), and so is a one-element parameter (a scalar weight
    of 1.0 would match Adam's ``"step"`` after one step). Costs one rounded copy of each such tensor.

    Returns:
        ``(group index, index in group, parameter, state key)``, or ``None``.
    """
    state = optimizer.state
    for g, i, p in _unique_params(optimizer.param_groups):
        if p.dtype not in _HALF:
            continue
        entries = state.get(p) if hasattr(state, "get") else None
        if not entries:
            continue
        local = local_tensor(p)
        if p.numel() < 2 or local.numel() == 0 or not bool(local.any()):
            continue
        for key, value in entries.items():
            if not torch.is_tensor(value) or value.dtype != torch.float32 or value.shape != p.shape:
                continue
            value = local_tensor(value)
            if value.shape == local.shape and value.to(device=local.device, dtype=local.dtype).equal(local):
                return g, i, p, key
    return None


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
        log_metrics_every: Log :meth:`metrics` through this module's logger at INFO every
            this many steps (at step counts that are multiples of it); ``None`` never logs.

    Raises:
        ValueError: from :meth:`AveragingConfig.check_world_size`, or for a ``log_metrics_every``
            that is not a positive integer, on every rank, before any collective.
        RuntimeError: if the ranks were given different configs, or another rank's config failed these
            checks (that rank raises the ValueError; the others a RuntimeError naming it, never a hang).
    """

    def __init__(
        self,
        config: AveragingConfig,
        process_group: dist.ProcessGroup | None = None,
        *,
        log_metrics_every: int | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            _check_log_metrics_every(log_metrics_every)  # a bad value is named first, as with a process group
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
        # Local checks; a failure on some ranks only is raised on every rank by the agreement below.
        error: BaseException | None = None
        try:
            _check_log_metrics_every(log_metrics_every)
            config.check_world_size(self.world_size)
        except ValueError as exc:
            error = exc
        _agree_across_ranks("the averaging config", asdict(config), self.process_group, error=error)
        self.level_groups: list[LevelGroup] = build_level_groups(config, self.process_group)
        self.step = 0
        """The averaging step count: optimizer steps taken so far (``HierarchicalModelAverager.step``)."""
        self.pool = BucketPool()
        self._metrics = [
            LevelMetrics(period=lg.level.period, group_size=lg.level.group_size, subgroup_size=lg.size)
            for lg in self.level_groups
        ]
        # The first step checks that every rank starts at the same count: a checkpoint loaded on some
        # ranks only is then a RuntimeError there, not a collective mismatch.
        self._verify_step_pending = True
        self.log_metrics_every: int | None = log_metrics_every
        """Log :meth:`metrics` through ``logging`` at INFO every this many steps (``None``: never)."""

    @property
    def levels(self) -> tuple[AveragingLevel, ...]:
        return self.config.levels

    @property
    def warmup_steps(self) -> int:
        return self.config.warmup_steps

    def due_level(self) -> int | None:
        """Index of the level that averages at the current count, or ``None``."""
        return level_at(self.step, self.config.levels, self.config.warmup_steps)

    def step_and_average(
        self,
        tensors: Callable[[], Sequence[torch.Tensor]],
        *,
        check: Callable[[], BaseException | None] | None = None,
    ) -> int | None:
        """Average ``tensors()`` if the schedule says so at the current count, then advance the count.

        Call it once per optimizer step, after the inner optimizer has stepped.

        Args:
            tensors: Called only when averaging is due; returns the tensors to average in place.
            check: Called only when averaging is due, before ``tensors()``; returns the error of a
                local check that failed (or ``None``), raised on every rank of the subgroup by
                :meth:`average` before any averaging collective.

        Returns:
            The index of the level that averaged, or ``None``.
        """
        self.verify_step_if_loaded()
        index = self.due_level()
        if index is not None:
            error = None if check is None else check()
            self.average(index, tensors(), error=error)
        self.step += 1
        if self.log_metrics_every and self.step % self.log_metrics_every == 0:
            logger.info("hierarchical averaging at step %d: %s", self.step, self.metrics())
        return index

    def average(
        self, level_index: int, tensors: Sequence[torch.Tensor], *, error: BaseException | None = None
    ) -> None:
        """Average ``tensors`` in place at level ``level_index`` now, whatever the count.

        ``level_index=-1`` averages at the top level: with ``ranks_per_replica=1``, over
        the whole process group.

        .. warning::
            Collective over this rank's subgroup at that level.

        Args:
            level_index: Index of the level in :attr:`levels`; -1 for the top level.
            tensors: The tensors to average in place.
            error: A local check of this rank that failed: raised here instead of averaging, and as
                a ``RuntimeError`` on the other ranks of the subgroup, in the agreement collective.

        Raises:
            RuntimeError: if the ranks of the subgroup disagree on the tensors, or another rank passed
                an ``error`` (see :func:`hieravg_optim.averaging.check_agreement`).
            Exception: ``error``, if given.
        """
        lg = self.level_groups[level_index]
        metrics = self._metrics[level_index]
        if lg.group is None:
            if error is not None:
                raise error
            metrics.rounds += 1
            return
        start = time.perf_counter()
        check_agreement(
            tensors,
            lg.group,
            lg.ranks,
            context={"step count": self.step, "bucket_cap_mb": self.config.bucket_cap_mb},
            what=f"the parameters to average at step {self.step} (period {lg.level.period}, group size "
            f"{lg.level.group_size})",
            error=error,
        )
        with torch.no_grad():
            payload = average_tensors_(
                tensors, lg.group, lg.size, bucket_cap_bytes=self.config.bucket_cap_bytes, pool=self.pool
            )
        metrics.rounds += 1
        metrics.payload_bytes += payload
        metrics.bytes_sent += 2 * (lg.size - 1) * payload // lg.size
        metrics.seconds += time.perf_counter() - start

    def metrics(self) -> dict[int, dict[str, Any]]:
        """What each level has done on this rank since construction; local, no collective.

        Returns:
            A new dict per call, keyed by period (steps), in level order; each value is
            :class:`LevelMetrics` as a plain dict of ints and one float: ``period``,
            ``group_size``, ``subgroup_size``, ``rounds``, ``payload_bytes``, ``bytes_sent``
            (bytes) and ``seconds``. Example for ``{4: 2, 8: 4}`` after 16 steps on 4 ranks
            of float32 parameters of 1,000 elements: ``{4: {"rounds": 2, "payload_bytes": 8000,
            "bytes_sent": 8000, ...}, 8: {"rounds": 2, "payload_bytes": 8000, "bytes_sent": 12000, ...}}``.
        """
        return {m.period: asdict(m) for m in self._metrics}

    def state_dict(self) -> dict[str, Any]:
        """The averaging state: the step count and, for checking on resume, the levels."""
        return {
            "step": self.step,
            "levels": [[lv.period, lv.group_size] for lv in self.config.levels],
            "warmup_steps": self.config.warmup_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. The count is checked across ranks at the next step.

        Raises:
            ValueError: if ``state`` has no ``"step"``, or it is not a non-negative integer (a float,
                a string, ``None``: never silently truncated or reset).
        """
        if not isinstance(state, Mapping) or "step" not in state:
            raise ValueError(
                f"The averaging state must be a mapping with the averaging step count under 'step', as "
                f"HierarchicalAverager.state_dict() returns, got {state!r}."
            )
        step = state["step"]
        if torch.is_tensor(step) and step.numel() == 1 and not step.is_floating_point():
            step = int(step)
        if not _is_int(step) or step < 0:
            raise ValueError(
                f"The averaging step count 'step' in the state dict must be a non-negative integer (optimizer "
                f"steps), got {step!r} ({type(step).__name__}). Load the state dict this library or torch's "
                "PostLocalSGDOptimizer saved."
            )
        self.step = int(step)
        saved = [tuple(x) for x in state.get("levels", [])]
        current = [(lv.period, lv.group_size) for lv in self.config.levels]
        if saved and saved != current:
            _warn_at_caller(
                f"Resuming hierarchical averaging at step {self.step} with levels {current}, but the checkpoint "
                f"was saved with levels {saved}. The schedule continues from the saved count with the new levels."
            )
        saved_warmup = state.get("warmup_steps")
        if saved_warmup is not None and saved_warmup != self.config.warmup_steps:
            _warn_at_caller(
                f"Resuming hierarchical averaging at step {self.step} with warmup_steps={self.config.warmup_steps}, "
                f"but the checkpoint was saved with warmup_steps={saved_warmup}. The new warm-up applies."
            )
        self._verify_step_pending = True

    def verify_step_if_loaded(self) -> None:
        """After a load, check once that every rank resumed at the same count (collective over the group)."""
        if self._verify_step_pending:
            self._verify_step_pending = False
            _agree_across_ranks(
                "the averaging step count after load_state_dict (checked at the first step after construction "
                "or loading)",
                self.step,
                self.process_group,
                fix="Load the same checkpoint on every rank (or on none) before stepping.",
            )

    def _check_same_across_ranks(self, what: str, value: object) -> None:
        _agree_across_ranks(what, value, self.process_group)


class HierarchicalAveragingOptimizer(torch.optim.Optimizer):
    """Wraps any optimizer and averages the parameters hierarchically after its steps.

    Each :meth:`step` runs the inner step; then, from ``warmup_steps`` on, when the
    step count is divisible by one or more periods, the subgroup of the largest such
    period averages the parameters in place (hierarchical SGD,
    https://arxiv.org/abs/2010.12998, which generalises post-local SGD,
    https://arxiv.org/abs/1808.07217). Arguments, schedule and errors follow torch's
    ``HierarchicalModelAverager`` and ``PostLocalSGDOptimizer``; unlike them, it

    * writes the averages into each parameter's own storage (views into flat
      buffers stay views) through reusable buckets of ``bucket_cap_mb`` MB instead
      of one model-sized buffer;
    * averages every parameter of ``param_groups`` whatever its ``.grad`` (torch
      skips parameters whose ``.grad`` is ``None``, which can differ across ranks
      and hang), and checks that the ranks agree on shapes and dtypes first;
    * averages sharded parameters (DTensor local shards, ZeRO partitions, FSDP flat
      parameters) among the ranks that hold the same shard.

    Which tensors are averaged: every parameter in the inner optimizer's
    ``param_groups`` (each once, in order; a DTensor by its local shard), then the
    floating-point tensors of ``buffers``. Optimizer state (momentum, Adam moments)
    is not averaged, as in torch. The averaged tensors must be the same tensor on every
    rank of an averaging group, and the ones the next step reads:

    * the parameters are those of ``param_groups`` at construction, plus those added
      through this wrapper's :meth:`add_param_group`. If ``param_groups`` later holds
      other tensors (e.g. DeepSpeed took this wrapper as its client optimizer and put
      its flat ZeRO partitions there), the next averaging round raises instead.
      Rebinding ``param_groups`` behind the wrapper is not supported;
      ``load_state_dict`` keeps the parameters and is fine;
    * a DTensor split (``Shard``, ``Partial``) over ranks of this rank's averaging
      subgroup is a ``TypeError`` at construction: use :mod:`hieravg_optim.fsdp`;
    * an inner optimizer that keeps fp32 master copies of low-precision parameters and
      writes the parameters from them at each step (apex / Transformer Engine
      ``FusedAdam(master_weights=True)``) must be given ``tensors_to_average`` naming the
      masters; the first averaging round raises a ``ValueError`` where it finds such a
      copy in the optimizer state without it.

    .. warning::
        The constructor is collective over ``process_group`` (it creates the
        subgroups). :meth:`step` is collective over the averaging subgroup when
        averaging is due: every rank must call it the same number of times.

    Args:
        optimizer: The inner (local) optimizer.
        period_group_size_dict: ``{period: group_size}``: every ``period`` steps, blocks of
            ``group_size`` consecutive ranks average. Periods strictly increasing; the last
            group size is the size of ``process_group``. Example: ``{4: 8, 32: 32}``.
        warmup_steps: Steps (counts ``0 .. warmup_steps - 1``) that never average.
        process_group: The overall group; ``None`` means the default group.
        ranks_per_replica: Consecutive ranks that together hold one (possibly sharded)
            replica; a level then averages among the ranks of its block with the same
            shard index. 1 for full parameters (plain PyTorch, DDP).
        bucket_cap_mb: Bucket size, in MB (10**6 bytes).
        buffers: Tensors averaged on the same schedule, e.g. ``model.buffers()``
            (BatchNorm running statistics); non-floating ones are left untouched.
        log_metrics_every: Log :meth:`metrics` at INFO through the ``hieravg_optim.optimizer``
            logger every this many steps; ``None`` (default) never logs.
        tensors_to_average: Called at each averaging round, after the inner step; returns the
            tensors to average in place instead of the parameters (``buffers`` are still
            averaged after them), the same number, shapes and dtypes on every rank. For an inner
            optimizer with fp32 master weights: the masters, which the next step reads, e.g.
            ``lambda: [inner.state[p]["master_param"] for p in params]``. ``None`` (default):
            the parameters of ``param_groups``.

    Raises:
        ValueError: for an invalid setting, naming it, before any averaging collective; at the
            first averaging round, on every rank, for an fp32 master copy of a float16 / bfloat16
            parameter in the optimizer state without ``tensors_to_average``.
        TypeError: if ``optimizer`` has no ``param_groups`` or ``step``, or is already wrapped; if
            ``tensors_to_average`` is not callable; for a DTensor parameter split over ranks of this
            rank's averaging subgroup.
        RuntimeError: if the ranks were given different settings, or another rank's settings were
            invalid (that rank raises the ValueError or TypeError; the others, in the constructor's
            one agreement collective, a RuntimeError naming it, instead of waiting for it); at an
            averaging round, on every rank of the subgroup, if ``param_groups`` holds tensors this
            wrapper was not given.

    Example::

        >>> opt = HierarchicalAveragingOptimizer(
        ...     torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...     period_group_size_dict={4: 2, 16: dist.get_world_size()},
        ...     warmup_steps=100,
        ... )
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        period_group_size_dict: Mapping[int, int] | Iterable[AveragingLevel],
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        ranks_per_replica: int = 1,
        bucket_cap_mb: float = 25.0,
        buffers: Iterable[torch.Tensor] | None = None,
        log_metrics_every: int | None = None,
        tensors_to_average: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        try:
            if isinstance(optimizer, HierarchicalAveragingOptimizer):
                raise TypeError("optimizer is already a HierarchicalAveragingOptimizer: wrap the inner optimizer once.")
            if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer (with param_groups and step()), "
                    f"got {type(optimizer).__name__}."
                )
            config = AveragingConfig.create(
                period_group_size_dict,
                warmup_steps=warmup_steps,
                ranks_per_replica=ranks_per_replica,
                bucket_cap_mb=bucket_cap_mb,
            )
            if isinstance(buffers, torch.Tensor):
                raise TypeError("buffers must be an iterable of tensors, e.g. model.buffers(), got a single Tensor.")
            _check_log_metrics_every(log_metrics_every)
            if tensors_to_average is not None and not callable(tensors_to_average):
                raise TypeError(
                    f"tensors_to_average must be a function returning the tensors to average, got "
                    f"{type(tensors_to_average).__name__}: pass e.g. lambda: [...], so that tensors the inner "
                    "optimizer creates at its first step (fp32 master weights) are looked up at each round."
                )
            params = _unique_params(optimizer.param_groups)
            if dist.is_available() and dist.is_initialized():
                _check_dtensor_layout(params, _own_subgroups(config, process_group))
        except (TypeError, ValueError) as exc:
            # Raised here; the other ranks of process_group raise a RuntimeError naming this rank
            # (in the agreement they are about to enter) instead of waiting for it.
            _raise_on_every_rank(exc, process_group, "the averaging config")
        self.optimizer = optimizer
        self.buffers = [b for b in (() if buffers is None else buffers) if b.is_floating_point()]
        self._tensors_fn = tensors_to_average
        # The parameters this wrapper averages, by identity (the references keep the ids unique).
        self._given: dict[int, torch.Tensor] = {id(p): p for _, _, p in params}
        self._masters_checked = tensors_to_average is not None
        # torch.optim.Optimizer's own bookkeeping, without its __init__ (which would assign
        # param_groups, state and defaults, i.e. the inner optimizer's, through the properties below):
        # register_step_pre_hook() and the other hook registrations of the base class work.
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self.averager = HierarchicalAverager(config, process_group, log_metrics_every=log_metrics_every)

    # -- the inner optimizer's state, read and assigned through --------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def averaging_step(self) -> int:
        """The averaging step count (torch's ``averager.step``): steps taken so far."""
        return self.averager.step

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"{type(self).__name__} holds process groups and cannot be pickled or deep-copied. "
            "Save optimizer.state_dict() instead and restore it with load_state_dict() on a new wrapper."
        )

    def __repr__(self) -> str:
        levels = {lv.period: lv.group_size for lv in self.averager.levels}
        return (
            f"{type(self).__name__}(levels={levels}, warmup_steps={self.averager.warmup_steps}, "
            f"ranks_per_replica={self.averager.config.ranks_per_replica}, inner={self.optimizer!r})"
        )

    # -- optimizer API ------------------------------------------------------------------------------
    def tensors_to_average(self) -> list[torch.Tensor]:
        """This rank's tensors to average, in order: the parameters of ``param_groups``, then the buffers.

        With the constructor's ``tensors_to_average``, the tensors it returns instead of the
        parameters. The list is the same on every rank whose model and parameter groups are
        built the same way; it never depends on ``.grad``.
        """
        if self._tensors_fn is not None:
            return [local_tensor(t) for t in self._tensors_fn()] + [local_tensor(b) for b in self.buffers]
        seen: set[int] = set()
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(local_tensor(p))
        out.extend(local_tensor(b) for b in self.buffers)
        return out

    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """Run the inner step, then average if the schedule says so; return the closure's loss.

        Hooks registered on this wrapper with ``register_step_pre_hook`` /
        ``register_step_post_hook`` run around the whole step (inner step and averaging),
        as ``torch.optim.Optimizer`` runs them; global optimizer hooks run once, for the
        inner optimizer's step.

        .. warning::
            Collective over the averaging subgroup when averaging is due.
        """
        args: tuple = (self,) if closure is None else (self, closure)
        kwargs: dict[str, Any] = {}
        for pre_hook in list(self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if isinstance(result, tuple) and len(result) == 2:
                    args, kwargs = result
                else:
                    raise RuntimeError(
                        f"A step pre-hook must return None or a tuple (new_args, new_kwargs), got {result!r}."
                    )
        loss = self._step(*args[1:], **kwargs)
        for post_hook in list(self._optimizer_step_post_hooks.values()):
            post_hook(self, args, kwargs)
        return loss

    def _step(self, closure: Callable[[], float] | None = None):
        self.averager.verify_step_if_loaded()
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.averager.step_and_average(self.tensors_to_average, check=self._round_error)
        return loss

    def _round_error(self) -> BaseException | None:
        """Local checks of an averaging round, raised on every rank of the subgroup by the round's agreement.

        Each round: one dict lookup per parameter (``param_groups`` holds the parameters this wrapper
        was given). The first round also looks for fp32 master copies in the optimizer state.
        """
        if self._tensors_fn is not None:
            return None
        given = self._given
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in given:
                    flat = (
                        " A 1-D tensor there is the flat fp32 partition of a DeepSpeed ZeRO / BF16 optimizer "
                        "that took this wrapper as its client optimizer: it holds a different part of the model "
                        "on each rank. Pass the inner optimizer to hieravg_optim.deepspeed.initialize with a "
                        '"hierarchical_averaging" section instead; the section does the averaging.'
                        if p.dim() == 1
                        else ""
                    )
                    return RuntimeError(
                        f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}, dtype {p.dtype}) is not one of "
                        f"the {len(given)} parameters this {type(self).__name__} was constructed over or given "
                        f"through its add_param_group: something rebound the inner optimizer's param_groups "
                        f"behind the wrapper, so averaging them may mix different tensors across ranks.{flat} "
                        "Otherwise add parameter groups through the wrapper's add_param_group, never to the "
                        "inner optimizer or by assigning param_groups."
                    )
        if not self._masters_checked:
            self._masters_checked = True
            found = _master_copy(self.optimizer)
            if found is not None:
                g, i, p, key = found
                return ValueError(
                    f"The inner optimizer {type(self.optimizer).__name__} keeps an fp32 copy of parameter "
                    f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}, dtype {p.dtype}) in its state "
                    f"under {key!r}, equal to the parameter after the step: a master weight, from which its next "
                    "step writes the parameter. Averaging the parameter would be undone by that step. Pass "
                    "tensors_to_average=lambda: [...] returning the master copies (e.g. "
                    f"[inner.state[p][{key!r}] for p in params]) to {type(self).__name__}. (If that state "
                    "tensor is not a master weight, pass tensors_to_average returning the parameters.)"
                )
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer. Every rank must add the same group (shapes, dtypes).

        Raises:
            TypeError: for a DTensor parameter split over ranks of this rank's averaging subgroup
                (the group is then not added); on every rank, as the layout is the same on all.
        """
        before = len(self.optimizer.param_groups)
        self.optimizer.add_param_group(param_group)
        added = [(g, i, p) for g, i, p in _unique_params(self.optimizer.param_groups) if g >= before]
        try:
            _check_dtensor_layout(added, [(lg.level, lg.ranks) for lg in self.averager.level_groups])
        except TypeError:
            del self.optimizer.param_groups[before:]
            raise
        self._given.update((id(p), p) for _, _, p in added)

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per level, keyed by period: rounds, bytes and seconds; see :class:`LevelMetrics`."""
        return self.averager.metrics()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus the averaging state.

        The averaging state is under ``"hierarchical_averaging"``; the count is also
        written as the top-level ``"step"``, as torch's ``PostLocalSGDOptimizer`` does,
        so either wrapper can load the other's checkpoints.
        """
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        state = self.optimizer.state_dict()
        state[STATE_KEY] = self.averager.state_dict()
        state["step"] = self.averager.step
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, or a state dict of torch's ``PostLocalSGDOptimizer``.

        With no step count in it: a warning, and the count starts at 0 (as torch does).
        Every rank must then call :meth:`step`: the first one checks that all ranks
        resumed at the same count.
        """
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        inner = dict(state_dict)
        ours = inner.pop(STATE_KEY, None)
        torch_step = inner.pop("step", None)
        # The averaging state is checked first, and restored if the inner optimizer rejects its part:
        # a rejected state dict changes neither the inner optimizer nor the count.
        previous = (self.averager.step, self.averager._verify_step_pending)
        if ours is not None:
            self.averager.load_state_dict(ours)
        elif torch_step is not None:
            self.averager.load_state_dict({"step": torch_step})
        try:
            self.optimizer.load_state_dict(inner)
        except BaseException:
            self.averager.step, self.averager._verify_step_pending = previous
            raise
        if ours is None and torch_step is None:
            _warn_at_caller(
                "Loaded state dict does not contain a step counter for the averager. Setting step counter to 0."
            )
            self.averager.load_state_dict({"step": 0})
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)

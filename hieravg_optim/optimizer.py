"""Where averaging plugs in: the stateful averager and the optimizer wrapper.

:class:`HierarchicalAverager` holds the step count, the subgroups and the buckets,
and averages a list of tensors when the schedule says so. It is the piece the
DeepSpeed and FSDP adapters drive. :class:`HierarchicalAveragingOptimizer` wraps any
``torch.optim.Optimizer`` with it, like torch's ``PostLocalSGDOptimizer`` wraps a
``HierarchicalModelAverager``.
"""

from __future__ import annotations

import logging
import sys
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
from .groups import LevelGroup, build_level_groups
from .schedule import AveragingLevel, level_at

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

__all__ = ["HierarchicalAverager", "HierarchicalAveragingOptimizer", "LevelMetrics", "local_tensor"]

logger = logging.getLogger(__name__)

STATE_KEY = "hierarchical_averaging"
"""Key under which :meth:`HierarchicalAveragingOptimizer.state_dict` stores the averaging state."""

GROUP_STEP_KEY = "hierarchical_averaging_step"
"""Key under which :meth:`HierarchicalAveragingOptimizer.state_dict` also writes the count into every
parameter group: torch's optimizer-state helpers (DCP's ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``, FSDP1's ``optim_state_dict`` / ``optim_state_dict_to_load``) keep only
``"state"`` and ``"param_groups"``, and keep a group's extra keys."""

_TORCH_STATE_INIT = ("_init_optim_state", "torch.distributed.checkpoint.state_dict")
"""torch's function that fills an empty optimizer state by calling ``step(closure=None)`` with zero
gradients and lr 0 (``get_optimizer_state_dict``, ``set_optimizer_state_dict``, ``get_state_dict``, ...)."""


def _called_by_torch_state_init(max_depth: int = 4) -> bool:
    """Whether torch's state-initialising function is among the ``max_depth`` frames above the caller.

    Matched by function name and module (not by code object), so a moved import still matches; the
    LR schedulers' patched ``step`` may sit in between. If torch ever fills the state another way,
    :meth:`HierarchicalAveragingOptimizer.initialize_state` before the first save does the same explicitly.
    """
    frame = sys._getframe(2)
    name, module = _TORCH_STATE_INIT
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code.co_name == name and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


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

    def step_and_average(self, tensors: Callable[[], Sequence[torch.Tensor]]) -> int | None:
        """Average ``tensors()`` if the schedule says so at the current count, then advance the count.

        Call it once per optimizer step, after the inner optimizer has stepped.

        Args:
            tensors: Called only when averaging is due; returns the tensors to average in place.

        Returns:
            The index of the level that averaged, or ``None``.
        """
        self.verify_step_if_loaded()
        index = self.due_level()
        if index is not None:
            self.average(index, tensors())
        self.step += 1
        if self.log_metrics_every and self.step % self.log_metrics_every == 0:
            logger.info("hierarchical averaging at step %d: %s", self.step, self.metrics())
        return index

    def average(self, level_index: int, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` in place at level ``level_index`` now, whatever the count.

        ``level_index=-1`` averages at the top level: with ``ranks_per_replica=1``, over
        the whole process group.

        .. warning::
            Collective over this rank's subgroup at that level.

        Raises:
            RuntimeError: if the ranks of the subgroup disagree on the tensors (see
                :func:`hieravg_optim.averaging.check_agreement`).
        """
        lg = self.level_groups[level_index]
        metrics = self._metrics[level_index]
        if lg.group is None:
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
    is not averaged, as in torch.

    Mixed precision: with ``torch.amp.GradScaler``, call ``scaler.step(opt)`` as for any
    optimizer. The wrapper sets ``_step_supports_amp_scaling``, so the scaler always calls
    :meth:`step` and hands it ``grad_scale`` and ``found_inf``: the count advances on every
    rank (averaging stays in step across ranks), and the inner step runs only where no
    inf/NaN gradient was found, on gradients unscaled as ``GradScaler.unscale_`` does (an
    inner optimizer that supports amp scaling itself, e.g. a fused Adam, gets both values
    and decides). A skipped inner step counts, as in the DeepSpeed adapter.

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

    Raises:
        ValueError: for an invalid setting, naming it, before any averaging collective.
        TypeError: if ``optimizer`` has no ``param_groups`` or ``step``, or is already wrapped.
        RuntimeError: if the ranks were given different settings, or another rank's settings were
            invalid (that rank raises the ValueError or TypeError; the others, in the constructor's
            one agreement collective, a RuntimeError naming it, instead of waiting for it).

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

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler.step`` then calls :meth:`step` on every rank, with ``grad_scale`` and ``found_inf``."""

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
        except (TypeError, ValueError) as exc:
            # Raised here; the other ranks of process_group raise a RuntimeError naming this rank
            # (in the agreement they are about to enter) instead of waiting for it.
            _raise_on_every_rank(exc, process_group, "the averaging config")
        self.optimizer = optimizer
        self.buffers = [b for b in (() if buffers is None else buffers) if b.is_floating_point()]
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
        """The averaging step count (torch's ``averager.step``): steps taken so far.

        Assigning it sets the count deliberately (e.g. after loading a plain inner-optimizer
        state dict into :attr:`optimizer`); the next :meth:`step` checks that every rank has
        the same count. A value that is not a non-negative integer is a ``ValueError``.
        """
        return self.averager.step

    @averaging_step.setter
    def averaging_step(self, value: int) -> None:
        self.averager.load_state_dict({"step": value})

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

        The list is the same on every rank whose model and parameter groups are built
        the same way; it never depends on ``.grad``.
        """
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

        Under ``torch.amp.GradScaler`` (which calls this method itself and sets ``grad_scale``
        and ``found_inf`` on the wrapper, see the class docstring) the count always advances;
        the inner step runs only if ``found_inf`` is 0 on this rank.

        The call torch's ``torch.distributed.checkpoint.state_dict`` helpers make to fill an
        empty optimizer state (``step(closure=None)`` with zero gradients and lr 0) is
        recognised, and runs :meth:`initialize_state` instead: no count, no averaging, no hooks.

        .. warning::
            Collective over the averaging subgroup when averaging is due.
        """
        if closure is None and not self.optimizer.state and _called_by_torch_state_init():
            self._initialize_state_step()
            return None
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
        self._drop_initialized_state()
        loss = self._inner_step(closure)
        self.averager.step_and_average(self.tensors_to_average)
        return loss

    def _inner_step(self, closure: Callable[[], float] | None):
        """The inner step, or none when a ``GradScaler`` found inf/NaN gradients on this rank."""
        inner = self.optimizer
        args = () if closure is None else (closure,)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is None and found_inf is None:
            return inner.step(*args)
        if getattr(inner, "_step_supports_amp_scaling", False):
            # A fused optimizer unscales and skips by itself (GradScaler's protocol, one level down).
            inner.grad_scale, inner.found_inf = grad_scale, found_inf
            try:
                return inner.step(*args)
            finally:
                del inner.grad_scale, inner.found_inf
        if found_inf is not None and bool(found_inf.item()):
            return None  # what GradScaler does for an optimizer without amp support: skip its step
        if grad_scale is not None:  # None: the user already called scaler.unscale_(opt)
            self._unscale_grads(grad_scale)
        return inner.step(*args)

    def _unscale_grads(self, grad_scale: torch.Tensor) -> None:
        """Divide the gradients by ``grad_scale`` in place, with the arithmetic of ``GradScaler.unscale_``."""
        inv_scale = grad_scale.double().reciprocal().float()
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        p.grad = grad = grad.coalesce()
                    grad = grad._values()
                by_device.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in by_device.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))

    def initialize_state(self) -> None:
        """Create the inner optimizer's state (Adam moments, momentum buffers) without a step.

        Does what torch's DCP helpers do to an optimizer with no state yet (a step with zero
        gradients and lr 0), with weight decay 0 too, then sets every ``"step"`` entry of the
        new state back to 0; the count does not advance and nothing is averaged. The next real
        :meth:`step` drops the state made here (unless a state dict was loaded since), so the
        inner optimizer then behaves as a fresh one, bit for bit. Local, no collective; a no-op
        if the inner optimizer already has state.

        :meth:`step` recognises torch's own initialising call (``get_optimizer_state_dict``,
        ``set_optimizer_state_dict``, ``get_state_dict``) and runs this instead; call it
        explicitly before a save that initialises the state some other way.
        """
        inner = self.optimizer
        if inner.state:
            return
        params = [p for group in inner.param_groups for p in group["params"] if p.requires_grad]
        grads = [p.grad for p in params]
        lrs = [group.get("lr") for group in inner.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in inner.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
        try:
            self._initialize_state_step()
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad
            for group, lr in zip(inner.param_groups, lrs):
                if lr is not None:
                    group["lr"] = lr

    def _initialize_state_step(self) -> None:
        """The inner step with weight decay 0 (lr and gradients already 0), then the new "step" entries reset."""
        inner = self.optimizer
        decays = [group.get("weight_decay") for group in inner.param_groups]
        for group in inner.param_groups:
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        try:
            inner.step()
        finally:
            for group, decay in zip(inner.param_groups, decays):
                if decay is not None:
                    group["weight_decay"] = decay
        for entry in inner.state.values():
            step = entry.get("step") if isinstance(entry, dict) else None
            if torch.is_tensor(step):
                step.zero_()
            elif _is_int(step) or isinstance(step, float):
                entry["step"] = type(step)(0)
        self._initialized_state = (inner.state, {id(p): entry for p, entry in inner.state.items()})

    def _drop_initialized_state(self) -> None:
        """Before a real step: drop the state :meth:`initialize_state` made if nothing replaced it since."""
        made = self.__dict__.pop("_initialized_state", None)
        if made is None:
            return
        container, entries = made
        if self.optimizer.state is container:
            for p in [p for p, entry in container.items() if entries.get(id(p)) is entry]:
                del container[p]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer. Every rank must add the same group (shapes, dtypes)."""
        self.optimizer.add_param_group(param_group)

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per level, keyed by period: rounds, bytes and seconds; see :class:`LevelMetrics`."""
        return self.averager.metrics()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus the averaging state.

        The averaging state is under ``"hierarchical_averaging"``; the count is also
        written as the top-level ``"step"``, as torch's ``PostLocalSGDOptimizer`` does,
        so either wrapper can load the other's checkpoints, and into every parameter group
        under ``"hierarchical_averaging_step"``, which torch's optimizer-state helpers
        (DCP's ``get_optimizer_state_dict``, FSDP1's ``optim_state_dict``) keep.
        """
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        state = self.optimizer.state_dict()
        state[STATE_KEY] = self.averager.state_dict()
        state["step"] = self.averager.step
        state["param_groups"] = [{**group, GROUP_STEP_KEY: self.averager.step} for group in state["param_groups"]]
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], *, averaging_step: int | None = None) -> None:
        """Restore :meth:`state_dict`'s output, or a state dict of torch's ``PostLocalSGDOptimizer``.

        The count is read from ``"hierarchical_averaging"``, else the top-level ``"step"``
        (torch's format), else the ``"hierarchical_averaging_step"`` of the parameter groups (all
        groups must agree), so it survives DCP's ``get_optimizer_state_dict`` ->
        ``set_optimizer_state_dict`` and FSDP1's ``optim_state_dict`` -> ``optim_state_dict_to_load``,
        which keep only ``"state"`` and ``"param_groups"``. A state dict with no count is an error,
        never a silent restart of the schedule. Every rank must then call :meth:`step`: the first
        one checks that all ranks resumed at the same count.

        Args:
            state_dict: The state dict.
            averaging_step: The count to resume at, for a state dict that has none (e.g. a plain
                inner-optimizer state dict): ``0`` restarts the schedule on purpose. If the state
                dict has a count too, the two must be equal.

        Raises:
            ValueError: if the state dict has no count and ``averaging_step`` is ``None``, the
                parameter groups disagree on it, it is not a non-negative integer, or it differs from
                ``averaging_step``; or whatever the inner optimizer raises. Nothing is changed then.
        """
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        inner = dict(state_dict)
        ours = inner.pop(STATE_KEY, None)
        torch_step = inner.pop("step", None)
        group_step = _pop_group_step(inner)
        if ours is not None:
            averaging_state, where = ours, f"'{STATE_KEY}'"
        elif torch_step is not None:
            averaging_state, where = {"step": torch_step}, "the top-level 'step'"
        elif group_step is not None:
            averaging_state, where = {"step": group_step}, f"the param_groups' '{GROUP_STEP_KEY}'"
        elif averaging_step is not None:
            averaging_state, where = {"step": averaging_step}, "averaging_step"
        else:
            raise ValueError(
                f"The state dict has no averaging step count: no '{STATE_KEY}', no top-level 'step' (torch's "
                f"PostLocalSGDOptimizer) and no '{GROUP_STEP_KEY}' in its param_groups; it has keys "
                f"{sorted(map(str, state_dict))}. Load a state dict saved by this wrapper's state_dict(), or, to "
                "start from a plain inner-optimizer state dict on purpose, pass the count to resume at: "
                "load_state_dict(state_dict, averaging_step=N) (0 restarts the averaging schedule)."
            )
        # The averaging state is checked first, and restored if the inner optimizer rejects its part:
        # a rejected state dict changes neither the inner optimizer nor the count.
        previous = (self.averager.step, self.averager._verify_step_pending)
        self.averager.load_state_dict(averaging_state)
        if averaging_step is not None and averaging_step != self.averager.step:
            self.averager.step, self.averager._verify_step_pending = previous
            raise ValueError(
                f"load_state_dict(averaging_step={averaging_step!r}) differs from the count {where} of the state "
                f"dict holds ({self.averager.step}): pass averaging_step only for a state dict without a count, "
                "or the same value."
            )
        try:
            self.optimizer.load_state_dict(inner)
        except BaseException:
            self.averager.step, self.averager._verify_step_pending = previous
            raise
        self.__dict__.pop("_initialized_state", None)  # a loaded state is never dropped at the next step
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)


def _pop_group_step(state_dict: dict[str, Any]) -> int | None:
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

"""Where averaging plugs in: the optimizer wrapper.

:class:`HierarchicalAveragingOptimizer` wraps any ``torch.optim.Optimizer`` with a
:class:`~hieravg_optim.HierarchicalAverager` (see :mod:`hieravg_optim.averager`), like
torch's ``PostLocalSGDOptimizer`` wraps a ``HierarchicalModelAverager``. The averager,
:class:`~hieravg_optim.LevelMetrics`, :func:`local_tensor` and the state-dict keys are re-exported
here for their old import path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .agreement import raise_on_every_rank
from .averager import HierarchicalAverager, LevelMetrics, local_tensor
from .checks import (
    add_checked_param_group,
    check_dtensor_layout,
    master_copy_error,
    own_subgroups,
    rebound_param_error,
    state_shape_error,
    unique_params,
)
from .comm_dtype import CommDtype
from .delay_settings import PerLevel
from .compression.settings import CompressSpec
from .config import AveragingConfig
from .inner import (
    GROUP_STEP_KEY,
    STATE_KEY,
    called_by_torch_state_init,
    drop_initialized_state,
    initialize_state,
    initialize_state_step,
    inner_step,
    run_step_hooks,
    split_count,
)
from .outer import OuterFactory
from .schedule import AveragingLevel

__all__ = ["GROUP_STEP_KEY", "STATE_KEY", "HierarchicalAverager", "HierarchicalAveragingOptimizer", "LevelMetrics", "local_tensor"]


class HierarchicalAveragingOptimizer(torch.optim.Optimizer):
    """Wraps any optimizer and averages the parameters hierarchically after its steps.

    Each :meth:`step` runs the inner step; then, from ``warmup_steps`` on, when the step count is
    divisible by one or more periods, the subgroup of the largest such period averages the parameters
    in place (hierarchical SGD, https://arxiv.org/abs/2010.12998, which generalises post-local SGD,
    https://arxiv.org/abs/1808.07217). Arguments, schedule and errors follow torch's
    ``HierarchicalModelAverager`` and ``PostLocalSGDOptimizer``; unlike them, it

    * writes the averages into each parameter's own storage (views into flat buffers stay views)
      through reusable buckets of ``bucket_cap_mb`` MB instead of one model-sized buffer;
    * averages every parameter of ``param_groups`` whatever its ``.grad`` (torch skips parameters
      whose ``.grad`` is ``None``, which can differ across ranks and hang), and checks that the
      ranks agree on shapes and dtypes first;
    * averages sharded parameters (DTensor local shards, ZeRO partitions, FSDP flat parameters)
      among the ranks that hold the same shard.

    Which tensors are averaged: each parameter of ``param_groups`` once, in order (a DTensor by its
    local shard; frozen ones only with ``average_frozen``), then the floating-point ``buffers``; they
    must be the same tensor on every rank of a group and the ones the next step reads (fp32 masters:
    ``tensors_to_average``). Under ``torch.amp.GradScaler``, ``scaler.step(opt)`` always calls
    :meth:`step`, and a skipped inner step counts (:attr:`step_was_skipped` tells the training loop,
    e.g. not to advance its LR scheduler). The rules, in full:
    ``docs/semantics.md``, section "What is averaged, and how".

    .. warning::
        The constructor is collective over ``process_group`` (it creates the
        subgroups). :meth:`step` is collective over the averaging subgroup when
        averaging is due: every rank must call it the same number of times.

    Args:
        optimizer: The inner (local) optimizer.
        period_group_size_dict: ``{period: group_size}``, e.g. ``{4: 8, 32: 32}``: every ``period`` steps, blocks
            of ``group_size`` consecutive ranks average: [`levels`][hieravg_optim.AveragingConfig.levels].
        warmup_steps: Steps that never average: [`warmup_steps`][hieravg_optim.AveragingConfig.warmup_steps].
        process_group: The overall group; ``None`` means the default group.
        ranks_per_replica: Ranks of one replica: [`ranks_per_replica`][hieravg_optim.AveragingConfig.ranks_per_replica].
        bucket_cap_mb: Bucket size, in MB: [`bucket_cap_mb`][hieravg_optim.AveragingConfig.bucket_cap_mb].
        buffers: Tensors averaged on the same schedule, e.g. ``model.buffers()``
            (BatchNorm running statistics); non-floating ones are left untouched.
        log_metrics_every: Log :meth:`metrics`: [`log_metrics_every`][hieravg_optim.AveragingConfig.log_metrics_every].
        tensors_to_average: Called at each round, after the inner step; returns the tensors to average
            instead of the parameters (``buffers`` are still averaged after them), the same number, shapes
            and dtypes on every rank. For fp32 master weights: the masters, which the next step reads, e.g.
            ``lambda: [inner.state[p]["master_param"] for p in params]``. ``None``: the parameters.
        synchronous_warmup: [`synchronous_warmup`][hieravg_optim.AveragingConfig.synchronous_warmup].
        average_frozen: Frozen parameters too: [`average_frozen`][hieravg_optim.AveragingConfig.average_frozen].
        collective_timeout_s: In seconds: [`collective_timeout_s`][hieravg_optim.AveragingConfig.collective_timeout_s].
        nonfinite: NaN or infinity: [`nonfinite`][hieravg_optim.AveragingConfig.nonfinite].
        comm_dtype: The wire dtype: [`comm_dtype`][hieravg_optim.AveragingConfig.comm_dtype].
        delay_steps: Delayed rounds: [`delay_steps`][hieravg_optim.AveragingConfig.delay_steps].
        fragments: Streamed fragments: [`fragments`][hieravg_optim.AveragingConfig.fragments].
        delay_mixing: Streaming DiLoCo's alpha: [`delay_mixing`][hieravg_optim.AveragingConfig.delay_mixing].
        delay_correction: [`delay_correction`][hieravg_optim.AveragingConfig.delay_correction].
        ranks_per_node: Node-aware levels: [`ranks_per_node`][hieravg_optim.AveragingConfig.ranks_per_node].
        outer_optimizers: DiLoCo: [`outer_optimizers`][hieravg_optim.AveragingConfig.outer_optimizers].
        outer_state_device: Anchors' device: [`outer_state_device`][hieravg_optim.AveragingConfig.outer_state_device].
        compress: Compressed rounds per level: [`compress`][hieravg_optim.AveragingConfig.compress].
        ef_decay: Error-feedback decay per level: [`ef_decay`][hieravg_optim.AveragingConfig.ef_decay].

    Raises:
        ValueError: for an invalid setting, naming it (see :class:`~hieravg_optim.AveragingConfig`), before
            any collective; at the first round, on every rank, for an fp32 master copy of a float16 / bfloat16
            parameter in the optimizer state without ``tensors_to_average``.
        TypeError: if ``optimizer`` has no ``param_groups`` or ``step``, or is already wrapped; if
            ``tensors_to_average`` is not callable; for a DTensor parameter split over ranks of this rank's
            averaging subgroup; for a setting of an unsupported type (``outer_optimizers``, a factory that
            builds no ``torch.optim.Optimizer`` over exactly its tensors, ``outer_state_device``).
        RuntimeError: if the ranks were given different settings (outer optimizers' classes and
            hyperparameters included), or another rank's were invalid (that rank raises its ValueError or
            TypeError, the others a RuntimeError naming it, never a hang); at a round, on every rank of the
            subgroup, if ``param_groups`` holds tensors this wrapper was not given.

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
        tensors_to_average: Callable[[], Iterable[torch.Tensor]] | None = None,
        synchronous_warmup: bool = False,
        average_frozen: bool = False,
        collective_timeout_s: float | None = None,
        nonfinite: str = "raise",
        comm_dtype: CommDtype = None,
        delay_steps: PerLevel = 0,
        fragments: PerLevel = 1,
        delay_mixing: PerLevel = 0.0,
        delay_correction: PerLevel = "eager",
        ranks_per_node: int | str | None = None,
        outer_optimizers: Mapping[int | str, OuterFactory] | None = None,
        outer_state_device: str | torch.device | None = None,
        compress: CompressSpec = None,
        ef_decay: float | Mapping[int | str, float] | None = None,
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
                synchronous_warmup=synchronous_warmup,
                collective_timeout_s=collective_timeout_s,
                nonfinite=nonfinite,
                comm_dtype=comm_dtype,
                delay_steps=delay_steps,
                fragments=fragments,
                delay_mixing=delay_mixing,
                delay_correction=delay_correction,
                ranks_per_node=ranks_per_node,
                average_frozen=average_frozen,
                outer_optimizers=outer_optimizers,
                outer_state_device=outer_state_device,
                compress=compress,
                ef_decay=ef_decay,
                log_metrics_every=log_metrics_every,
            )
            if isinstance(buffers, torch.Tensor):
                raise TypeError("buffers must be an iterable of tensors, e.g. model.buffers(), got a single Tensor.")
            if tensors_to_average is not None and not callable(tensors_to_average):
                raise TypeError(
                    f"tensors_to_average must be a function returning the tensors to average, got "
                    f"{type(tensors_to_average).__name__}: pass e.g. lambda: [...], so that tensors the inner "
                    "optimizer creates at its first step (fp32 master weights) are looked up at each round."
                )
            kept = [b for b in (() if buffers is None else buffers) if b.is_floating_point()]
            params = unique_params(optimizer.param_groups)
            if dist.is_available() and dist.is_initialized():
                check_dtensor_layout(params, own_subgroups(config, process_group))
        except Exception as exc:  # noqa: BLE001 - any error of the checks (NotImplementedError, a warning as error)
            # Raised here; the other ranks of process_group raise a RuntimeError naming this rank
            # (in the agreement they are about to enter) instead of waiting for it.
            raise_on_every_rank(exc, process_group, "the averaging config")
        self.optimizer = optimizer
        self.buffers = kept
        self._tensors_fn = tensors_to_average
        self.average_frozen = config.average_frozen
        """Whether parameters with ``requires_grad=False`` are averaged too (else skipped)."""
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
        self.averager = HierarchicalAverager(config, process_group)
        # The buffers come last in tensors_to_average(); an outer optimizer steps the parameters only.
        self.averager.outer_skip_last = len(self.buffers)
        self._sync_replicas_at_construction()
        if self.averager.needs_anchors:  # warmup_steps == 0: the anchors are the starting point
            self.averager.take_anchors(self.tensors_to_average(), agree=True)

    def _sync_replicas_at_construction(self) -> None:
        """Make the replicas equal at construction, before the anchors are taken: the hook every entry point
        runs, by one rule (:meth:`HierarchicalAverager.broadcast_from_first_replica`: sharded tensors from the
        same-shard rank of replica 0, whole ones from the first rank). FSDP broadcasts its shards; the
        DeepSpeed adapter its masters, frozen parameters and buffers. Nothing here: plain PyTorch and DDP
        start from equal weights (DDP broadcasts from rank 0)."""

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
        self.averager.load_step_state({"step": value})

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

        Parameters with ``requires_grad=False`` are left out unless ``average_frozen``. With the
        constructor's ``tensors_to_average``, the tensors it returns instead of the parameters. The list is the same on every rank whose model and parameter groups are
        built the same way; it never depends on ``.grad``.
        """
        if self._tensors_fn is not None:
            return [local_tensor(t) for t in self._tensors_fn()] + [local_tensor(b) for b in self.buffers]
        params = [
            local_tensor(p)
            for _, _, p in unique_params(self.optimizer.param_groups)
            if self.average_frozen or p.requires_grad
        ]
        return params + [local_tensor(b) for b in self.buffers]

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
        # Under torch.compile, Dynamo cannot read the frames (sys._getframe); torch's DCP helpers run eagerly.
        if closure is None and not self.optimizer.state and not torch.compiler.is_compiling() and called_by_torch_state_init():
            self._initialized_state = initialize_state_step(self.optimizer)
            return None
        return run_step_hooks(self, self._step, closure)

    def _step(self, closure: Callable[[], float] | None = None):
        made = self.__dict__.pop("_initialized_state", None)
        if made is not None:
            drop_initialized_state(self.optimizer, made)
        self.averager.begin_step(self.tensors_to_average)
        found_inf = getattr(self, "found_inf", None)
        loss = inner_step(self.optimizer, closure, getattr(self, "grad_scale", None), found_inf)
        self._found_inf = found_inf  # read by step_was_skipped, lazily (no device sync here)
        self.averager.step_and_average(
            self.tensors_to_average,
            check=self._round_error,
            context=self._frozen_context,
            inner_optimizer=self.optimizer,
        )
        return loss

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last :meth:`step` skipped the inner step on this rank: ``GradScaler`` found inf/NaN gradients.

        Read it after ``scaler.step(opt)``, e.g. to not advance an LR scheduler: the scaler always calls this
        wrapper's :meth:`step`, so checking whether it was called (accelerate, Lightning) never sees a skip. The
        count advanced anyway. Local; ``False`` without a scaler. Syncs with the device once (``.item()``).
        """
        found_inf = self.__dict__.get("_found_inf")
        return found_inf is not None and bool(found_inf.item())

    def _round_error(self) -> BaseException | None:
        """Local checks of an averaging round, raised on every rank of the subgroup by the round's agreement.

        Each round: one dict lookup per parameter (``param_groups`` holds the parameters this wrapper
        was given). The first round also looks for fp32 master copies in the optimizer state.
        """
        if self._tensors_fn is not None:
            return None
        error = rebound_param_error(self.optimizer.param_groups, self._given, type(self).__name__)
        if error is None and not self._masters_checked:
            self._masters_checked = True
            error = master_copy_error(self.optimizer, type(self).__name__)
        return error

    def _frozen_context(self) -> dict[str, object]:
        """What the ranks of a round agree on besides the tensors: the frozen parameters they skip.

        Indices into ``param_groups`` (each parameter once, in order); empty when nothing is skipped.
        """
        if self.average_frozen or self._tensors_fn is not None:
            return {}
        frozen = [i for i, (_, _, p) in enumerate(unique_params(self.optimizer.param_groups)) if not p.requires_grad]
        return {"skipped frozen parameters (requires_grad=False, index in param_groups)": frozen}

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
        made = initialize_state(self.optimizer)
        if made is not None:
            self._initialized_state = made

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer. Every rank must add the same group (shapes, dtypes).

        Raises:
            TypeError: for a DTensor parameter split over ranks of this rank's averaging subgroup
                (the group is then not added); on every rank, as the layout is the same on all.
        """
        subgroups = [(lg.level, lg.ranks) for lg in self.averager.level_groups]
        self._given.update((id(p), p) for p in add_checked_param_group(self.optimizer, param_group, subgroups))

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per level, keyed by period: rounds, bytes and seconds; see :class:`LevelMetrics`."""
        return self.averager.metrics()

    def apply_rounds_in_flight(self) -> int:
        """Wait for every delayed round in flight and apply it to this wrapper's tensors now.

        For the end of training or before an evaluation: a round started at count ``t`` (``delay_steps``,
        ``fragments``) is otherwise applied at ``t + delay_steps`` only. The round is applied as at its count,
        with the local progress made since ``t``
        (:meth:`HierarchicalAverager.apply_rounds_in_flight <hieravg_optim.HierarchicalAverager.apply_rounds_in_flight>`).
        The count does not change.

        Returns:
            The number of rounds applied (0 without ``delay_steps`` / ``fragments``, or with none in flight).

        Raises:
            CollectiveError: if a round's collective failed (a dead or hung peer), naming it.

        .. warning::
            Every rank of the process group must call it at the same count: the rounds in flight are the same
            on every rank, and waiting for one waits for its collective.
        """
        return self.averager.apply_rounds_in_flight(self.tensors_to_average())

    def average_now(self, level_index: int = -1) -> None:
        """Average at one level now, whatever the count: e.g. ``-1``, the top level, so that every replica holds
        the same weights before an evaluation or at the end of training.

        Rounds in flight are applied first (:meth:`apply_rounds_in_flight`), so nothing is applied on top of
        the result later. At a level with an outer optimizer whose anchors are taken this is one outer step
        (:meth:`HierarchicalAverager.average <hieravg_optim.HierarchicalAverager.average>`). The count does not
        change. Mirrors DeepSpeed's ``get_averaging(engine).average_now``.

        Raises:
            ValueError: if ``level_index`` is not the index of a level, before any collective.
            RuntimeError: on every rank of the subgroup if its ranks disagree on the tensors or the frozen
                parameters, or a collective fails (naming the round and the ranks).

        .. warning::
            Collective over this rank's subgroup at that level (and over the groups of the rounds in flight):
            every rank of the process group must call it, with the same ``level_index``.
        """
        level_index = self.averager._level_index(level_index)  # a bad index raises before any collective
        self.apply_rounds_in_flight()
        tensors = self.tensors_to_average()
        self.averager.average(level_index, tensors, error=self._round_error(), context=self._frozen_context())

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
                ``averaging_step``; if it was saved for parameters of other shapes, naming the first
                state tensor and both shapes (torch's optimizers; see
                :func:`hieravg_optim.checks.state_shape_error`); or whatever the inner optimizer raises.
                Nothing is changed then. Every rank that loads such a state dict raises, before any collective.
        """
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        inner, averaging_state, where = split_count(state_dict, averaging_step)
        # The averaging state is checked first, and restored if the inner optimizer rejects its part:
        # a rejected state dict changes neither the inner optimizer nor the count; the anchors and outer
        # optimizer state are checked first and loaded last.
        # Checked against this rank's tensors (unless tensors_to_average looks up masters the inner optimizer
        # may not have created yet), so that anchors of another model fail here even during a warm-up.
        outer = self.averager.check_outer_state(
            averaging_state, self.tensors_to_average() if self._tensors_fn is None else None
        )
        shape_error = state_shape_error(self.optimizer, inner)  # torch checks only the numbers of parameters
        if shape_error is not None:
            raise shape_error
        with self.averager.restoring_count_on_error():
            self.averager.load_step_state(averaging_state)
            if averaging_step is not None and averaging_step != self.averager.step:
                raise ValueError(
                    f"load_state_dict(averaging_step={averaging_step!r}) differs from the count {where} of the state "
                    f"dict holds ({self.averager.step}): pass averaging_step only for a state dict without a count, "
                    "or the same value."
                )
            self.optimizer.load_state_dict(inner)
        self.averager.load_outer_state(outer)
        self.__dict__.pop("_initialized_state", None)  # a loaded state is never dropped at the next step
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)


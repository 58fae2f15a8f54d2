"""The averaging attached to a DeepSpeed engine: its fp32 master weights and its step.

:class:`DeepSpeedAveraging` knows, for each kind of DeepSpeed optimizer (ZeRO 0-3, fp32,
bf16, fp16), which tensors are this rank's fp32 master weights and how DeepSpeed's own
routines push them into the live module parameters; every collective goes through its
:class:`~hieravg_optim.HierarchicalAverager`. :func:`hieravg_optim.deepspeed.hooks.attach`
hooks it into the engine's optimizer step and checkpoints. Written against DeepSpeed 0.19.8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..averager import HierarchicalAverager
from ..checkpoint import read_step
from ..config import AveragingConfig
from ..outer import OuterFactory
from .mpu import ReplicaParallelUnit

__all__ = ["DeepSpeedAveraging"]


def _optimizer_kind(optimizer: Any) -> str:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        if getattr(optimizer, "swap_optimizer", False) or any(
            t is None for t in optimizer.fp16_partitioned_groups_flat
        ):
            raise NotImplementedError(
                "Hierarchical averaging does not support ZeRO-3 with NVMe offload of parameters or optimizer "
                'state. Use "offload_optimizer": {"device": "cpu"} or no offload.'
            )
        return "zero3"
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return "zero12"
    if isinstance(optimizer, BF16_Optimizer):
        return "bf16"
    if isinstance(optimizer, FP16_Optimizer):
        return "fp16_fused"
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return "fp16_unfused"
    if isinstance(optimizer, torch.optim.Optimizer):
        return "plain"
    raise TypeError(
        f"Hierarchical averaging does not know the master weights of DeepSpeed optimizer "
        f"{type(optimizer).__name__}. Supported: ZeRO stages 0-3 with fp32, bf16 or fp16."
    )


class DeepSpeedAveraging:
    """The averaging attached to one DeepSpeed engine (``engine.hierarchical_averaging``).

    Holds the :class:`~hieravg_optim.HierarchicalAverager` (step count, subgroups,
    buckets, metrics), knows the engine's fp32 master weights and how to push them into
    the live module parameters.

    Which tensors are averaged (each rank only its own; nothing is copied):

    * ZeRO-1/2: ``single_partition_of_fp32_groups`` (this rank's fp32 partition of each
      parameter group), then ``update_lp_params()`` copies it into the bf16/fp16/fp32 module
      partition and all-gathers it within the replica;
    * ZeRO-3: ``fp32_partitioned_groups_flat`` (this rank's fp32 partition of each
      sub-group), then each sub-group's partitioned parameters are rewritten from it and the
      persistent (small, always gathered) parameters are re-gathered;
    * ZeRO-1 with bf16 and fp32 gradient accumulation (``BF16_Optimizer``):
      ``fp32_groups_flat_partition``, then ``update_lp_params()``;
    * ZeRO-0 with fp16 or bf16: the fp32 master copies (``fp32_groups`` or
      ``fp32_groups_flat``), then copied into the module's parameters;
    * ZeRO-0 with fp32: the module parameters of the optimizer's parameter groups.

    Optimizer state (Adam moments) is not averaged, as in torch's ``PostLocalSGDOptimizer``.

    Outer optimizers (DiLoCo, https://arxiv.org/abs/2311.08105; ``docs/outer.md``): a level with
    one keeps an fp32 anchor of each tensor of :meth:`tensors_to_average`, this rank's partition
    (sharded as the masters are: 1 / ``ranks_per_replica`` of the model under ZeRO 1-3), plus the
    outer optimizer's state. Its rounds average, step the anchors with ``anchor - mean`` and copy
    them into the masters, all before DeepSpeed's routine pushes the masters into the module. The
    anchors are taken after the broadcast from replica 0 (``warmup_steps`` 0) or right after the
    last warm-up count. Buffers and frozen parameters averaged with the masters get anchors too.

    Buffers: DeepSpeed never synchronises module buffers (not at initialisation, not in
    training), so BatchNorm running statistics differ between all ranks. With
    ``average_buffers`` (the default of :func:`~hieravg_optim.deepspeed.initialize`), every
    floating-point buffer of ``engine.module`` is broadcast from rank 0 at construction (as
    DDP does), and whenever a level averages, it is replaced by its mean over that level's
    whole block of ``group_size`` ranks: first with the ranks at the same position in the
    other replicas (with the master weights, in the same collective), then within the
    replica (:meth:`HierarchicalAverager.average_within_replica
    <hieravg_optim.HierarchicalAverager.average_within_replica>`: one more all-reduce over the
    replica, of the buffers only, agreed and counted in the level's :meth:`metrics`). Buffers
    are never partitioned by ZeRO, so this holds for stages 0-3.
    Frozen parameters (``requires_grad=False``): DeepSpeed keeps no master weights for them
    (its optimizers drop them from their groups), so they are not averaged, and under ZeRO-0 with
    fp32 (where the master weights are the client optimizer's ``param_groups``) they are skipped.
    With ``average_frozen=True`` the module's frozen parameters are averaged too, in their own
    dtype (ZeRO-0, 1 and 2, where every rank holds them whole). At construction they are
    broadcast from replica 0 with the master weights whatever ``average_frozen`` says, except
    under ZeRO-3 (partitioned: not broadcast, never averaged).

    Args:
        engine: The DeepSpeed engine, built with ``mpu``.
        config: The averaging settings; ``ranks_per_replica`` is ``mpu``'s.
        mpu: The replica mpu the engine was built with.
        agreed: ``True`` when ``config`` was already checked against the world size and agreed on
            across ranks, as :func:`~hieravg_optim.deepspeed.initialize` does: the averager then skips
            its own check and agreement collective.
        average_buffers: Average the floating-point buffers of ``engine.module`` as described above;
            ``False`` leaves them as DeepSpeed does (local to each rank).
        average_frozen: Also average the module's parameters with ``requires_grad=False``, as
            ``config.average_frozen`` (the section's ``"average_frozen"``) does; either one turns it on.
        outer_optimizers, outer_state_device: Kept for calls written before these were
            `AveragingConfig` fields
            ([`outer_optimizers`][hieravg_optim.AveragingConfig.outer_optimizers],
            [`outer_state_device`][hieravg_optim.AveragingConfig.outer_state_device]); given here, they replace the
            config's. The outer optimizers step over fp32 copies of :meth:`tensors_to_average` (this
            rank's master partitions, sharded as they are): see ``docs/outer.md``.

    Raises:
        NotImplementedError: for ``average_frozen=True`` under ZeRO-3 with a frozen parameter in the
            module (on every rank: the model is the same on all), or for CPU master weights over a
            backend that cannot all-reduce them.

    At construction every replica is made equal to replica 0 (:meth:`broadcast_from_first_replica`),
    then, with outer optimizers and no warm-up, the anchors are taken.

    .. warning::
        The constructor is collective over the default process group (the broadcast from the first
        replica): every rank must construct it, with the same settings.
    """

    def __init__(
        self,
        engine: Any,
        config: AveragingConfig,
        mpu: ReplicaParallelUnit,
        *,
        agreed: bool = False,
        average_buffers: bool = False,
        average_frozen: bool = False,
        outer_optimizers: Mapping[int | str, OuterFactory] | None = None,
        outer_state_device: str | torch.device | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.mpu = mpu
        self.kind = _optimizer_kind(engine.optimizer)
        self.average_frozen = average_frozen or config.average_frozen
        """Whether the module's frozen parameters (``requires_grad=False``) are averaged too."""
        if average_frozen and self.kind == "zero3" and any(not p.requires_grad for p in engine.module.parameters()):
            raise NotImplementedError(
                '"average_frozen": true is not supported under ZeRO-3, which partitions the frozen parameters '
                'outside its optimizer. Set "average_frozen": false (frozen parameters stay as loaded), or use '
                "ZeRO stage 0-2."
            )
        backend = str(dist.get_backend())
        if "gloo" not in backend and any(t.device.type == "cpu" for t in self.master_tensors()):
            raise NotImplementedError(
                f"The fp32 master weights are on the CPU (ZeRO optimizer offload) but the process group backend is "
                f"{backend!r}, which cannot all-reduce CPU tensors. Turn off offload_optimizer, or initialise "
                'torch.distributed with a CPU-capable backend such as "cpu:gloo,cuda:nccl".'
            )
        self.averager = HierarchicalAverager(
            config,
            agreed=agreed,
            outer_optimizers=outer_optimizers,
            outer_state_device=outer_state_device,
            # The mpu's replica groups serve the averaging too (its finiteness vote, the buffers' pass).
            replica_group=mpu.get_data_parallel_group() if config.ranks_per_replica > 1 else None,
        )
        self.buffers: list[torch.Tensor] = (
            [b.detach() for b in engine.module.buffers() if b.is_floating_point()] if average_buffers else []
        )
        """The module's floating-point buffers this averaging averages (empty without ``average_buffers``)."""
        # Buffers come last in tensors_to_average(); an outer optimizer steps the weights only.
        self.averager.outer_skip_last = len(self.buffers)
        self._sync_replicas_at_construction()

    def _sync_replicas_at_construction(self) -> None:
        """Make the replicas equal at construction (the hook of every entry point): replica 0's masters,
        frozen parameters and buffers; then, with outer optimizers and no warm-up, the anchors."""
        self.broadcast_from_first_replica()

    @property
    def step(self) -> int:
        """The averaging step count: engine optimizer steps (boundaries) taken so far."""
        return self.averager.step

    @property
    def replica_index(self) -> int:
        """This rank's replica: ``rank // ranks_per_replica``."""
        return self.mpu.replica_index

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per level, keyed by period: rounds, bytes, seconds (see :class:`~hieravg_optim.LevelMetrics`)."""
        return self.averager.metrics()

    def master_tensors(self) -> list[torch.Tensor]:
        """This rank's fp32 master weights (its partition under ZeRO), in a fixed order.

        Views of DeepSpeed's own buffers: averaging them in place updates the optimizer's weights.
        """
        opt = self.engine.optimizer
        if self.kind == "zero12":
            return [t.detach() for t in opt.single_partition_of_fp32_groups]
        if self.kind == "zero3":
            return [t.detach() for t in opt.fp32_partitioned_groups_flat]
        if self.kind == "bf16":
            return [t.detach() for t in opt.fp32_groups_flat_partition]
        if self.kind == "fp16_fused":
            return [t.detach() for t in opt.fp32_groups_flat]
        if self.kind == "fp16_unfused":
            return [p.detach() for group in opt.fp32_groups for p in group]
        seen: set[int] = set()
        out = []
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen and p.requires_grad:  # frozen ones: see frozen_module_tensors()
                    seen.add(id(p))
                    out.append(p.detach())
        return out

    def frozen_module_tensors(self) -> list[torch.Tensor]:
        """The module's parameters with ``requires_grad=False``, each once, in module order; none under ZeRO-3.

        DeepSpeed's optimizers keep no master weights for them; under ZeRO-0, 1 and 2 every rank
        holds them whole, so each rank averages (or receives) the whole tensor in place.
        """
        if self.kind == "zero3":
            return []
        return [p.detach() for p in self.engine.module.parameters() if not p.requires_grad]

    def tensors_to_average(self) -> list[torch.Tensor]:
        """What a round averages, in one collective per level: :meth:`master_tensors`, then, with
        ``average_frozen``, :meth:`frozen_module_tensors`, then, with ``average_buffers``, :attr:`buffers`."""
        frozen = self.frozen_module_tensors() if self.average_frozen else []
        return self.master_tensors() + frozen + self.buffers

    def _frozen_context(self) -> dict[str, object]:
        """What the ranks of an averaging group agree on besides the tensors: which parameters are frozen."""
        frozen = [i for i, p in enumerate(self.engine.module.parameters()) if not p.requires_grad]
        return {"frozen module parameters (requires_grad=False, index in module.parameters())": frozen}

    @torch.no_grad()
    def push_to_module(self) -> None:
        """Copy the master weights into the live module parameters, with DeepSpeed's own routines.

        .. warning::
            Collective over the replica under ZeRO-1/2 and ``BF16_Optimizer`` (all-gather) and
            under ZeRO-3 with persistent parameters: every rank of the replica must call it.
        """
        opt = self.engine.optimizer
        if self.kind in ("zero12", "bf16"):
            opt.update_lp_params()
        elif self.kind == "zero3":
            # As DeepSpeedZeroOptimizer_Stage3.step does: release every gathered parameter (the
            # persistent ones too), rewrite the partitions, re-gather the persistent ones.
            opt._partition_all_parameters()
            for sub_group_id in range(len(opt.fp16_groups)):
                opt._reassign_or_swap_out_partitioned_parameters(sub_group_id)
            if len(opt.persistent_parameters) > 0:
                opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
            opt.invalidate_secondary_tensor()
        elif self.kind == "fp16_fused":
            from torch._utils import _unflatten_dense_tensors

            for flat, group in zip(opt.fp32_groups_flat, opt.fp16_groups):
                for p, q in zip(group, _unflatten_dense_tensors(flat, group)):
                    p.data.copy_(q)
        elif self.kind == "fp16_unfused":
            for fp32_group, lp_group in zip(opt.fp32_groups, opt.fp16_groups):
                for fp32, lp in zip(fp32_group, lp_group):
                    lp.data.copy_(fp32.data)
        # "plain": the master weights are the module parameters.

    def after_engine_step(self) -> int | None:
        """Advance the schedule by one engine optimizer step; average and push if due.

        Called after every gradient-accumulation boundary, whether or not DeepSpeed skipped
        the update (fp16/bf16 overflow), so every rank's count stays equal to the engine's
        ``global_steps`` and every rank of an averaging group enters the same collectives.

        Returns:
            The index of the level that averaged, or ``None``.
        """
        opt = self.engine.optimizer
        # The inner optimizer's state (over the fp32 masters) is repaired by the averager after a skipped
        # replica's round: its NaN moments would write NaN back at the next step.
        index = self.averager.step_and_average(
            self.tensors_to_average, context=self._frozen_context, inner_optimizer=getattr(opt, "optimizer", opt)
        )
        if index is not None:
            self._after_round(index)
        return index

    def _after_round(self, level_index: int) -> None:
        """After a round at ``level_index``: push the masters into the module if the round may have changed
        them, and average the buffers within the replica (their mean over the level's whole block).

        .. warning::
            Collective over the replica.
        """
        lg = self.averager.level_groups[level_index]
        # A level with other ranks changes the masters; so does an outer optimizer's step alone (Lookahead).
        if lg.group is not None or lg.level.period in self.averager.outer_periods:
            self.push_to_module()
        if self.buffers:
            self.averager.average_within_replica(self.buffers, level_index)

    def average_now(self, level_index: int = -1) -> None:
        """Average the master weights at one level now, whatever the count, and push them into the module.

        ``-1`` is the top level: every replica ends with the same weights (e.g. before evaluation),
        and, with ``average_buffers``, every rank with the same buffers.
        The step count does not change. Rounds in flight (``delay_steps``) are applied first
        (:meth:`apply_rounds_in_flight`). At a level with an outer optimizer (once its anchors are
        taken) this is a full round: average, outer step, anchors into the masters.

        .. warning::
            Collective over this rank's subgroup at that level and over its replica.
        """
        level_index = self.averager._level_index(level_index)  # a bad index raises before any collective
        self.apply_rounds_in_flight()
        self.averager.average(level_index, self.tensors_to_average(), context=self._frozen_context())
        self._after_round(level_index)

    def apply_rounds_in_flight(self) -> int:
        """Wait for every delayed round in flight, apply it to the fp32 masters now and push them into the module.

        For the end of training or before an evaluation: a round started at engine step ``t`` (``delay_steps``,
        ``fragments``) is otherwise applied at ``t + delay_steps`` only. The count does not change
        (:meth:`HierarchicalAverager.apply_rounds_in_flight <hieravg_optim.HierarchicalAverager.apply_rounds_in_flight>`).

        Returns:
            The number of rounds applied (0 without delayed rounds in flight).

        Raises:
            CollectiveError: if a round's collective failed (a dead or hung peer), naming it.

        .. warning::
            Every rank of the world must call it at the same engine step; with rounds in flight, ZeRO-3 then
            gathers the new masters into the module over the replica.
        """
        applied = self.averager.apply_rounds_in_flight(self.tensors_to_average())
        if applied:
            self.push_to_module()
        return applied

    @torch.no_grad()
    def broadcast_from_first_replica(self) -> None:
        """Make every replica start from replica 0's weights (as DDP broadcasts from rank 0).

        The master weights and the frozen parameters (:meth:`frozen_module_tensors`) come from the rank
        holding the same shard in replica 0, and the :attr:`buffers` from rank 0, in one call of
        :meth:`HierarchicalAverager.broadcast_from_first_replica
        <hieravg_optim.HierarchicalAverager.broadcast_from_first_replica>` (one agreement: a rank with
        other tensors, e.g. another set of buffers, is a ``RuntimeError`` on every rank); then the masters
        are pushed into the module. With outer optimizers and no warm-up, then takes the anchors
        (:meth:`take_anchors`), so that they are replica 0's weights on every replica. The constructor
        calls it.

        .. warning::
            Collective over the default process group.
        """
        self.averager.broadcast_from_first_replica(self.master_tensors() + self.frozen_module_tensors(), self.buffers)
        self.push_to_module()
        if self.averager.has_outer and self.config.warmup_steps == 0:
            # Agreed: a rank that cannot take its anchors (no memory left for them) raises on every rank.
            self.averager.take_anchors(self.tensors_to_average(), agree=True)

    def take_anchors(self) -> None:
        """Set the anchor of every level with an outer optimizer to the current :meth:`tensors_to_average`.

        :meth:`HierarchicalAverager.take_anchors <hieravg_optim.HierarchicalAverager.take_anchors>` over
        this rank's master partitions (and, as averaged, frozen parameters and buffers): an fp32 copy
        of each, on ``outer_state_device`` or with the tensor, and a fresh outer optimizer over them.
        Called by :meth:`broadcast_from_first_replica` when ``warmup_steps`` is 0; with a warm-up the
        averager takes them itself after the last warm-up count. Local: no collective.
        """
        self.averager.take_anchors(self.tensors_to_average())

    def outer_state_location(self) -> torch.device:
        """Where this rank's anchors live: ``outer_state_device``, else with the master weights."""
        device = self.averager.outer_state_device
        return device if device is not None else self.master_tensors()[0].device

    def state_dict(self) -> dict[str, Any]:
        """The averaging state saved in checkpoints (step count, levels, warm-up; anchors and outer optimizer
        state of each level with an outer optimizer, see :meth:`HierarchicalAverager.state_dict
        <hieravg_optim.HierarchicalAverager.state_dict>`)."""
        return self.averager.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; every rank checks the count at the next step.

        Saved anchors are checked against this rank's :meth:`tensors_to_average` (number, shapes, float32),
        also during a warm-up, before this rank holds anchors; local, no collective.

        Raises:
            ValueError: from :meth:`HierarchicalAverager.load_state_dict
                <hieravg_optim.HierarchicalAverager.load_state_dict>`; nothing is changed then.
        """
        self.commit_state(state, self.check_state(state))

    def check_state(self, state: Mapping[str, Any]) -> dict[int, tuple] | None:
        """Validate :meth:`state_dict`'s output for :meth:`commit_state`; changes nothing. Local, no collective.

        The first half of :meth:`load_state_dict`, so that a load can be agreed across ranks before any
        rank changes its state (the checkpoint hook's all-or-nothing load).

        Raises:
            ValueError: as :meth:`load_state_dict`.
        """
        read_step(state)
        return self.averager.check_outer_state(state, self.tensors_to_average())

    def commit_state(self, state: Mapping[str, Any], parsed: dict[int, tuple] | None) -> None:
        """Restore a state :meth:`check_state` has validated (``parsed``: its result). Local, no collective."""
        self.averager.load_step_state(state)
        self.averager.load_outer_state(parsed)

"""DeepSpeed adapter: hierarchical averaging set in the DeepSpeed JSON config, ZeRO 0-3.

:func:`initialize` is a drop-in for :func:`deepspeed.initialize`. It reads a top-level
``"hierarchical_averaging"`` section of the DeepSpeed config::

    "hierarchical_averaging": {
        "period_group_size": {"4": 4, "16": 8},
        "warmup_steps": 100,
        "ranks_per_replica": "auto",
        "bucket_cap_mb": 25
    }

and then

* restricts DeepSpeed's data parallelism to *replicas*: blocks of ``ranks_per_replica``
  consecutive ranks (by default the ranks of one node). Within a replica DeepSpeed works
  as usual: gradients are reduced every step and ZeRO partitions the optimizer state,
  gradients and (stage 3) parameters among the replica's ranks. This is done with an
  ``mpu`` (model parallel unit) whose data-parallel group is the replica and whose model
  parallel groups are single ranks;
* after every optimizer step of the engine (every gradient-accumulation boundary, skipped
  fp16/bf16 overflow steps included), drives a :class:`~hieravg_optim.HierarchicalAverager`:
  when the schedule says so, each rank averages *its own fp32 master partition* with the
  ranks that hold the same partition in the other replicas of its group (the core's
  ``ranks_per_replica`` layout), then DeepSpeed's own routine copies the averaged master
  weights into the live low-precision / partitioned parameters.

Without the section (or with ``"enabled": false``) :func:`initialize` is exactly
:func:`deepspeed.initialize`.

Hierarchical SGD: https://arxiv.org/abs/2010.12998; post-local SGD:
https://arxiv.org/abs/1808.07217. Written against DeepSpeed 0.19.8.
"""

from __future__ import annotations

import logging
import numbers
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._handover import hand_over
from .config import AveragingConfig
from .optimizer import (
    HierarchicalAverager,
    HierarchicalAveragingOptimizer,
    _agree_across_ranks,
    _raise_on_every_rank,
)

__all__ = [
    "SECTION",
    "CHECKPOINT_KEY",
    "DeepSpeedAveraging",
    "ReplicaParallelUnit",
    "SectionSettings",
    "get_averaging",
    "initialize",
    "parse_section",
    "replica_checkpoint_dir",
]

logger = logging.getLogger(__name__)

SECTION = "hierarchical_averaging"
"""The top-level key of the DeepSpeed config this adapter reads (and removes before DeepSpeed sees it)."""

CHECKPOINT_KEY = "hierarchical_averaging"
"""Key of the averaging state in the ``client_state`` of DeepSpeed checkpoints."""

_KEYS = ("enabled", "period_group_size", "warmup_steps", "ranks_per_replica", "bucket_cap_mb")


# --------------------------------------------------------------------------------------------------
# The config section
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SectionSettings:
    """The parsed ``"hierarchical_averaging"`` section, before the world size is known."""

    enabled: bool
    """False: the section is ignored and DeepSpeed runs exactly as without it."""
    period_group_size: Mapping[Any, Any] | None
    """``{period: group_size}`` as written in the JSON (keys may be strings)."""
    warmup_steps: int
    """Engine optimizer steps that never average."""
    ranks_per_replica: int | None
    """Consecutive ranks forming one DeepSpeed data-parallel group; ``None`` = ``"auto"`` (one node)."""
    bucket_cap_mb: float
    """Communication bucket size, in MB (10**6 bytes)."""

    def averaging_config(self, ranks_per_replica: int) -> AveragingConfig:
        """The core config, with ``ranks_per_replica`` resolved."""
        try:
            return AveragingConfig.create(
                self.period_group_size,  # type: ignore[arg-type]
                warmup_steps=self.warmup_steps,
                ranks_per_replica=ranks_per_replica,
                bucket_cap_mb=self.bucket_cap_mb,
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f'DeepSpeed config section "{SECTION}": {err}') from None


def _bad(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(
        f'DeepSpeed config section "{SECTION}": key "{key}" must be {expected}, got {value!r} '
        f"({type(value).__name__})."
    )


def parse_section(section: Any) -> SectionSettings:
    """Validate a ``"hierarchical_averaging"`` section (a JSON object) without any collective.

    Args:
        section: The value of the section, as loaded from JSON.

    Returns:
        The settings; ``period_group_size`` is validated as far as possible without the world size.

    Raises:
        ValueError: naming the key and the value, for an unknown key, a missing
            ``period_group_size``, or an invalid value.
    """
    if not isinstance(section, Mapping):
        raise ValueError(
            f'DeepSpeed config section "{SECTION}" must be a JSON object such as '
            f'{{"period_group_size": {{"4": 8, "16": 16}}}}, got {section!r} ({type(section).__name__}).'
        )
    unknown = [k for k in section if k not in _KEYS]
    if unknown:
        raise ValueError(
            f'DeepSpeed config section "{SECTION}": unknown key {unknown[0]!r} (value {section[unknown[0]]!r}); '
            f"the keys are {list(_KEYS)}."
        )
    enabled = section.get("enabled", True)
    if not isinstance(enabled, bool):
        raise _bad("enabled", enabled, "true or false")
    if "period_group_size" not in section:
        raise ValueError(
            f'DeepSpeed config section "{SECTION}": key "period_group_size" is required, e.g. '
            '{"4": 8, "16": 16} (period in optimizer steps -> group size in ranks).'
        )
    pgs = section["period_group_size"]
    if not isinstance(pgs, Mapping):
        raise _bad("period_group_size", pgs, 'a JSON object {"period": group_size}, e.g. {"4": 8, "16": 16}')
    warmup = section.get("warmup_steps", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
        raise _bad("warmup_steps", warmup, "a non-negative integer (optimizer steps)")
    rpr = section.get("ranks_per_replica", "auto")
    if rpr == "auto" or rpr is None:
        rpr_value = None
    elif isinstance(rpr, bool) or not isinstance(rpr, numbers.Integral) or rpr <= 0:
        raise _bad("ranks_per_replica", rpr, 'a positive integer (ranks) or "auto"')
    else:
        rpr_value = int(rpr)
    cap = section.get("bucket_cap_mb", 25.0)
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0:
        raise _bad("bucket_cap_mb", cap, "a positive number (MB)")
    settings = SectionSettings(
        enabled=enabled,
        period_group_size=dict(pgs),
        warmup_steps=int(warmup),
        ranks_per_replica=rpr_value,
        bucket_cap_mb=float(cap),
    )
    if enabled:
        # Everything about the levels that needs no world size (periods, group sizes, order).
        settings.averaging_config(ranks_per_replica=1)
    return settings


def _auto_ranks_per_replica_source() -> str:
    """Which environment variable ``"ranks_per_replica": "auto"`` reads, with its value."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(var) is not None:
            return f"{var}={os.environ[var]}"
    return "no environment variable"


def _resolve_ranks_per_replica(settings: SectionSettings) -> int:
    if settings.ranks_per_replica is not None:
        return settings.ranks_per_replica
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):  # torchrun, deepspeed launcher
        value = os.environ.get(var)
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    raise ValueError(
        f'DeepSpeed config section "{SECTION}": key "ranks_per_replica" is "auto" (the ranks of one node), but '
        "neither LOCAL_WORLD_SIZE (torchrun) nor LOCAL_SIZE (deepspeed launcher) is set. Set "
        '"ranks_per_replica" to a number of ranks.'
    )


# --------------------------------------------------------------------------------------------------
# The data-parallel groups DeepSpeed sees
# --------------------------------------------------------------------------------------------------
class ReplicaParallelUnit:
    """An ``mpu`` that makes each replica (block of consecutive ranks) a DeepSpeed data-parallel group.

    DeepSpeed reads the data-parallel group, rank and size from it (gradient reduction,
    ZeRO partitioning, ``train_batch_size``, checkpoint file names) and all-reduces
    overflow flags and norms over its model-parallel group, which here is the rank alone.

    .. warning::
        The constructor is collective over the default process group: every rank creates
        every replica's group, in the same order, with :func:`torch.distributed.new_group`.

    Args:
        ranks_per_replica: Ranks per replica; must divide the world size.
    """

    def __init__(self, ranks_per_replica: int) -> None:
        world_size = dist.get_world_size()
        rank = dist.get_rank()
        if world_size % ranks_per_replica != 0:
            raise ValueError(
                f"ranks_per_replica={ranks_per_replica} must divide the world size ({world_size})."
            )
        self.ranks_per_replica = ranks_per_replica
        self.replica_index = rank // ranks_per_replica
        """Which replica this rank belongs to (0 .. world_size / ranks_per_replica - 1)."""
        first = self.replica_index * ranks_per_replica
        self._dp_ranks = list(range(first, first + ranks_per_replica))
        self._dp_group = None
        for start in range(0, world_size, ranks_per_replica):
            ranks = list(range(start, start + ranks_per_replica))
            group = dist.group.WORLD if ranks_per_replica == world_size else dist.new_group(ranks)
            if rank in ranks:
                self._dp_group = group
        self._mp_group = None
        for other in range(world_size):
            group = dist.new_group([other])
            if other == rank:
                self._mp_group = group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._dp_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank() - self._dp_ranks[0]

    def get_data_parallel_world_size(self) -> int:
        return self.ranks_per_replica

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._mp_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()


# --------------------------------------------------------------------------------------------------
# Which tensors are the master weights, and how DeepSpeed pushes them into the module
# --------------------------------------------------------------------------------------------------
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
    """

    def __init__(self, engine: Any, config: AveragingConfig, mpu: ReplicaParallelUnit) -> None:
        self.engine = engine
        self.config = config
        self.mpu = mpu
        self.kind = _optimizer_kind(engine.optimizer)
        backend = str(dist.get_backend())
        if "gloo" not in backend and any(t.device.type == "cpu" for t in self.master_tensors()):
            raise NotImplementedError(
                f"The fp32 master weights are on the CPU (ZeRO optimizer offload) but the process group backend is "
                f"{backend!r}, which cannot all-reduce CPU tensors. Turn off offload_optimizer, or initialise "
                'torch.distributed with a CPU-capable backend such as "cpu:gloo,cuda:nccl".'
            )
        self.averager = HierarchicalAverager(config)

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
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p.detach())
        return out

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
        index = self.averager.step_and_average(self.master_tensors)
        if index is not None and self.averager.level_groups[index].group is not None:
            self.push_to_module()
        return index

    def average_now(self, level_index: int = -1) -> None:
        """Average the master weights at one level now, whatever the count, and push them into the module.

        ``-1`` is the top level: every replica ends with the same weights (e.g. before evaluation).
        The step count does not change.

        .. warning::
            Collective over this rank's subgroup at that level and over its replica.
        """
        self.averager.average(level_index, self.master_tensors())
        if self.averager.level_groups[level_index].group is not None:
            self.push_to_module()

    @torch.no_grad()
    def broadcast_from_first_replica(self) -> None:
        """Make every replica start from replica 0's master weights (as DDP broadcasts from rank 0).

        .. warning::
            Collective over the default process group.
        """
        top = self.averager.level_groups[-1]
        if top.group is not None:
            for t in self.master_tensors():
                hand_over(t)
                dist.broadcast(t, src=top.ranks[0], group=top.group)
        self.push_to_module()

    def state_dict(self) -> dict[str, Any]:
        """The averaging state saved in checkpoints (step count, levels, warm-up)."""
        return self.averager.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; every rank checks the count at the next step."""
        self.averager.load_state_dict(state)


def get_averaging(engine: Any) -> DeepSpeedAveraging | None:
    """The :class:`DeepSpeedAveraging` of an engine built by :func:`initialize`, or ``None``."""
    return engine.__dict__.get("hierarchical_averaging")


def replica_checkpoint_dir(save_dir: str | os.PathLike, replica_index: int) -> str:
    """Where replica ``replica_index`` keeps its DeepSpeed checkpoints under ``save_dir``."""
    return os.path.join(os.fspath(save_dir), f"replica_{replica_index}")


def _install_hooks(engine: Any, state: DeepSpeedAveraging) -> None:
    for name in ("_take_model_step", "save_checkpoint", "load_checkpoint"):
        if not callable(getattr(type(engine), name, None)):
            import deepspeed

            raise NotImplementedError(
                f"DeepSpeedEngine.{name} is missing in DeepSpeed {deepspeed.__version__}; hieravg_optim.deepspeed "
                "is written for DeepSpeed 0.19. Use HierarchicalAveragingOptimizer with plain DDP instead."
            )
    original_take_model_step = engine._take_model_step
    original_save = engine.save_checkpoint
    original_load = engine.load_checkpoint

    def _take_model_step(*args: Any, **kwargs: Any) -> Any:
        out = original_take_model_step(*args, **kwargs)
        state.after_engine_step()
        return out

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        folder = replica_checkpoint_dir(save_dir, state.replica_index)
        os.makedirs(folder, exist_ok=True)
        client = dict(client_state or {})
        client[CHECKPOINT_KEY] = state.state_dict()
        out = original_save(
            folder,
            tag=tag,
            client_state=client,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        if save_latest and state.replica_index > 0 and state.mpu.get_data_parallel_rank() == 0:
            # DeepSpeed writes "latest" on global rank 0 only, i.e. for replica 0.
            saved_tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
            with open(os.path.join(folder, "latest"), "w") as fd:
                fd.write(saved_tag)
        dist.barrier()
        return out

    def load_checkpoint(load_dir, tag=None, *args: Any, **kwargs: Any):
        folder = replica_checkpoint_dir(load_dir, state.replica_index)
        load_path, client_state = original_load(folder, tag, *args, **kwargs)
        # DeepSpeed only logs a warning for a missing checkpoint: a replica without one (resuming with more
        # replicas than were saved) would silently start from fresh weights while the others resume.
        _agree_across_ranks(
            f"whether their replica found a checkpoint under {os.fspath(load_dir)}/replica_<k> (True: found)",
            load_path is not None,
            None,
            fix="Every replica loads its own folder: resume with the world size and ranks_per_replica that saved "
            "the checkpoint, or on none of the replicas.",
        )
        if load_path is None:
            return load_path, client_state
        client_state = dict(client_state or {})
        saved = client_state.pop(CHECKPOINT_KEY, None)
        if saved is None:
            warnings.warn(
                f"The checkpoint {load_path} has no hierarchical averaging state; the averaging schedule resumes "
                f"at the engine's global step {engine.global_steps}.",
                UserWarning,
                stacklevel=2,
            )
            saved = {"step": engine.global_steps}
        state.load_state_dict(saved)
        return load_path, client_state

    engine._take_model_step = _take_model_step
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


# --------------------------------------------------------------------------------------------------
# initialize
# --------------------------------------------------------------------------------------------------
def _load_config(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    return _read_config(config)


def _read_config(config: Any) -> dict[str, Any]:
    """Read a config as DeepSpeedConfig does: an (H)JSON path, else a base64-encoded (H)JSON string."""
    import base64

    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    path = os.fspath(config) if isinstance(config, (str, os.PathLike)) else None
    if path is not None and os.path.exists(path):
        with open(path) as f:
            return dict(hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys))
    try:
        return dict(hjson.loads(base64.urlsafe_b64decode(config).decode("utf-8")))
    except Exception:  # noqa: BLE001 - reported below as DeepSpeed does
        raise ValueError(
            f"Expected a path to an existing DeepSpeed config, a dict, or a base64 string; got {config!r}."
        ) from None


def _check_batch_size(ds_config: Mapping[str, Any], dp_size: int) -> None:
    tb = ds_config.get("train_batch_size")
    mb = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (tb, mb, gas)) and tb != mb * gas * dp_size:
        raise ValueError(
            f"train_batch_size={tb} must equal train_micro_batch_size_per_gpu ({mb}) x gradient_accumulation_steps "
            f"({gas}) x the ranks of one replica ({dp_size}) = {mb * gas * dp_size}: with hierarchical averaging, "
            "DeepSpeed's data-parallel group is one replica. Remove train_batch_size or set it to that value."
        )


def _shard_over_world(engine: Any, dataloader: Any, training_data: Any, collate_fn: Callable | None) -> Any:
    """Rebuild DeepSpeed's training data loader so that every rank, not every replica rank, gets its own shard.

    DeepSpeed shards ``training_data`` over its data-parallel group, which is one replica: the
    replicas would then all see the same samples. With the default ``DistributedSampler`` the
    loader is rebuilt with ``num_replicas`` = world size and ``rank`` = global rank.
    """
    if dataloader is None or training_data is None:
        return dataloader
    sampler = getattr(dataloader, "data_sampler", None)
    if type(sampler) is not torch.utils.data.DistributedSampler:
        warnings.warn(
            f"DeepSpeed's training data loader uses a {type(sampler).__name__}, sharded over one replica only: "
            "every replica sees the same samples. Shard the data over all ranks yourself.",
            UserWarning,
            stacklevel=3,
        )
        return dataloader
    world_sampler = torch.utils.data.DistributedSampler(
        training_data, num_replicas=dist.get_world_size(), rank=dist.get_rank()
    )
    engine.training_dataloader = engine.deepspeed_io(training_data, data_sampler=world_sampler, collate_fn=collate_fn)
    return engine.training_dataloader


def _local_averaging_config(
    settings: SectionSettings, ds_config: Mapping[str, Any], model: Any, optimizer: Any, mpu: Any, mesh_param: Any
) -> AveragingConfig | None:
    """The core config of an enabled section (``None`` if disabled), after every check that needs no collective."""
    from deepspeed.runtime.pipe.module import PipelineModule

    if not settings.enabled:
        return None
    if mpu is not None:
        raise NotImplementedError(
            "hierarchical averaging builds its own mpu (one data-parallel group per replica) and cannot be "
            "combined with model/tensor/pipeline parallelism from an mpu. Remove the mpu, or remove the "
            f'"{SECTION}" section.'
        )
    if mesh_param is not None or "sequence_parallel_size" in ds_config:
        raise NotImplementedError(
            "hierarchical averaging does not support sequence parallelism (mesh_param / sequence_parallel_size). "
            f'Remove it, or remove the "{SECTION}" section.'
        )
    if isinstance(model, PipelineModule):
        raise NotImplementedError(
            "hierarchical averaging does not support pipeline parallelism (PipelineModule). Use a plain "
            f'nn.Module, or remove the "{SECTION}" section.'
        )
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise NotImplementedError(
            "the model was built under deepspeed.zero.Init, which partitions it over the whole world before "
            "the replicas exist. Build it without zero.Init (ZeRO-3 still partitions it within each replica)."
        )
    if optimizer is None and "optimizer" not in ds_config:
        raise ValueError(
            "hierarchical averaging needs an optimizer to average after: pass optimizer=..., or give the "
            'config an "optimizer" section.'
        )
    rpr = _resolve_ranks_per_replica(settings)
    averaging_config = settings.averaging_config(rpr)
    _check_batch_size(ds_config, rpr)
    return averaging_config


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | os.PathLike | Mapping[str, Any] | None = None,
):
    """:func:`deepspeed.initialize`, plus hierarchical averaging from the config's ``"hierarchical_averaging"``.

    Same arguments and same return value as :func:`deepspeed.initialize` (DeepSpeed 0.19).
    The config (``config``, ``config_params`` or ``args.deepspeed_config``, a dict, a JSON
    path or a base64 string) may have a top-level ``"hierarchical_averaging"`` section:

    * ``period_group_size`` (required): JSON object ``{"period": group_size}``; every
      ``period`` engine optimizer steps, blocks of ``group_size`` consecutive ranks average.
      Periods strictly increasing; the last group size is the world size; every group size
      a multiple of ``ranks_per_replica``.
    * ``warmup_steps`` (default 0): engine optimizer steps that never average.
    * ``ranks_per_replica`` (default ``"auto"``: ``LOCAL_WORLD_SIZE`` or the launcher's
      ``LOCAL_SIZE``, the ranks of one node): consecutive ranks that form one DeepSpeed
      data-parallel group (gradients reduced every step, ZeRO partitions within it).
    * ``bucket_cap_mb`` (default 25): communication bucket size, in MB.
    * ``enabled`` (default true): false ignores the section.

    The section is removed before the config reaches DeepSpeed. The batch size keys then
    count one replica: ``train_batch_size = train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x ranks_per_replica``.

    Without the section, or with ``"enabled": false``, this is exactly :func:`deepspeed.initialize`,
    after one agreement across ranks (an all-gather of two int64 per rank over the default group),
    so that a section present on some ranks only is a ``RuntimeError`` on every rank.

    With it, the engine also gets ``engine.hierarchical_averaging`` (a :class:`DeepSpeedAveraging`),
    counts one averaging step per engine optimizer step (gradient-accumulation boundary,
    overflow-skipped steps included), starts every replica from replica 0's weights, shards
    ``training_data`` over all ranks (DeepSpeed alone would shard it over one replica), and its
    ``save_checkpoint`` / ``load_checkpoint`` keep each replica's state in
    ``<dir>/replica_<k>/`` with the averaging step count in the client state.

    .. warning::
        Collective over the default process group, like :func:`deepspeed.initialize`:
        every rank must call it with the same config.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``, as :func:`deepspeed.initialize`.

    Raises:
        ValueError: naming the key and the value, for an invalid section, on every rank before
            the engine is built; or for a ``train_batch_size`` that does not count one replica.
        NotImplementedError: with an ``mpu``, a ``mesh_param``, sequence parallelism, a pipeline
            module, a model built under ``deepspeed.zero.Init``, or ZeRO-3 NVMe offload.
        TypeError: on every rank, before DeepSpeed is called, for an ``optimizer`` that is a
            :class:`~hieravg_optim.HierarchicalAveragingOptimizer` (pass the inner optimizer; the
            section does the averaging).
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

    ds_kwargs: dict[str, Any] = dict(
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        mesh_param=mesh_param,
    )
    if distributed_port is not None:
        ds_kwargs["distributed_port"] = distributed_port

    # Find the config the way deepspeed.initialize does.
    source = config if config is not None else config_params
    from_args = False
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
        from_args = source is not None

    def init_distributed() -> None:
        """As deepspeed.initialize would, to know the world size and to check the section across ranks."""
        deepspeed.init_distributed(
            dist_backend=get_accelerator().communication_backend_name(),
            distributed_port=ds_kwargs.get("distributed_port", TORCH_DISTRIBUTED_DEFAULT_PORT),
            dist_init_required=dist_init_required,
        )

    initialized = dist.is_available() and dist.is_initialized()
    # Local checks: read the config, parse the section. Where torch.distributed is already initialized, a
    # failure on some ranks only (a missing config file, an invalid section) is raised on every rank, instead
    # of leaving the others waiting in the agreement below or in DeepSpeed's first collective.
    loaded: dict[str, Any] | None = None
    settings: SectionSettings | None = None
    try:
        if isinstance(optimizer, HierarchicalAveragingOptimizer):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}: DeepSpeed would replace its param_groups with its own "
                "flat partitions, a different part of the model on each rank. Pass the inner optimizer (e.g. "
                f"optimizer={type(optimizer).__name__}(...).optimizer, or the torch.optim.AdamW you wrapped) "
                f'and give the config a "{SECTION}" section: the section does the averaging.'
            )
        loaded = _load_config(source) if source is not None else None
        if loaded is not None and SECTION in loaded:
            settings = parse_section(loaded[SECTION])
            ds_config = {k: v for k, v in loaded.items() if k != SECTION}
            averaging_config = _local_averaging_config(settings, ds_config, model, optimizer, mpu, mesh_param)
    except Exception as exc:  # noqa: BLE001 - raised on every rank
        if not initialized:
            raise
        _raise_on_every_rank(exc, None, f'the DeepSpeed config and its "{SECTION}" section')

    agreement = f'the "{SECTION}" section (ranks_per_replica resolved)'
    agreement_fix = (
        'Give every rank the same section; with "ranks_per_replica": "auto" (LOCAL_WORLD_SIZE, the ranks of '
        'one node) every node must run the same number of ranks, else set "ranks_per_replica" explicitly.'
    )
    if settings is None:
        # Plain DeepSpeed, after the same agreement as the ranks that have the section: a section present on
        # some ranks only is then a RuntimeError on every rank, not a collective paired with DeepSpeed's.
        # Without any config DeepSpeed raises its own error; the agreement then only runs when another
        # rank may be waiting in it.
        if loaded is not None or initialized:
            init_distributed()
            _agree_across_ranks(agreement, "disabled" if loaded is not None else "no config", None, fix=agreement_fix)
        return deepspeed.initialize(args=args, config=config, config_params=config_params, **ds_kwargs)

    init_distributed()
    error: BaseException | None = None
    if averaging_config is not None:
        try:
            averaging_config.check_world_size(dist.get_world_size())
        except ValueError as exc:
            origin = (
                f'"ranks_per_replica": "auto" resolved to {averaging_config.ranks_per_replica} from '
                f"{_auto_ranks_per_replica_source()} (the ranks of one node); set it explicitly if that is not "
                "what you want"
                if settings.ranks_per_replica is None
                else f'"ranks_per_replica": {settings.ranks_per_replica}'
            )
            error = ValueError(
                f'DeepSpeed config section "{SECTION}", key "period_group_size" {dict(settings.period_group_size)} '
                f"with {origin}, world size {dist.get_world_size()}: {exc}"
            )
    # Every rank must resolve the same settings ("auto" follows LOCAL_WORLD_SIZE, which differs between
    # nodes running different numbers of ranks) before any replica group is created: else new_group hangs.
    _agree_across_ranks(
        agreement,
        asdict(averaging_config) if averaging_config is not None else "disabled",
        None,
        error=error,
        fix=agreement_fix,
    )
    rpr = averaging_config.ranks_per_replica if averaging_config is not None else 0

    def _build(extra: dict[str, Any]):
        call = dict(ds_kwargs)
        call.update(extra)
        if from_args:
            saved = (getattr(args, "deepspeed_config", None), getattr(args, "deepscale_config", None))
            try:
                args.deepspeed_config = None
                if hasattr(args, "deepscale_config"):
                    args.deepscale_config = None
                return deepspeed.initialize(args=args, config=ds_config, **call)
            finally:
                args.deepspeed_config = saved[0]
                if hasattr(args, "deepscale_config"):
                    args.deepscale_config = saved[1]
        return deepspeed.initialize(args=args, config=ds_config, **call)

    if not settings.enabled:
        return _build({})

    replica_mpu = ReplicaParallelUnit(rpr)
    engine, ds_optimizer, dataloader, scheduler = _build({"mpu": replica_mpu})
    assert engine.optimizer is not None, "DeepSpeed built no optimizer although one was given"
    dataloader = _shard_over_world(engine, dataloader, training_data, collate_fn)
    state = DeepSpeedAveraging(engine, averaging_config, replica_mpu)
    state.broadcast_from_first_replica()
    _install_hooks(engine, state)
    engine.__dict__["hierarchical_averaging"] = state
    if dist.get_rank() == 0:
        logger.info(
            "hierarchical averaging on DeepSpeed: %d replicas of %d ranks (ZeRO stage %d, %s); levels %s, warmup %d",
            dist.get_world_size() // rpr,
            rpr,
            engine.zero_optimization_stage(),
            state.kind,
            [(lv.period, lv.group_size) for lv in averaging_config.levels],
            averaging_config.warmup_steps,
        )
    return engine, ds_optimizer, dataloader, scheduler

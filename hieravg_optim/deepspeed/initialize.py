"""``initialize``: :func:`deepspeed.initialize` plus the averaging of the config's ``"hierarchical_averaging"`` section.

:func:`initialize` runs in named steps: read the config and check everything local on
every rank (:func:`_check_locally`, no collective); agree across ranks, in one collective
(:func:`_agree`); then build the engine, plain (:func:`_deepspeed_initialize`) or with
the replica mpu and the averaging attached (:func:`_initialize_with_averaging`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..agreement import agree_across_ranks, raise_on_every_rank
from ..config import AveragingConfig, warn_at_caller
from ..optimizer import HierarchicalAveragingOptimizer
from .engine import DeepSpeedAveraging, attach
from .mpu import ReplicaParallelUnit
from .section import (
    SECTION,
    SectionSettings,
    check_world_size,
    load_config,
    parse_section,
    resolve_ranks_per_replica,
)

__all__ = ["initialize"]

logger = logging.getLogger(__name__)

_AGREEMENT = f'the "{SECTION}" section (ranks_per_replica resolved)'
"""What the ranks agree on in :func:`initialize`, as its error messages name it."""

_AGREEMENT_FIX = (
    'Give every rank the same section; with "ranks_per_replica": "auto" (LOCAL_WORLD_SIZE, the ranks of '
    'one node) every node must run the same number of ranks, else set "ranks_per_replica" explicitly.'
)


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
    * ``comm_dtype`` (default: each tensor's own dtype): the dtype tensors travel in, one name
      (``"float32"``, ``"bf16"``, ``"fp16"``, ``"float64"``) or ``{"period": name}`` per level, e.g.
      ``{"64": "bf16"}``; ZeRO's fp32 partitions stay fp32, only the wire copy is rounded.
    * ``ranks_per_node`` (default null: flat): ranks of one node, or ``"auto"``; levels spanning
      several nodes then average node-aware (reduce-scatter in the node, all-reduce across nodes,
      all-gather in the node).
    * ``enabled`` (default true): false ignores the section.

    The section is removed before the config reaches DeepSpeed. The batch size keys then
    count one replica: ``train_batch_size = train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x ranks_per_replica``.

    Without the section, or with ``"enabled": false``, this is exactly :func:`deepspeed.initialize`,
    after one agreement across ranks (an all-gather of two int64 per rank over the default group),
    so that a section present on some ranks only is a ``RuntimeError`` on every rank. With the
    section, that one agreement also covers the resolved settings, before any group is created.

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
    source, from_args = _find_config(args, config, config_params)
    initialized = dist.is_available() and dist.is_initialized()
    local = _check_locally(source, model, optimizer, mpu, mesh_param, initialized)
    # Without any config DeepSpeed raises its own error; the agreement then only runs when another rank
    # may be waiting in it.
    if local.loaded is not None or initialized:
        _init_distributed(ds_kwargs)
        _agree(local)
    if local.settings is None:
        return deepspeed.initialize(args=args, config=config, config_params=config_params, **ds_kwargs)
    if local.averaging_config is None:  # "enabled": false
        return _deepspeed_initialize(args, from_args, local.ds_config, ds_kwargs)
    return _initialize_with_averaging(
        local.averaging_config, args, from_args, local.ds_config, ds_kwargs, training_data, collate_fn
    )


@dataclass(slots=True)
class _Local:
    """What this rank found before any collective."""

    loaded: dict[str, Any] | None = None
    """The whole config; ``None`` when none was given."""
    settings: SectionSettings | None = None
    """The parsed section; ``None`` when the config has none."""
    ds_config: dict[str, Any] | None = None
    """The config without the section, for DeepSpeed; ``None`` when the config has no section."""
    averaging_config: AveragingConfig | None = None
    """The core config, ``ranks_per_replica`` resolved; ``None`` without a section or with ``"enabled": false``."""


def _find_config(args: Any, config: Any, config_params: Any) -> tuple[Any, bool]:
    """The config as :func:`deepspeed.initialize` finds it, and whether it came from ``args``."""
    source = config if config is not None else config_params
    from_args = False
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
        from_args = source is not None
    return source, from_args


def _check_locally(source: Any, model: Any, optimizer: Any, mpu: Any, mesh_param: Any, initialized: bool) -> _Local:
    """Read the config, parse the section and check the arguments, on this rank alone.

    Where torch.distributed is already initialized, a failure on some ranks only (a missing config
    file, an invalid section) is raised on every rank, instead of leaving the others waiting in
    :func:`_agree` or in DeepSpeed's first collective.
    """
    local = _Local()
    try:
        if isinstance(optimizer, HierarchicalAveragingOptimizer):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}: DeepSpeed would replace its param_groups with its own "
                "flat partitions, a different part of the model on each rank. Pass the inner optimizer (e.g. "
                f"optimizer={type(optimizer).__name__}(...).optimizer, or the torch.optim.AdamW you wrapped) "
                f'and give the config a "{SECTION}" section: the section does the averaging.'
            )
        local.loaded = load_config(source) if source is not None else None
        if local.loaded is not None and SECTION in local.loaded:
            local.settings = parse_section(local.loaded[SECTION])
            local.ds_config = {k: v for k, v in local.loaded.items() if k != SECTION}
            local.averaging_config = _local_averaging_config(
                local.settings, local.ds_config, model, optimizer, mpu, mesh_param
            )
    except Exception as exc:  # noqa: BLE001 - raised on every rank
        if not initialized:
            raise
        raise_on_every_rank(exc, None, f'the DeepSpeed config and its "{SECTION}" section')
    return local


def _init_distributed(ds_kwargs: Mapping[str, Any]) -> None:
    """As deepspeed.initialize would, to know the world size and to check the section across ranks."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=ds_kwargs.get("distributed_port", TORCH_DISTRIBUTED_DEFAULT_PORT),
        dist_init_required=ds_kwargs["dist_init_required"],
    )


def _agree(local: _Local) -> None:
    """Check the levels against the world size, then agree across ranks: the one collective before the engine.

    Every rank must resolve the same settings ("auto" follows LOCAL_WORLD_SIZE, which differs between
    nodes running different numbers of ranks) before any replica group is created: else new_group hangs.
    Ranks without the section join too (as ``"disabled"``), so that a section present on some ranks only
    is a RuntimeError on every rank, not a collective paired with DeepSpeed's.

    .. warning::
        Collective over the default process group: an all-gather of two int64 per rank.
    """
    error: BaseException | None = None
    if local.averaging_config is not None:
        try:
            check_world_size(local.settings, local.averaging_config, dist.get_world_size())
        except ValueError as exc:
            error = exc
        value: object = asdict(local.averaging_config)
    else:
        value = "disabled" if local.loaded is not None else "no config"
    agree_across_ranks(_AGREEMENT, value, None, error=error, fix=_AGREEMENT_FIX)


def _deepspeed_initialize(
    args: Any, from_args: bool, ds_config: dict[str, Any], ds_kwargs: Mapping[str, Any], **extra: Any
):
    """:func:`deepspeed.initialize` with the config stripped of the section (``args``' config hidden meanwhile)."""
    import deepspeed

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


def _initialize_with_averaging(
    averaging_config: AveragingConfig,
    args: Any,
    from_args: bool,
    ds_config: dict[str, Any],
    ds_kwargs: Mapping[str, Any],
    training_data: Any,
    collate_fn: Callable | None,
):
    """The engine over the replica mpu, with the averaging attached; every replica starts from replica 0."""
    rpr = averaging_config.ranks_per_replica
    replica_mpu = ReplicaParallelUnit(rpr)
    engine, ds_optimizer, dataloader, scheduler = _deepspeed_initialize(
        args, from_args, ds_config, ds_kwargs, mpu=replica_mpu
    )
    assert engine.optimizer is not None, "DeepSpeed built no optimizer although one was given"
    dataloader = _shard_over_world(engine, dataloader, training_data, collate_fn)
    # Checked against the world size and agreed on in _agree: the averager's own agreement would repeat it.
    state = DeepSpeedAveraging(engine, averaging_config, replica_mpu, agreed=True)
    state.broadcast_from_first_replica()
    attach(engine, state)
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
        warn_at_caller(
            f"DeepSpeed's training data loader uses a {type(sampler).__name__}, sharded over one replica only: "
            "every replica sees the same samples. Shard the data over all ranks yourself."
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
    rpr = resolve_ranks_per_replica(settings)
    averaging_config = settings.averaging_config(rpr)
    _check_batch_size(ds_config, rpr)
    return averaging_config

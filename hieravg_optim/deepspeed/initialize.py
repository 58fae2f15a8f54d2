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
from ..outer import OuterFactory
from .engine import DeepSpeedAveraging
from .hooks import attach
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
    *,
    average_buffers: bool | None = None,
    collective_timeout_s: float | None = None,
    nonfinite: str | None = None,
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
    * ``average_buffers`` (default true): average the module's floating-point buffers
      (BatchNorm running statistics) with the weights: broadcast from rank 0 at the start
      and, at each round, replaced by their mean over the level's whole block of ranks (see
      :class:`~hieravg_optim.deepspeed.DeepSpeedAveraging`). On by default because DDP keeps
      buffers equal on every rank and plain DeepSpeed leaves them different on every rank;
      false keeps them local to each rank, as DeepSpeed does.
    * ``synchronous_warmup`` (default true): during the warm-up, average all replicas after every
      engine optimizer step (one top-level round per step), so that the warm-up is synchronous
      across replicas as in post-local SGD; false: warm-up steps never average (the replicas
      train apart until ``warmup_steps``).
    * ``average_frozen`` (default false): also average the module's parameters with
      ``requires_grad=False`` (ZeRO 0-2; ZeRO-3 with a frozen parameter raises
      ``NotImplementedError``); false: they are never sent and never changed by averaging.
    * ``collective_timeout_s`` (default null: the default group's timeout): timeout of the averaging
      subgroups' collectives, in seconds; a hung peer is reported after it (see ``docs/faults.md``).
    * ``nonfinite`` (default ``"raise"``): ``"raise"``, ``"skip_replica"`` or ``"ignore"``, what a
      round does when a replica's master weights hold a NaN or an infinity (see
      :class:`~hieravg_optim.HierarchicalAveragingOptimizer`).
    * ``comm_dtype`` (default: each tensor's own dtype): the dtype tensors travel in, one name
      (``"float32"``, ``"bf16"``, ``"fp16"``, ``"float64"``) or ``{"period": name}`` per level, e.g.
      ``{"64": "bf16"}``; ZeRO's fp32 partitions stay fp32, only the wire copy is rounded.
    * ``ranks_per_node`` (default null: flat): ranks of one node, or ``"auto"``; levels spanning
      several nodes then average node-aware (reduce-scatter in the node, all-reduce across nodes,
      all-gather in the node).
    * ``outer_optimizer`` (default: none): ``{"period": {"type": name, "params": {...}}}``, an outer
      optimizer for that level (DiLoCo, https://arxiv.org/abs/2311.08105), in the form of DeepSpeed's
      ``"optimizer"`` section: ``type`` names a ``torch.optim`` class (``"SGD"``; also without regard to
      case, ``"sgd"``), ``params`` its keyword arguments, e.g. ``{"64": {"type": "SGD", "params":
      {"lr": 0.7, "momentum": 0.9, "nesterov": true}}}``. That level's round then takes one step of
      it on ``anchor - mean`` of this rank's fp32 master partitions (see ``docs/outer.md``); the
      levels without an entry average.
    * ``outer_state_device`` (default null: with the master weights): ``"cpu"`` keeps the anchors and
      the outer optimizer state in host memory.
    * ``enabled`` (default true): false ignores the section.

    ``average_buffers``, ``collective_timeout_s`` and ``nonfinite`` may also be passed as keywords
    (the section's meaning, the same on every rank);
    a keyword and a different value in the section are a ``ValueError``, and so is a keyword without
    an enabled section.

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
    ``<dir>/replica_<k>/`` with the averaging step count in the client state. Under ZeRO-3,
    DeepSpeed's check that every rank's forward used the submodules in the same order compares
    the ranks of one replica instead of the whole world (see
    :func:`~hieravg_optim.deepspeed.hooks.keep_trace_checks_in_replica`): replicas may take
    different branches.

    .. warning::
        Collective over the default process group, like :func:`deepspeed.initialize`:
        every rank must call it with the same config.

    Args:
        average_buffers: The section's ``"average_buffers"``, as a keyword (``True`` or ``False``);
            ``None``: not given. See the keyword rule above.
        collective_timeout_s: The section's ``"collective_timeout_s"``, as a keyword (seconds).
        nonfinite: The section's ``"nonfinite"``, as a keyword.

        The other arguments are :func:`deepspeed.initialize`'s.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``, as :func:`deepspeed.initialize`.

    Raises:
        ValueError: naming the key and the value, for an invalid section or keyword, a keyword that
            differs from the section's value, or a keyword without an enabled section, on every rank
            before the engine is built; for a
            ``train_batch_size`` that does not count one replica; for an ``optimizer`` with an empty
            parameter group together with an ``lr_scheduler`` instance (DeepSpeed drops the group
            from the optimizer only: pass the scheduler as a callable, or drop the group).
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
    overrides = {
        k: v
        for k, v in (
            ("average_buffers", average_buffers),
            ("collective_timeout_s", collective_timeout_s),
            ("nonfinite", nonfinite),
        )
        if v is not None
    }
    local = _check_locally(source, model, optimizer, mpu, mesh_param, initialized, overrides, lr_scheduler)
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
        local.averaging_config,
        args,
        from_args,
        local.ds_config,
        ds_kwargs,
        training_data,
        collate_fn,
        average_buffers=local.settings.average_buffers,
        average_frozen=local.settings.average_frozen,
        outer_optimizers=local.settings.outer_optimizers(),
        outer_state_device=local.settings.outer_state_device,
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


def _check_locally(
    source: Any,
    model: Any,
    optimizer: Any,
    mpu: Any,
    mesh_param: Any,
    initialized: bool,
    overrides: Mapping[str, Any] | None = None,
    lr_scheduler: Any = None,
) -> _Local:
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
            local.settings = _with_overrides(parse_section(local.loaded[SECTION]), local.loaded[SECTION], overrides)
            local.ds_config = {k: v for k, v in local.loaded.items() if k != SECTION}
            local.averaging_config = _local_averaging_config(
                local.settings, local.ds_config, model, optimizer, mpu, mesh_param
            )
            if local.averaging_config is not None:
                _check_empty_groups(optimizer, lr_scheduler)
        if overrides and local.averaging_config is None:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in overrides.items())} given to initialize(), but the config has no "
                f'enabled "{SECTION}" section: add one with "period_group_size", or drop the keyword.'
            )
    except Exception as exc:  # noqa: BLE001 - raised on every rank
        if not initialized:
            raise
        raise_on_every_rank(exc, None, f'the DeepSpeed config and its "{SECTION}" section')
    return local


def _with_overrides(
    settings: SectionSettings, section: Mapping[str, Any], overrides: Mapping[str, Any] | None
) -> SectionSettings:
    """``settings`` with the keywords of :func:`initialize` that are given; a different value in the section is an error.

    Raises:
        ValueError: naming the key, for a keyword that is invalid or differs from the section's value.
    """
    if not overrides:
        return settings
    merged = dict(section)
    for key, value in overrides.items():
        if key in section and section[key] != value:
            raise ValueError(
                f'initialize({key}={value!r}) differs from the "{SECTION}" section\'s "{key}": {section[key]!r}. '
                "Give it in one place."
            )
        merged[key] = value
    return parse_section(merged)


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
        value: object = {
            **asdict(local.averaging_config),
            "average_buffers": local.settings.average_buffers,
            "average_frozen": local.settings.average_frozen,
            "outer_optimizer": local.settings.outer_optimizer,
            "outer_state_device": local.settings.outer_state_device,
        }
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
    *,
    average_buffers: bool,
    average_frozen: bool,
    outer_optimizers: Mapping[int, OuterFactory] | None = None,
    outer_state_device: str | None = None,
):
    """The engine over the replica mpu, with the averaging attached; every replica starts from replica 0.

    With outer optimizers and no warm-up, the anchors are taken right after that broadcast.
    """
    rpr = averaging_config.ranks_per_replica
    # The replica groups serve the averaging too (the finiteness vote, the buffers): its timeout.
    replica_mpu = ReplicaParallelUnit(rpr, timeout_s=averaging_config.collective_timeout_s)
    engine, ds_optimizer, dataloader, scheduler = _deepspeed_initialize(
        args, from_args, ds_config, ds_kwargs, mpu=replica_mpu
    )
    assert engine.optimizer is not None, "DeepSpeed built no optimizer although one was given"
    dataloader = _shard_over_world(engine, dataloader, training_data, collate_fn)
    # Checked against the world size and agreed on in _agree: the averager's own agreement would repeat it.
    # Every replica starts from replica 0 (then the anchors, with outer optimizers and no warm-up).
    state = DeepSpeedAveraging(
        engine,
        averaging_config,
        replica_mpu,
        agreed=True,
        average_buffers=average_buffers,
        average_frozen=average_frozen,
        outer_optimizers=outer_optimizers,
        outer_state_device=outer_state_device,
    )
    attach(engine, state)  # the step hook, per-replica checkpoints, ZeRO-3's trace check within the replica
    if dist.get_rank() == 0:
        logger.info(
            "hierarchical averaging on DeepSpeed: %d replicas of %d ranks (ZeRO stage %d, %s); levels %s, warmup %d, "
            "outer optimizers %s",
            dist.get_world_size() // rpr,
            rpr,
            engine.zero_optimization_stage(),
            state.kind,
            [(lv.period, lv.group_size) for lv in averaging_config.levels],
            averaging_config.warmup_steps,
            {period: f.func.__name__ for period, f in (outer_optimizers or {}).items()} or None,
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


def _check_empty_groups(optimizer: Any, lr_scheduler: Any) -> None:
    """An empty parameter group with a client scheduler *instance* is a ValueError naming the group.

    DeepSpeed (``DeepSpeedEngine._configure_optimizer``) removes the parameter groups without
    parameters from the client optimizer, after the scheduler was built on all of them: the
    scheduler's per-group lists are then one longer than ``param_groups`` and its first step, in the
    first ``engine.step()``, fails (``zip() argument 2 is longer than argument 1``). A scheduler
    given as a callable is built by DeepSpeed on the optimizer without the empty groups, and works.
    """
    if lr_scheduler is None or callable(lr_scheduler) or not hasattr(optimizer, "param_groups"):
        return
    empty = [i for i, group in enumerate(optimizer.param_groups) if len(group["params"]) == 0]
    if empty:
        raise ValueError(
            f"optimizer parameter group {empty[0]} has no parameters (empty groups: {empty}) and lr_scheduler is a "
            f"{type(lr_scheduler).__name__} built on all {len(optimizer.param_groups)} groups: DeepSpeed removes the "
            "empty groups from the optimizer but not from the scheduler, whose first step then fails. Remove the "
            "empty groups before building the optimizer and the scheduler, or pass the scheduler as a callable, "
            f"e.g. lr_scheduler=lambda opt: {type(lr_scheduler).__name__}(opt, ...), which DeepSpeed builds on the "
            "optimizer without them."
        )


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
    _check_outer_state_device(settings.outer_state_device)
    return averaging_config


def _check_outer_state_device(device: str | None) -> None:
    """``"outer_state_device"`` must be the CPU or DeepSpeed's accelerator.

    Raises:
        ValueError: naming the key, for another device type (e.g. ``"cuda"`` on DeepSpeed's CPU accelerator).
    """
    from deepspeed.accelerator import get_accelerator

    if device is None:
        return
    accelerator = get_accelerator().device_name()
    if torch.device(device).type not in ("cpu", accelerator):
        allowed = " or ".join(repr(d) for d in dict.fromkeys(("cpu", accelerator)))
        raise ValueError(
            f'DeepSpeed config section "{SECTION}": key "outer_state_device" is {device!r}, but DeepSpeed runs on '
            f"its {accelerator!r} accelerator: use {allowed}, or null (with the master weights)."
        )

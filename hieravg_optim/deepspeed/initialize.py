"""``initialize``: :func:`deepspeed.initialize` plus the averaging of the config's ``"hierarchical_averaging"`` section.

:func:`initialize` runs in named steps: read the config and check everything local on
every rank (:func:`~hieravg_optim.deepspeed.local.check_locally`, no collective); agree across ranks, in one collective
(:func:`_agree`); then build the engine, plain (:func:`_deepspeed_initialize`) or with
the replica mpu and the averaging attached (:func:`_initialize_with_averaging`).

:func:`install` makes every :func:`deepspeed.initialize` call of the process this :func:`initialize`:
Hugging Face's ``Trainer``, ``accelerate`` and Lightning look ``deepspeed.initialize`` up on the
``deepspeed`` module at the call. DeepSpeed's own function is kept (:func:`plain_initialize`), and
:func:`uninstall` puts it back. ``python -m hieravg_optim.run`` calls :func:`install` before the script.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..agreement import agree_across_ranks
from .._validation import warn_at_caller
from ..config import AveragingConfig
from .engine import DeepSpeedAveraging
from .hooks import attach
from .local import Local, check_locally, find_config
from .mpu import ReplicaParallelUnit
from .section import SECTION, check_world_size

__all__ = ["initialize", "install", "installed", "plain_initialize", "uninstall"]

logger = logging.getLogger(__name__)

_plain: Callable[..., Any] | None = None
"""DeepSpeed's own ``deepspeed.initialize`` while :func:`install` is in effect; ``None`` otherwise."""

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
    path or a base64 string) may have a top-level ``"hierarchical_averaging"`` section, whose keys
    are the fields of :class:`~hieravg_optim.AveragingConfig` (``period_group_size``, required, for
    its levels; ``outer_optimizer`` for its outer optimizers, in the form of DeepSpeed's
    ``"optimizer"`` section) plus ``enabled``, ``average_buffers`` and ``"auto"`` for
    ``ranks_per_replica`` (the default: the ranks of one node). The keys, their defaults and what
    differs from the core are listed in ``docs/deepspeed.md``.

    ``average_buffers``, ``collective_timeout_s`` and ``nonfinite`` may also be passed as keywords
    (the section's meaning, the same on every rank); a keyword and a different value in the section
    are a ``ValueError``, and so is a keyword without an enabled section.

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
    source, from_args = find_config(args, config, config_params)
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
    local = check_locally(source, model, optimizer, mpu, mesh_param, initialized, overrides, lr_scheduler)
    # Without any config DeepSpeed raises its own error; the agreement then only runs when another rank
    # may be waiting in it.
    if local.loaded is not None or initialized:
        _init_distributed(ds_kwargs)
        _agree(local)
    if local.settings is None:
        return plain_initialize()(args=args, config=config, config_params=config_params, **ds_kwargs)
    if local.averaging_config is None:  # "enabled": false, or no optimizer
        return _deepspeed_initialize(args, from_args, local.ds_config, ds_kwargs)
    averaging = local.averaging_config
    return _initialize_with_averaging(
        averaging,
        args,
        from_args,
        local.ds_config,
        ds_kwargs,
        training_data,
        collate_fn,
        average_buffers=local.settings.average_buffers,
    )


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


def _agree(local: Local) -> None:
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
        except Exception as exc:  # noqa: BLE001 - any error of the check (a warning as error too), on every rank
            error = exc
        value: object = {**local.averaging_config.agreement_value(), "average_buffers": local.settings.average_buffers}
    else:
        value = "disabled" if local.loaded is not None else "no config"
    agree_across_ranks(_AGREEMENT, value, None, error=error, fix=_AGREEMENT_FIX)


def _deepspeed_initialize(
    args: Any, from_args: bool, ds_config: dict[str, Any], ds_kwargs: Mapping[str, Any], **extra: Any
):
    """:func:`deepspeed.initialize` with the config stripped of the section (``args``' config hidden meanwhile)."""
    call = dict(ds_kwargs)
    call.update(extra)
    if from_args:
        saved = (getattr(args, "deepspeed_config", None), getattr(args, "deepscale_config", None))
        try:
            args.deepspeed_config = None
            if hasattr(args, "deepscale_config"):
                args.deepscale_config = None
            return plain_initialize()(args=args, config=ds_config, **call)
        finally:
            args.deepspeed_config = saved[0]
            if hasattr(args, "deepscale_config"):
                args.deepscale_config = saved[1]
    return plain_initialize()(args=args, config=ds_config, **call)


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
            {period: f.func.__name__ for period, f in averaging_config.outer_optimizers.items()} or None,
        )
    return engine, ds_optimizer, dataloader, scheduler


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


def plain_initialize() -> Callable[..., Any]:
    """DeepSpeed's own ``initialize``: the one :func:`install` replaced, else ``deepspeed.initialize``."""
    import deepspeed

    return _plain if _plain is not None else deepspeed.initialize


def installed() -> bool:
    """Whether :func:`install` is in effect (``deepspeed.initialize`` is this library's)."""
    return _plain is not None


def install() -> bool:
    """Make ``deepspeed.initialize`` honour the config's ``"hierarchical_averaging"`` section, in this process.

    Sets the attribute ``deepspeed.initialize`` to :func:`hieravg_optim.deepspeed.initialize`
    (same arguments, same return value), so that every call that looks it up on the module
    (``deepspeed.initialize(...)`` in a script, HF ``Trainer`` and ``accelerate``
    (``Accelerator._prepare_deepspeed``), Lightning's ``DeepSpeedStrategy`` and Fabric) builds its
    engine with the averaging. An engine whose config has no section (or ``"enabled": false``), or
    that gets no optimizer (HF's ZeRO-3 evaluation engine), is exactly what DeepSpeed builds. Rank 0
    logs the levels at INFO, on the logger ``hieravg_optim.deepspeed.initialize``, for every engine
    that averages.

    Idempotent; local (no collective). Call it on every rank, before the framework builds the engine.

    Returns:
        True if this call installed it, False if it was already installed.

    Warns:
        UserWarning: naming each module global that is DeepSpeed's ``initialize`` bound by name
            before this call (``from deepspeed import initialize``): calls through it ignore the
            section. Import that module after :func:`install` (or launch with
            ``python -m hieravg_optim.run``), or call ``deepspeed.initialize`` through the module.
    """
    global _plain
    import deepspeed

    if _plain is not None:
        return False
    original = deepspeed.initialize
    bound = _bound_by_name(original)
    _plain = original
    deepspeed.initialize = initialize
    if bound:
        warn_at_caller(
            f"{', '.join(bound)} {'is' if len(bound) == 1 else 'are'} deepspeed.initialize, bound by name before "
            "hieravg_optim.deepspeed.install(): calls through "
            f"{'it' if len(bound) == 1 else 'them'} ignore the \"hierarchical_averaging\" section. Call install() "
            "before importing the module (or launch the script with python -m hieravg_optim.run), or call "
            "deepspeed.initialize(...) through the module."
        )
    return True


def uninstall() -> bool:
    """Put DeepSpeed's own ``deepspeed.initialize`` back; engines already built keep their averaging.

    Only this library's function is replaced: if something replaced ``deepspeed.initialize`` after
    :func:`install` (another library's wrapper, which may call this library's), both stay in place, with a
    warning; putting DeepSpeed's back would drop that wrapper. Local (no collective).

    Returns:
        True if this call uninstalled it, False if it was not installed or was left in place.

    Warns:
        UserWarning: when ``deepspeed.initialize`` is no longer this library's function, naming it and the
            fix (undo that replacement first, then call :func:`uninstall`).
    """
    global _plain
    import deepspeed

    if _plain is None:
        return False
    current = deepspeed.initialize
    if current is not initialize:
        name = f"{getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', repr(current))}"
        warn_at_caller(
            f"deepspeed.initialize is {name}, set after hieravg_optim.deepspeed.install(): uninstall() leaves it and "
            "the hook in place (putting DeepSpeed's own back would drop it). Undo that replacement first, then call "
            "uninstall()."
        )
        return False
    deepspeed.initialize, _plain = _plain, None
    return True


def _bound_by_name(original: Callable[..., Any]) -> list[str]:
    """``module.name`` of every module global, outside DeepSpeed, that is ``original``.

    A module held under two names (multiprocessing's ``__mp_main__`` alias of ``__main__``) is named once,
    by its first name in ``sys.modules``.
    """
    found = []
    seen: set[int] = set()
    for module_name, module in list(sys.modules.items()):
        if module_name == "deepspeed" or module_name.startswith("deepspeed.") or id(module) in seen:
            continue
        seen.add(id(module))
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        found += [f"{module_name}.{name}" for name, value in list(namespace.items()) if value is original]
    return found

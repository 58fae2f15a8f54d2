"""What :func:`~hieravg_optim.deepspeed.initialize` checks on each rank alone, before any collective.

:func:`check_locally` reads the config, merges the keywords of ``initialize`` into the section, parses
it once (:func:`~hieravg_optim.deepspeed.section.parse_section`, which builds the core config) and
checks the arguments DeepSpeed is given: the layout checks of the adapter (no mpu, no sequence or
pipeline parallelism, no ``zero.Init`` model, the batch size of one replica, the outer state's device).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..agreement import raise_on_every_rank
from ..config import AveragingConfig
from ..optimizer import HierarchicalAveragingOptimizer
from .section import SECTION, SectionSettings, load_config, parse_section, resolve_ranks_per_replica

__all__ = ["Local", "check_locally", "find_config"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Local:
    """What this rank found before any collective."""

    loaded: dict[str, Any] | None = None
    """The whole config; ``None`` when none was given."""
    settings: SectionSettings | None = None
    """The parsed section; ``None`` when the config has none."""
    ds_config: dict[str, Any] | None = None
    """The config without the section, for DeepSpeed; ``None`` when the config has no section."""
    averaging_config: AveragingConfig | None = None
    """The core config, ``ranks_per_replica`` resolved; ``None`` without a section, with ``"enabled": false`` or
    without an optimizer (DeepSpeed then builds its own engine)."""


def find_config(args: Any, config: Any, config_params: Any) -> tuple[Any, bool]:
    """The config as :func:`deepspeed.initialize` finds it, and whether it came from ``args``."""
    source = config if config is not None else config_params
    from_args = False
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
        from_args = source is not None
    return source, from_args


def check_locally(
    source: Any,
    model: Any,
    optimizer: Any,
    mpu: Any,
    mesh_param: Any,
    initialized: bool,
    overrides: Mapping[str, Any] | None = None,
    lr_scheduler: Any = None,
) -> Local:
    """Read the config, parse the section and check the arguments, on this rank alone.

    Where torch.distributed is already initialized, a failure on some ranks only (a missing config
    file, an invalid section) is raised on every rank, instead of leaving the others waiting in
    :func:`~hieravg_optim.deepspeed.initialize._agree` or in DeepSpeed's first collective.
    """
    local = Local()
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
            local.settings = parse_section(_with_overrides(local.loaded[SECTION], overrides))
            local.ds_config = {k: v for k, v in local.loaded.items() if k != SECTION}
            local.averaging_config = _local_averaging_config(
                local.settings, local.ds_config, model, optimizer, mpu, mesh_param
            )
            if local.averaging_config is not None:
                _check_empty_groups(optimizer, lr_scheduler)
        if overrides and (local.settings is None or not local.settings.enabled):
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in overrides.items())} given to initialize(), but the config has no "
                f'enabled "{SECTION}" section: add one with "period_group_size", or drop the keyword.'
            )
    except Exception as exc:  # noqa: BLE001 - raised on every rank
        if not initialized:
            raise
        raise_on_every_rank(exc, None, f'the DeepSpeed config and its "{SECTION}" section')
    return local


def _with_overrides(section: Any, overrides: Mapping[str, Any] | None) -> Any:
    """The section with the keywords of :func:`initialize` that are given merged in, before it is parsed once.

    Raises:
        ValueError: naming the key, for a keyword whose value differs from the section's.
    """
    if not overrides or not isinstance(section, Mapping):
        return section
    for key, value in overrides.items():
        if key in section and section[key] != value:
            raise ValueError(
                f'initialize({key}={value!r}) differs from the "{SECTION}" section\'s "{key}": {section[key]!r}. '
                "Give it in one place."
            )
    return {**section, **overrides}


def _check_batch_size(ds_config: dict[str, Any], dp_size: int) -> None:
    """``train_batch_size`` must count one replica; one counted over the world is rewritten (in place) to that.

    HF ``Trainer`` and ``accelerate`` fill ``"train_batch_size": "auto"`` as micro batch x
    accumulation x world size; DeepSpeed's data-parallel group is one replica.

    Raises:
        ValueError: for any other value that is not micro batch x accumulation x ``dp_size``.
    """
    tb = ds_config.get("train_batch_size")
    mb = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (tb, mb, gas)) or tb == mb * gas * dp_size:
        return
    world = _world_size()
    if world is not None and tb == mb * gas * world:
        ds_config["train_batch_size"] = mb * gas * dp_size
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info(
                "train_batch_size %d counts the world (%d ranks); hierarchical averaging makes one replica of %d ranks "
                "DeepSpeed's data-parallel group: train_batch_size set to %d (micro batch %d x accumulation %d x %d)",
                tb, world, dp_size, mb * gas * dp_size, mb, gas, dp_size,
            )  # fmt: skip
        return
    raise ValueError(
        f"train_batch_size={tb} must equal train_micro_batch_size_per_gpu ({mb}) x gradient_accumulation_steps "
        f"({gas}) x the ranks of one replica ({dp_size}) = {mb * gas * dp_size}: with hierarchical averaging, "
        "DeepSpeed's data-parallel group is one replica (the world's count, "
        f"{'unknown' if world is None else mb * gas * world}, is rewritten to it). Remove train_batch_size or set it "
        "to that value."
    )


def _world_size() -> int | None:
    """The world size: the default group's, else ``WORLD_SIZE`` as the launcher set it; ``None`` if unknown."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    found = os.environ.get("WORLD_SIZE", "")
    return int(found) if found.isdigit() and int(found) > 0 else None


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
    if optimizer is None and "optimizer" not in ds_config:
        # An engine that never steps (HF's ZeRO-3 evaluation engine): DeepSpeed's own, without the section.
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info('no optimizer given: the "%s" section does not apply to this engine', SECTION)
        return None
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise NotImplementedError(
            "the model was built under deepspeed.zero.Init, which partitions it over the whole world before "
            "the replicas exist. Build it without zero.Init (ZeRO-3 still partitions it within each replica): "
            "HF Trainer: build the model before TrainingArguments (whose ZeRO-3 config turns zero.Init on in "
            "from_pretrained/from_config); accelerate: zero3_init_flag=False (DeepSpeedPlugin, or "
            "ACCELERATE_DEEPSPEED_ZERO3_INIT=false); Lightning: build the model in __init__, not configure_model."
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

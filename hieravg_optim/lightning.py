"""Lightning: hierarchical averaging under Lightning's ``DDPStrategy``, switched on by configuration alone.

Lightning loads every callback factory of the entry point group ``lightning.pytorch.callbacks_factory``
when a ``Trainer`` is built (``lightning/pytorch/trainer/connectors/callback_connector.py``). This package
declares :func:`callbacks_factory` there: with the environment variable :data:`CONFIG_ENV` set, it adds a
:class:`HierarchicalAveraging` callback; without it, nothing. The variable holds a JSON object, or the path
of a JSON file holding one, with the keys of the DeepSpeed config's ``"hierarchical_averaging"`` section
(``docs/deepspeed.md``), either as that section or as a whole config that contains it (a DeepSpeed config
can be reused as it is).

Under ``DDPStrategy`` the callback, when fitting starts:

* wraps the optimizer in a :class:`~hieravg_optim.HierarchicalAveragingOptimizer` (the training step, the
  LR schedulers and gradient clipping see the same parameter groups);
* registers :func:`hieravg_optim.ddp.register_post_local_sgd_hook` on the DDP module, on any device
  (Lightning registers its own DDP comm hooks on CUDA only): DDP all-reduces gradients over every rank
  during the warm-up, then within each replica only;
* adds every rank's module and optimizer state to Lightning's checkpoint (rank 0 writes it) and gives
  each rank its own back on resume, so a resumed run continues from the state each rank had.

Hierarchical SGD: https://arxiv.org/abs/2010.12998; post-local SGD: https://arxiv.org/abs/1808.07217.
Under ``DeepSpeedStrategy`` the section goes into the DeepSpeed config instead
(:func:`hieravg_optim.deepspeed.install`); the callback refuses that strategy. Written against Lightning 2.6.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from ._validation import warn_at_caller
from .config import AveragingConfig
from .ddp import register_post_local_sgd_hook
from .deepspeed.section import SECTION, SectionSettings, check_world_size, parse_section
from .optimizer import HierarchicalAveragingOptimizer
from .run import INSTALL_ENV

__all__ = ["CONFIG_ENV", "HierarchicalAveraging", "callbacks_factory"]

CONFIG_ENV = "HIERAVG_LIGHTNING_CONFIG"
"""The environment variable :func:`callbacks_factory` reads: a JSON object, or the path of a JSON file."""

_RANKS_KEY = "ranks"
"""Under the callback's entry of ``checkpoint["callbacks"]``: every rank's module and optimizer states."""


def callbacks_factory() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: ``[HierarchicalAveraging(...)]`` when
    :data:`CONFIG_ENV` is set, else ``[]``.

    Lightning calls it in every ``Trainer`` constructor, on every rank; it reads the variable and checks the
    section there, with no collective. Under ``python -m hieravg_optim.run`` (the variable
    :data:`hieravg_optim.run.INSTALL_ENV` set), it also calls :func:`hieravg_optim.deepspeed.install`, so that
    the ranks Lightning's own launcher starts as ``python train.py`` (without the runner) build their
    ``DeepSpeedStrategy`` engines with the section, as the first rank does.

    Raises:
        ValueError: naming the variable, if it is set but is neither a JSON object nor the path of a JSON
            file holding one, or for an invalid section (unknown key, bad value), on every rank whose
            environment has it.
    """
    if os.environ.get(INSTALL_ENV) == "1":
        import hieravg_optim.deepspeed

        hieravg_optim.deepspeed.install()  # idempotent
    value = os.environ.get(CONFIG_ENV, "").strip()
    if not value:
        return []
    return [HierarchicalAveraging(_read_config(value), source=f"{CONFIG_ENV}={value!r}")]


def _read_config(value: str) -> Mapping[str, Any]:
    """The JSON object of ``value``: inline JSON when it starts with ``{``, else the file it names."""
    if value.startswith("{"):
        text, where = value, "its value"
    else:
        if not os.path.isfile(value):
            raise ValueError(
                f"{CONFIG_ENV}={value!r} is neither a JSON object nor the path of an existing file. Set it to e.g. "
                f'\'{{"period_group_size": {{"4": 8, "16": 16}}}}\' or to a JSON file with that object.'
            )
        with open(value) as f:
            text, where = f.read(), f"file {value!r}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{CONFIG_ENV}: {where} is not valid JSON: {err}.") from None
    if not isinstance(obj, Mapping):
        raise ValueError(f"{CONFIG_ENV}: {where} must hold a JSON object, got {type(obj).__name__}.")
    return obj


class HierarchicalAveraging(Callback):
    """Hierarchical averaging of a Lightning ``DDPStrategy`` run: the optimizer wrapped, the post-local SGD hook.

    Lightning adds it by itself through :func:`callbacks_factory` when :data:`CONFIG_ENV` is set; it can
    also be passed in ``Trainer(callbacks=[...])`` (then leave the variable unset). At ``fit`` only:
    ``setup`` checks the strategy and the levels against the world size; ``on_fit_start`` (after DDP has
    wrapped the module and the optimizers exist) wraps the optimizer and registers the hook. Other
    stages (validate, test, predict) run unchanged.

    Settings (the keys of the DeepSpeed section, ``docs/deepspeed.md``): ``period_group_size`` (required),
    ``warmup_steps``, ``ranks_per_replica`` (the ranks whose gradients DDP keeps all-reducing every step
    after the warm-up; ``"auto"``, the default: Lightning's devices per node), ``average_buffers`` (default
    true: the module's floating-point buffers), ``enabled``, and every other field of
    :class:`~hieravg_optim.AveragingConfig`. ``synchronous_warmup`` defaults to false here: during the
    warm-up DDP all-reduces the gradients over every rank, which keeps the replicas equal.

    Checkpoints: ``on_save_checkpoint`` gathers every rank's ``LightningModule.state_dict()`` and optimizer
    state dict (the count and the anchors included) to rank 0, under ``checkpoint["callbacks"]
    ["HierarchicalAveraging"]["ranks"]`` (rank 0's are Lightning's own ``state_dict`` and
    ``optimizer_states``), on the CPU; rank 0 holds them all while the checkpoint is written (world size
    times the model and optimizer state). On resume each rank loads its own; the count resumes with it.

    .. warning::
        ``on_fit_start`` is collective over the default process group (it builds the averaging subgroups
        and the replicas' subgroups), and so is every checkpoint save (a gather), as Lightning requires
        ``trainer.save_checkpoint`` on every rank anyway.

    Args:
        section: The ``"hierarchical_averaging"`` section as a JSON object, or a whole config holding it.
        source: Where it came from, for the error messages (default: ``"HierarchicalAveraging(section)"``).

    Raises:
        ValueError: for an invalid section, naming the key and ``source`` (here, on every rank); at ``setup``,
            for levels that do not fit the world size, or Lightning's own ``ddp_comm_hook`` or
            ``model_averaging_period`` set too; when loading a checkpoint saved at another world size.
        TypeError: at ``setup``, for a strategy other than ``DDPStrategy``, naming the fix.
        NotImplementedError: at ``on_fit_start``, for more than one optimizer.
    """

    def __init__(self, section: Mapping[str, Any], *, source: str = "HierarchicalAveraging(section)") -> None:
        if not isinstance(section, Mapping):
            raise TypeError(f"section must be a mapping (a JSON object), got {type(section).__name__}.")
        if SECTION in section:
            section = section[SECTION]
        self.source = source
        try:
            self.settings: SectionSettings = parse_section(section)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        self._sync_warmup_given = isinstance(section, Mapping) and "synchronous_warmup" in section
        self.config: AveragingConfig | None = None
        """The config resolved at ``setup`` (``ranks_per_replica`` and the world size known)."""
        self.optimizer: HierarchicalAveragingOptimizer | None = None
        """The wrapper, from ``on_fit_start`` on."""
        self._pending_module_state: Mapping[str, Any] | None = None

    # -- fit: check, then wrap ------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or not self.settings.enabled:
            return
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy):
            raise TypeError(
                f"{self.source}: the HierarchicalAveraging callback is for DDPStrategy; under DeepSpeedStrategy put "
                f'the "{SECTION}" section into the DeepSpeed config and call hieravg_optim.deepspeed.install() before '
                f"the Trainer (or launch with torchrun ... -m hieravg_optim.run), and unset {CONFIG_ENV}."
            )
        if not isinstance(strategy, DDPStrategy):
            raise TypeError(
                f"{self.source}: the HierarchicalAveraging callback needs Lightning's DDPStrategy "
                f'(Trainer(strategy="ddp")), got {type(strategy).__name__}.'
            )
        for name, value in (
            ("ddp_comm_hook", strategy._ddp_comm_hook),
            ("model_averaging_period", strategy._model_averaging_period),
        ):
            if value is not None:
                raise ValueError(
                    f"{self.source}: DDPStrategy({name}={value!r}) is Lightning's own post-local SGD; this callback "
                    f"registers the post-local SGD hook and averages itself. Remove {name} from DDPStrategy."
                )
        ranks_per_replica = self.settings.ranks_per_replica or strategy.num_processes
        config = self.settings.averaging_config(ranks_per_replica)
        if not self._sync_warmup_given:
            config = dataclasses.replace(config, synchronous_warmup=False)
        elif config.synchronous_warmup and config.warmup_steps:
            warn_at_caller(
                f'{self.source}: "synchronous_warmup": true averages every warm-up step, but under DDP the gradients '
                "are all-reduced over every rank during the warm-up, which keeps the replicas equal already. Remove it."
            )
        try:
            if self.settings.ranks_per_replica is not None:
                check_world_size(self.settings, config, trainer.world_size)
            else:
                try:
                    config.check_world_size(trainer.world_size)
                except ValueError as exc:
                    raise ValueError(
                        f'key "period_group_size" {dict(self.settings.period_group_size)} with "ranks_per_replica" '
                        f"resolved to {ranks_per_replica} (Lightning's devices per node; set it explicitly if that is "
                        f"not what you want), world size {trainer.world_size}: {exc}"
                    ) from None
        except ValueError as err:
            raise ValueError(f"{self.source}: {err}") from None
        self.config = config

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config is None:
            return
        strategy = trainer.strategy
        if len(strategy.optimizers) != 1:
            raise NotImplementedError(
                f"{self.source}: hierarchical averaging under Lightning wraps exactly one optimizer, got "
                f"{len(strategy.optimizers)} from configure_optimizers. Put all parameters into one optimizer "
                "(with parameter groups), or wrap each optimizer yourself with HierarchicalAveragingOptimizer."
            )
        config = self.config
        settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init and f.name != "levels"}
        self.optimizer = HierarchicalAveragingOptimizer(
            strategy.optimizers[0],
            config.levels,
            buffers=pl_module.buffers() if self.settings.average_buffers else None,
            **settings,
        )
        strategy.optimizers = [self.optimizer]
        subgroup, _ = dist.new_subgroups(group_size=config.ranks_per_replica)
        register_post_local_sgd_hook(strategy.model, self.optimizer, subgroup)
        if self._pending_module_state is not None:
            pl_module.load_state_dict(self._pending_module_state)
            self._pending_module_state = None

    # -- every rank's state in Lightning's checkpoint ----------------------------------------------
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.optimizer is None:
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = None
        if rank:
            mine = move_data_to_device(
                {"state_dict": pl_module.state_dict(), "optimizer_states": [self.optimizer.state_dict()]},
                torch.device("cpu"),
            )
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            entry = checkpoint.setdefault("callbacks", {}).setdefault(self.state_key, {})
            entry["world_size"] = world_size
            entry[_RANKS_KEY] = gathered

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        entry = checkpoint.get("callbacks", {}).get(self.state_key)
        if not self.settings.enabled or not entry or _RANKS_KEY not in entry:
            return
        world_size, rank = trainer.world_size, trainer.global_rank
        if entry["world_size"] != world_size:
            raise ValueError(
                f"{self.source}: the checkpoint holds the states of {entry['world_size']} ranks, but this run has world "
                f"size {world_size}. Resume with {entry['world_size']} ranks: between averaging rounds every rank "
                "holds its own model."
            )
        ranks = entry.pop(_RANKS_KEY)  # the other ranks' states are not kept in memory
        if rank:
            mine = ranks[rank]
            # Loaded once DDP has wrapped the module (its construction broadcasts rank 0's weights).
            self._pending_module_state = mine["state_dict"]
            checkpoint["optimizer_states"] = mine["optimizer_states"]

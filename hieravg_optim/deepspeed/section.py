"""The ``"hierarchical_averaging"`` section of a DeepSpeed config: reading and parsing.

The section's keys are the fields of :class:`~hieravg_optim.AveragingConfig` (``period_group_size``
for its levels, ``outer_optimizer`` for ``outer_optimizers``, in the form of DeepSpeed's ``"optimizer"``
section), plus the adapter's own: ``enabled``, ``average_buffers`` and ``"auto"`` for
``ranks_per_replica``. Every key is documented in ``docs/deepspeed.md`` and each setting's meaning at its
field. Everything here is local (no collective): :func:`parse_section` checks the adapter's keys, turns
the outer optimizer specs into factories and lets :meth:`AveragingConfig.create` check the rest, its
errors naming the section's keys; :func:`resolve_ranks_per_replica` resolves ``"auto"``;
:func:`check_world_size` checks the levels against the world size; :func:`load_config` reads a config as
DeepSpeed does.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._validation import FieldCheck, in_section, is_bool, local_world_size, setting_error, warn_at_caller
from ..config import FIELD_CHECKS, AveragingConfig
from ..outer import OuterFactory
from ..schedule import parse_levels, period_of_key

__all__ = [
    "SECTION",
    "SectionSettings",
    "check_world_size",
    "outer_optimizer_class",
    "load_config",
    "parse_section",
    "resolve_ranks_per_replica",
]

SECTION = "hierarchical_averaging"
"""The top-level key of the DeepSpeed config this adapter reads (and removes before DeepSpeed sees it)."""

AUTO_SPELLINGS = ("auto", "local_world_size")
"""The values of ``"ranks_per_replica"`` that mean the ranks of one node. ``"local_world_size"`` passes
accelerate, which raises on every ``"auto"`` string of a DeepSpeed config that it does not fill itself."""

_JSON_KEY = {"levels": "period_group_size", "outer_optimizers": "outer_optimizer"}
"""The fields of :class:`AveragingConfig` whose JSON key is another name."""

_SETTINGS = tuple(
    f.name for f in dataclasses.fields(AveragingConfig) if f.init and f.name not in (*_JSON_KEY, "ranks_per_replica")
)
"""The keys passed to :meth:`AveragingConfig.create` as they are written (``ranks_per_replica`` once resolved)."""

_KEYS = (
    "enabled",
    *(_JSON_KEY.get(f.name, f.name) for f in dataclasses.fields(AveragingConfig) if f.init),
    "average_buffers",
)
"""Every key of the section: the config's fields, then the adapter's own."""

_FLAG = FieldCheck(is_bool, "True or False", json="true or false")

_DEFAULTS = {"synchronous_warmup": True}
"""The section's defaults that differ from :meth:`AveragingConfig.create`'s (the fields say why)."""


def _in_section(error: BaseException) -> ValueError:
    """``error`` as the section reports it: naming its key for the error of a setting, else prefixed."""
    return in_section(error, SECTION)


@dataclass(frozen=True, slots=True)
class SectionSettings:
    """The parsed ``"hierarchical_averaging"`` section, before the world size is known: the adapter's own keys,
    and the core config built from the others."""

    enabled: bool
    """False: the section is ignored and DeepSpeed runs exactly as without it."""
    config: AveragingConfig
    """The core config of every other key, with ``ranks_per_replica`` 1 while it is ``"auto"``: see
    :meth:`averaging_config`."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """The section's value keys as written (``period_group_size`` included, ``outer_optimizer`` and
    ``ranks_per_replica`` not): :meth:`AveragingConfig.create`'s keywords."""
    ranks_per_replica: int | None = None
    """Consecutive ranks forming one DeepSpeed data-parallel group; ``None`` = ``"auto"`` (one node)."""
    average_buffers: bool = True
    """Average the module's floating-point buffers (BatchNorm running statistics) on the same schedule: see
    ``docs/deepspeed.md``."""
    outer_optimizer: Mapping[int, Mapping[str, Any]] | None = None
    """``{period: {"type": name, "params": {...}}}``, checked, keys as ints and ``type`` as the ``torch.optim``
    class name (e.g. ``"SGD"`` for ``"sgd"``); ``None``: every level averages."""

    @property
    def period_group_size(self) -> Mapping[Any, Any]:
        """``{period: group_size}`` as written in the JSON (keys may be strings)."""
        return self.settings["period_group_size"]

    @property
    def outer_state_device(self) -> str | None:
        """``"outer_state_device"`` as written, e.g. ``"cpu"``; ``None``: with the master weights."""
        return self.settings.get("outer_state_device")

    def outer_optimizers(self) -> dict[int, OuterFactory]:
        """The outer optimizer factories of :attr:`outer_optimizer`, ``{period: factory}``: ``factory(tensors)`` is
        ``cls(tensors, **params)``, ``cls`` the ``torch.optim`` class named by ``type``."""
        return _factories(self.outer_optimizer)

    def averaging_config(self, ranks_per_replica: int) -> AveragingConfig:
        """The core config with ``ranks_per_replica`` resolved: :attr:`config` itself when it has that value."""
        if ranks_per_replica == self.config.ranks_per_replica:
            return self.config
        try:
            return dataclasses.replace(self.config, ranks_per_replica=ranks_per_replica)
        except (TypeError, ValueError) as err:
            raise _in_section(err) from None


def _bad(key: str, value: Any, expected: str) -> ValueError:
    return _in_section(setting_error(key, value, json=expected, message=""))


def parse_section(section: Any) -> SectionSettings:
    """Validate a ``"hierarchical_averaging"`` section (a JSON object) without any collective.

    Args:
        section: The value of the section, as loaded from JSON.

    Returns:
        The settings, with the core config checked as far as possible without the world size.

    Raises:
        ValueError: naming the key and the value, for an unknown key, a missing ``period_group_size``, or
            an invalid value. Each ``"outer_optimizer"`` entry is built and stepped once on a dummy fp32
            tensor here, so that ``params`` its ``torch.optim`` class rejects fail now, naming the period.

    Warns:
        UserWarning: for ``"outer_state_device"`` without ``"outer_optimizer"`` (it has no effect).
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
    if "period_group_size" not in section:
        raise ValueError(
            f'DeepSpeed config section "{SECTION}": key "period_group_size" is required, e.g. '
            '{"4": 8, "16": 16} (period in optimizer steps -> group size in ranks).'
        )
    pgs = section["period_group_size"]
    if not isinstance(pgs, Mapping):
        raise _bad("period_group_size", pgs, 'a JSON object {"period": group_size}, e.g. {"4": 8, "16": 16}')
    rpr = section.get("ranks_per_replica", "auto")
    if isinstance(rpr, str) and rpr not in AUTO_SPELLINGS:
        raise _bad(
            "ranks_per_replica",
            rpr,
            'a positive integer (ranks), or "auto" or "local_world_size" (the ranks of one node; accelerate '
            'raises on "auto" values it does not fill itself, so use "local_world_size" there)',
        )
    enabled, average_buffers = section.get("enabled", True), section.get("average_buffers", True)
    outer = section.get("outer_optimizer")
    try:
        for key, value in (("enabled", enabled), ("average_buffers", average_buffers)):
            _FLAG(key, value)
        if rpr not in (*AUTO_SPELLINGS, None):
            FIELD_CHECKS["ranks_per_replica"]("ranks_per_replica", rpr)
        periods = [lv.period for lv in parse_levels(pgs)]
    except (TypeError, ValueError) as err:
        raise _in_section(err) from None
    outer_keys: dict[int, Any] = {}  # period -> its key as written, for the messages below
    outer_parsed = None if outer is None else _parse_outer_optimizer(outer, outer_keys)
    for period in outer_parsed or {}:
        if period not in periods:
            raise ValueError(
                f'DeepSpeed config section "{SECTION}": key "outer_optimizer" has period {outer_keys[period]!r}, '
                f'which is not a period of "period_group_size" (one of {[str(p) for p in periods]}). Give the '
                f'outer optimizer of a level under its period, e.g. {{"{periods[-1]}": {{"type": "SGD", '
                '"params": {"lr": 0.7, "momentum": 0.9, "nesterov": true}}}.'
            )
    settings = {k: section[k] for k in _SETTINGS if k in section}
    ranks_per_replica = None if rpr in (*AUTO_SPELLINGS, None) else int(rpr)
    try:
        config = AveragingConfig.create(
            pgs,
            ranks_per_replica=ranks_per_replica or 1,
            outer_optimizers=_factories(outer_parsed),
            **{**_DEFAULTS, **settings},
        )
    except (TypeError, ValueError) as err:
        raise _in_section(err) from None
    device = settings.get("outer_state_device")
    if enabled and device is not None and not outer_parsed and not config.compress:
        warn_at_caller(
            f'DeepSpeed config section "{SECTION}": "outer_state_device": {device!r} has no effect without '
            '"outer_optimizer" (no level keeps anchors). Remove it, or add an "outer_optimizer".'
        )
    return SectionSettings(
        enabled=enabled,
        config=config,
        settings={"period_group_size": dict(pgs), **settings},
        ranks_per_replica=ranks_per_replica,
        average_buffers=average_buffers,
        outer_optimizer=outer_parsed or None,
    )


def _factories(spec: Mapping[int, Mapping[str, Any]] | None) -> dict[int, OuterFactory]:
    """``{period: factory}`` of a parsed ``"outer_optimizer"``: ``factory(tensors)`` is ``cls(tensors, **params)``."""
    return {
        period: functools.partial(getattr(torch.optim, entry["type"]), **entry["params"])
        for period, entry in (spec or {}).items()
    }


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """The optimizer classes of ``torch.optim``, by name (``Optimizer`` itself left out)."""
    return {
        name: obj
        for name in dir(torch.optim)
        if isinstance(obj := getattr(torch.optim, name), type)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer
    }


def outer_optimizer_class(name: Any) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class an ``"outer_optimizer"`` ``type`` names.

    As DeepSpeed's ``"optimizer": {"type": ...}``, the name is matched exactly first (``"SGD"``,
    ``"AdamW"``), then without regard to case (``"sgd"``, ``"adamw"``), as DeepSpeed matches the names
    of its own optimizers. It is always the ``torch.optim`` class, never DeepSpeed's fused or CPU
    Adam: ``"Adam"`` is :class:`torch.optim.Adam` (L2 weight decay); for decoupled weight decay, as
    DeepSpeed's ``"Adam"`` does by default, name ``"AdamW"``.

    Raises:
        ValueError: naming the value and the classes of ``torch.optim``, for anything else.
    """
    classes = _torch_optimizers()
    if isinstance(name, str):
        if name in classes:
            return classes[name]
        folded = [c for c in classes if c.lower() == name.lower()]
        if len(folded) == 1:
            return classes[folded[0]]
    raise ValueError(f"must name an optimizer class of torch.optim, one of {sorted(classes)}, got {name!r}")


def _parse_outer_optimizer(value: Any, keys: dict[int, Any]) -> dict[int, dict[str, Any]]:
    """``"outer_optimizer"`` as ``{period: {"type": class name, "params": dict}}``; ``keys`` gets each period's key.

    Each entry is tried on a dummy fp32 tensor (built, then stepped once with a zero gradient), so
    that params the class rejects, or a class that cannot step without a closure (``LBFGS``), fail here,
    on every rank, and not at the first averaging round.
    """
    example = '{"64": {"type": "SGD", "params": {"lr": 0.7, "momentum": 0.9, "nesterov": true}}}'
    if not isinstance(value, Mapping):
        raise _bad("outer_optimizer", value, f"a JSON object {{\"period\": {{\"type\", \"params\"}}}}, e.g. {example}")
    out: dict[int, dict[str, Any]] = {}
    for key, spec in value.items():
        where = f'DeepSpeed config section "{SECTION}": key "outer_optimizer", period {key!r}'
        period = period_of_key(key)
        if period is None or period <= 0:
            raise ValueError(
                f"{where}: the key must be a period of \"period_group_size\" (a positive integer, a string in "
                f"JSON), e.g. {example}."
            )
        if period in keys:
            raise ValueError(
                f"{where}: period {period} is given twice ({keys[period]!r} and {key!r}); give each period once."
            )
        keys[period] = key
        if not isinstance(spec, Mapping):
            raise ValueError(
                f'{where} must be a JSON object {{"type": ..., "params": {{...}}}}, got {spec!r} '
                f"({type(spec).__name__}), e.g. {example}."
            )
        unknown = [k for k in spec if k not in ("type", "params")]
        if unknown:
            raise ValueError(
                f'{where}: unknown key {unknown[0]!r}; the keys are "type" (a torch.optim class) and "params" (its '
                "keyword arguments), as in DeepSpeed's \"optimizer\" section."
            )
        if "type" not in spec:
            raise ValueError(f'{where}: "type" is required, the torch.optim class, e.g. {example}.')
        try:
            cls = outer_optimizer_class(spec["type"])
        except ValueError as err:
            raise ValueError(f'{where}: "type" {err}.') from None
        params = spec.get("params", {})
        if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
            raise ValueError(
                f'{where}: "params" must be a JSON object of torch.optim.{cls.__name__} keyword arguments, got '
                f"{params!r} ({type(params).__name__})."
            )
        params = dict(params)
        dummy = torch.zeros(2)
        try:
            optimizer = cls([dummy], **params)
        except Exception as err:  # noqa: BLE001 - whatever the class raises, reported with the key
            if not _builds(cls):
                raise ValueError(
                    f"{where}: torch.optim.{cls.__name__} cannot be an outer optimizer: it rejects a flat 1-D fp32 "
                    f"tensor, as ZeRO partitions are ({type(err).__name__}: {err}). Use e.g. SGD, Adam or AdamW."
                ) from None
            raise ValueError(
                f'{where}: torch.optim.{cls.__name__} rejects "params" {params!r}: {type(err).__name__}: {err}'
            ) from None
        try:
            dummy.grad = torch.zeros_like(dummy)
            optimizer.step()
        except Exception as err:  # noqa: BLE001
            raise ValueError(
                f"{where}: torch.optim.{cls.__name__} cannot be an outer optimizer: its step() without a closure, "
                f"on a dense fp32 tensor, failed with {type(err).__name__}: {err}. Use e.g. SGD, Adam or AdamW."
            ) from None
        out[period] = {"type": cls.__name__, "params": params}
    return out


def resolve_ranks_per_replica(settings: SectionSettings) -> int:
    """The section's ``ranks_per_replica``; ``"auto"`` (or ``"local_world_size"``): ``LOCAL_WORLD_SIZE`` (torchrun),
    else ``LOCAL_SIZE``.

    Raises:
        ValueError: for ``"auto"`` when neither variable is set to a positive integer.
    """
    if settings.ranks_per_replica is not None:
        return settings.ranks_per_replica
    ranks, _ = local_world_size()
    if ranks is None:
        raise ValueError(
            f'DeepSpeed config section "{SECTION}": key "ranks_per_replica" is "auto" or "local_world_size" (the ranks '
            'of one node), but '
            "neither LOCAL_WORLD_SIZE (torchrun) nor LOCAL_SIZE (deepspeed launcher) is set. Set "
            '"ranks_per_replica" to a number of ranks.'
        )
    return ranks


def check_world_size(settings: SectionSettings, config: AveragingConfig, world_size: int) -> None:
    """:meth:`AveragingConfig.check_world_size`, its error naming the section's keys and where ``"auto"`` came from.

    Args:
        settings: The parsed section.
        config: ``settings.averaging_config(resolve_ranks_per_replica(settings))``.
        world_size: The size of the default process group.

    Raises:
        ValueError: naming ``period_group_size``, ``ranks_per_replica`` (for ``"auto"``: the environment
            variable it was read from) and the world size, if the levels do not fit the world size.
    """
    try:
        config.check_world_size(world_size)
    except ValueError as exc:
        origin = (
            f'"ranks_per_replica": "auto" resolved to {config.ranks_per_replica} from '
            f"{local_world_size()[1]} (the ranks of one node); set it explicitly if that is not what you want"
            if settings.ranks_per_replica is None
            else f'"ranks_per_replica": {settings.ranks_per_replica}'
        )
        raise ValueError(
            f'DeepSpeed config section "{SECTION}", key "period_group_size" {dict(settings.period_group_size)} '
            f"with {origin}, world size {world_size}: {exc}"
        ) from None


def load_config(config: Any) -> dict[str, Any]:
    """A DeepSpeed config as a new dict: a copy of a mapping, else read from a path or a base64 string.

    Raises:
        ValueError: if ``config`` is neither a mapping, nor a path to an existing file, nor base64 (H)JSON.
    """
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


def _builds(cls: type[torch.optim.Optimizer]) -> bool:
    """Whether ``cls`` accepts a flat 1-D fp32 tensor with its default arguments."""
    try:
        cls([torch.zeros(2)])
    except Exception:  # noqa: BLE001
        return False
    return True

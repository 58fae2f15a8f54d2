"""The ``"hierarchical_averaging"`` section of a DeepSpeed config: reading, parsing, validating.

Everything here is local (no collective): :func:`parse_section` checks the section as far as
it can without the world size, :func:`resolve_ranks_per_replica` resolves ``"auto"`` from the
launcher's environment, and :func:`check_world_size` checks the resolved levels against the
world size, naming the section's keys. :func:`load_config` reads a config as DeepSpeed does.
"""

from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import (
    NONFINITE_POLICIES,
    AveragingConfig,
    MAX_COLLECTIVE_TIMEOUT_S,
    check_collective_timeout_s,
    check_nonfinite,
    warn_at_caller,
)
from ..schedule import period_of_key

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

_KEYS = (
    "enabled",
    "period_group_size",
    "warmup_steps",
    "ranks_per_replica",
    "bucket_cap_mb",
    "synchronous_warmup",
    "average_frozen",
    "average_buffers",
    "collective_timeout_s",
    "nonfinite",
    "comm_dtype",
    "ranks_per_node",
    "outer_optimizer",
    "outer_state_device",
)


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
    synchronous_warmup: bool = True
    """Average all replicas after every warm-up step (default ``true``), as post-local SGD's synchronous warm-up."""
    average_frozen: bool = False
    """Average the module's ``requires_grad=False`` parameters too (default ``false``: never sent, never changed)."""
    average_buffers: bool = True
    """Average the module's floating-point buffers (BatchNorm running statistics) on the same schedule."""
    collective_timeout_s: float | None = None
    """Timeout of the averaging subgroups' collectives, in seconds; ``None``: the default group's."""
    nonfinite: str = "raise"
    """``"raise"``, ``"skip_replica"`` or ``"ignore"``: what a round does with a non-finite replica."""
    comm_dtype: Any = None
    """Wire dtype: one name, or ``{"period": name}``; ``None`` sends each tensor in its own dtype."""
    ranks_per_node: int | str | None = None
    """Ranks of one node for node-aware levels (``"auto"``: ``LOCAL_WORLD_SIZE`` / ``LOCAL_SIZE``); ``None``: flat."""
    outer_optimizer: Mapping[int, Mapping[str, Any]] | None = None
    """``{period: {"type": name, "params": {...}}}``, checked, keys as ints and ``type`` as the ``torch.optim``
    class name (e.g. ``"SGD"`` for ``"sgd"``); ``None``: every level averages."""
    outer_state_device: str | None = None
    """Where anchors and outer optimizer state live (e.g. ``"cpu"``); ``None``: with the master weights."""

    def outer_optimizers(self) -> dict[int, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
        """The outer optimizer factories of :attr:`outer_optimizer`, ``{period: factory}``.

        ``factory(tensors)`` is ``cls(tensors, **params)``, ``cls`` the ``torch.optim`` class named by
        ``type``: the ``outer_optimizers`` argument of :class:`~hieravg_optim.HierarchicalAverager`.
        """
        return {
            period: functools.partial(getattr(torch.optim, spec["type"]), **spec["params"])
            for period, spec in (self.outer_optimizer or {}).items()
        }

    def averaging_config(self, ranks_per_replica: int) -> AveragingConfig:
        """The core config, with ``ranks_per_replica`` resolved."""
        try:
            return AveragingConfig.create(
                self.period_group_size,  # type: ignore[arg-type]
                warmup_steps=self.warmup_steps,
                ranks_per_replica=ranks_per_replica,
                bucket_cap_mb=self.bucket_cap_mb,
                synchronous_warmup=self.synchronous_warmup,
                collective_timeout_s=self.collective_timeout_s,
                nonfinite=self.nonfinite,
                comm_dtype=self.comm_dtype,
                ranks_per_node=self.ranks_per_node,
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
            ``period_group_size``, or an invalid value. Each ``"outer_optimizer"`` entry is built and
            stepped once on a dummy fp32 tensor here, so that ``params`` its ``torch.optim`` class
            rejects fail now, naming the period, not at the first round.

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
    flags = {}
    for key, default in (("synchronous_warmup", True), ("average_frozen", False), ("average_buffers", True)):
        flags[key] = section.get(key, default)
        if not isinstance(flags[key], bool):
            raise _bad(key, flags[key], "true or false")
    timeout = section.get("collective_timeout_s")
    try:
        check_collective_timeout_s(timeout)
    except ValueError:
        raise _bad(
            "collective_timeout_s",
            timeout,
            f"a positive number of seconds, at most {MAX_COLLECTIVE_TIMEOUT_S:g}, or null for the default group's",
        ) from None
    nonfinite = section.get("nonfinite", "raise")
    try:
        check_nonfinite(nonfinite)
    except ValueError:
        raise _bad("nonfinite", nonfinite, f"one of {list(NONFINITE_POLICIES)}") from None
    comm_dtype = section.get("comm_dtype")
    if comm_dtype is not None and not isinstance(comm_dtype, (str, Mapping)):
        raise _bad("comm_dtype", comm_dtype, 'a dtype name such as "bf16", or {"period": "bf16"}')
    rpn = section.get("ranks_per_node")
    if rpn is not None and rpn != "auto" and (isinstance(rpn, bool) or not isinstance(rpn, numbers.Integral) or rpn <= 0):
        raise _bad("ranks_per_node", rpn, 'a positive integer (ranks of one node), "auto" or null')
    outer = section.get("outer_optimizer")
    outer_keys: dict[int, Any] = {}  # period -> its key as written, for the messages below
    outer_parsed = None if outer is None else _parse_outer_optimizer(outer, outer_keys)
    device = section.get("outer_state_device")
    if device is not None:
        try:
            if not isinstance(device, str):
                raise TypeError
            torch.device(device)
        except (TypeError, RuntimeError):
            raise _bad(
                "outer_state_device", device, 'a torch device name such as "cpu", or null (with the master weights)'
            ) from None
    settings = SectionSettings(
        enabled=enabled,
        period_group_size=dict(pgs),
        warmup_steps=int(warmup),
        ranks_per_replica=rpr_value,
        bucket_cap_mb=float(cap),
        **flags,
        collective_timeout_s=None if timeout is None else float(timeout),
        nonfinite=nonfinite,
        comm_dtype=dict(comm_dtype) if isinstance(comm_dtype, Mapping) else comm_dtype,
        ranks_per_node=int(rpn) if isinstance(rpn, numbers.Integral) else rpn,
        outer_optimizer=outer_parsed or None,
        outer_state_device=device,
    )
    if enabled:
        # Everything about the levels that needs no world size (periods, group sizes, order, comm_dtype).
        config = settings.averaging_config(ranks_per_replica=1)
        periods = [lv.period for lv in config.levels]
        for period in outer_parsed or {}:
            if period not in periods:
                raise ValueError(
                    f'DeepSpeed config section "{SECTION}": key "outer_optimizer" has period {outer_keys[period]!r}, '
                    f'which is not a period of "period_group_size" (one of {[str(p) for p in periods]}). Give the '
                    f'outer optimizer of a level under its period, e.g. {{"{periods[-1]}": {{"type": "SGD", '
                    '"params": {"lr": 0.7, "momentum": 0.9, "nesterov": true}}}.'
                )
        if device is not None and not outer_parsed:
            warn_at_caller(
                f'DeepSpeed config section "{SECTION}": "outer_state_device": {device!r} has no effect without '
                '"outer_optimizer" (no level keeps anchors). Remove it, or add an "outer_optimizer".'
            )
    return settings


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


def _auto_ranks_per_replica_source() -> str:
    """Which environment variable ``"ranks_per_replica": "auto"`` reads, with its value."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(var) is not None:
            return f"{var}={os.environ[var]}"
    return "no environment variable"


def resolve_ranks_per_replica(settings: SectionSettings) -> int:
    """The section's ``ranks_per_replica``; for ``"auto"``, ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE`` (launcher).

    Raises:
        ValueError: for ``"auto"`` when neither variable is set to a positive integer.
    """
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
            f"{_auto_ranks_per_replica_source()} (the ranks of one node); set it explicitly if that is not "
            "what you want"
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

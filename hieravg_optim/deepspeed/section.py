"""The ``"hierarchical_averaging"`` section of a DeepSpeed config: reading, parsing, validating.

Everything here is local (no collective): :func:`parse_section` checks the section as far as
it can without the world size, :func:`resolve_ranks_per_replica` resolves ``"auto"`` from the
launcher's environment, and :func:`check_world_size` checks the resolved levels against the
world size, naming the section's keys. :func:`load_config` reads a config as DeepSpeed does.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import NONFINITE_POLICIES, AveragingConfig, check_collective_timeout_s, check_nonfinite

__all__ = [
    "SECTION",
    "SectionSettings",
    "check_world_size",
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
    flags = {}
    for key, default in (("synchronous_warmup", True), ("average_frozen", False), ("average_buffers", True)):
        flags[key] = section.get(key, default)
        if not isinstance(flags[key], bool):
            raise _bad(key, flags[key], "true or false")
    timeout = section.get("collective_timeout_s")
    try:
        check_collective_timeout_s(timeout)
    except ValueError:
        raise _bad("collective_timeout_s", timeout, "a positive number of seconds, or null for the default group's") from None
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
    )
    if enabled:
        # Everything about the levels that needs no world size (periods, group sizes, order, comm_dtype).
        settings.averaging_config(ranks_per_replica=1)
    return settings


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



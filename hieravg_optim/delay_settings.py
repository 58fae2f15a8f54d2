"""The per-level settings of delayed rounds and fragments: parsing and the checks against the levels.

``delay_steps``, ``fragments``, ``delay_mixing`` and ``delay_correction`` are fields of
:class:`~hieravg_optim.AveragingConfig` (their docstrings are the reference); each takes one value or
``{period: value}`` (:func:`hieravg_optim.schedule.per_level`, the form of ``comm_dtype``). Everything here is
local (no collective), so a bad value raises on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

from ._validation import as_float, is_int, is_real, setting_error
from .schedule import AveragingLevel, fragment_spacing, per_level

__all__ = ["DELAY_CORRECTIONS", "PerLevel", "check_delay_settings", "parse_delay_setting"]

DELAY_CORRECTIONS = ("eager", "none")
"""The values of ``delay_correction``."""

PerLevel = Union[int, float, str, Mapping[Union[int, str], Union[int, float, str]], tuple]
"""What the per-level delay settings accept: one value for every level, or ``{period: value}``."""

_DEFAULTS: dict[str, Any] = {"delay_steps": 0, "fragments": 1, "delay_mixing": 0.0, "delay_correction": "eager"}
_EXPECTED = {
    "delay_steps": ("a non-negative integer (optimizer steps)", lambda v: is_int(v) and v >= 0, int),
    "fragments": ("a positive integer (fragments)", lambda v: is_int(v) and v >= 1, int),
    "delay_mixing": ("a number in [0, 1]", lambda v: is_real(v) and 0.0 <= as_float(v) <= 1.0, as_float),
    "delay_correction": (f"one of {list(DELAY_CORRECTIONS)}", lambda v: isinstance(v, str) and v in DELAY_CORRECTIONS, str),
}
_EXAMPLES = {"delay_steps": "4", "fragments": "4", "delay_mixing": "0.5", "delay_correction": '"none"'}


def _one(name: str):
    expected, ok, canonical = _EXPECTED[name]

    def one(value: object, where: str) -> Any:
        if not ok(value):
            shown = "{period: value}" if where == "" else "one value"
            raise setting_error(
                name,
                value,
                json=f'{expected}, or {{"period": {_EXAMPLES[name]}}}',
                message=f"{name}{where} must be {expected} (or {shown}), got {value!r} ({type(value).__name__}).",
            )
        return canonical(value)

    return one


def parse_delay_setting(name: str, value: PerLevel, levels: tuple[AveragingLevel, ...]) -> tuple:
    """The canonical form of the per-level setting ``name`` (a key of ``_DEFAULTS``): one value per level, or
    ``()`` when every level has the default; a tuple is taken as canonical already (checked by
    :func:`check_delay_settings`).

    Raises:
        ValueError: naming the setting, the period and the value, for a value out of range or of another type, a
            key that is not a period, or a period given twice.
    """
    if isinstance(value, tuple):
        return value
    example = f'{{"{levels[-1].period}": {_EXAMPLES[name]}}}'
    return per_level(value, levels, name, _one(name), _DEFAULTS[name], example)


def _values(config: Any, name: str) -> tuple:
    value = getattr(config, name)
    levels = config.levels
    if not isinstance(value, tuple) or len(value) not in (0, len(levels)):
        raise setting_error(name, value, "one value per level, or () (build it with create())")
    one = _one(name)
    for lv, v in zip(levels, value):
        one(v, f" of period {lv.period}")
    return value or (_DEFAULTS[name],) * len(levels)


def check_delay_settings(config: Any) -> None:
    """Check the four delay settings of ``config`` (an :class:`~hieravg_optim.AveragingConfig`) alone and against
    the levels and outer optimizers. Local, no collective.

    Raises:
        ValueError: naming the period and the values, and the fix: a delay not below the level's period or its
            fragment spacing; more fragments than the period; a level with a delay or fragments whose period does not
            divide every higher level's period (a higher level's round would start inside its window); an outer
            optimizer (or ``compress``, which keeps anchors) on a level below a level with fragments.
    """
    delays, fragments = _values(config, "delay_steps"), _values(config, "fragments")
    _values(config, "delay_mixing")
    _values(config, "delay_correction")
    levels = config.levels
    periods = [lv.period for lv in levels]
    for i, lv in enumerate(levels):
        tau, f, p = delays[i], fragments[i], lv.period
        if f > p:
            raise ValueError(
                f"fragments of period {p} is {f}, more than the period: fragment rounds are staggered by about "
                f"period / fragments counts, so at most {p} fragments fit. Pass fragments={{{p}: {p}}} or fewer."
            )
        spacing = fragment_spacing(p, f)
        if tau >= spacing:
            where = f"the period ({p})" if f == 1 else f"the fragment spacing of period {p} ({spacing} counts, {f} fragments)"
            raise ValueError(
                f"delay_steps of period {p} is {tau}, but must be below {where}: a round must be applied before "
                f"the level's next round starts. Pass delay_steps={{{p}: {spacing - 1}}} or less, or fewer fragments."
            )
        if tau or f > 1:
            higher = [q for q in periods[i + 1 :] if q % p]
            if higher:
                raise ValueError(
                    f"delay_steps / fragments at period {p} need every higher level's period to be a multiple of "
                    f"{p} (so that no higher round starts while one of its rounds is in flight), got {higher}. "
                    "Choose nested periods, e.g. {4: ..., 32: ...}."
                )
    outer_periods = set(getattr(config, "outer_optimizers", {}) or {})
    codecs = getattr(config, "compress", ()) or ()
    compressed = {lv.period for lv, c in zip(levels, codecs) if c is not None}  # they keep anchors too
    outer_periods |= compressed
    for i, lv in enumerate(levels):
        if fragments[i] > 1:
            below = [q for q in periods[:i] if q in outer_periods]
            if below:
                raise ValueError(
                    f"fragments at period {lv.period} with an outer optimizer or compress (which keep anchors) at the "
                    f"lower period(s) {below} is not supported (a lower round would step part of its anchors). Put them "
                    "on the level with fragments or above it, or use fragments=1."
                )

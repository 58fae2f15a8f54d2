"""When to average: the hierarchical SGD schedule, as pure functions.

This module answers one question: *which level, if any, averages at step count k?*
It imports nothing from ``torch.distributed`` so that it can be tested, and
reasoned about, without a process group.

The rule is the one of PyTorch's
``torch.distributed.algorithms.model_averaging.hierarchical_model_averager.HierarchicalModelAverager``
(hierarchical SGD, https://arxiv.org/abs/2010.12998):

* the step count starts at 0 and goes up by one per optimizer step, *after* the
  inner optimizer has stepped and averaging (if any) has run;
* at a count ``k >= warmup_steps``, among the periods that divide ``k``, the
  largest one wins and its level averages; no other level runs at that count;
* count 0 is divisible by every period, so with ``warmup_steps=0`` the first
  step averages at the top level, exactly as torch does.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AveragingLevel",
    "Levels",
    "as_levels",
    "entries_by_period",
    "fragment_offsets",
    "fragment_spacing",
    "level_at",
    "per_level",
    "parse_levels",
    "period_of_key",
    "rounds_per_level",
]


@dataclass(frozen=True, slots=True)
class AveragingLevel:
    """One level of the hierarchy: every ``period`` steps, groups of ``group_size`` ranks average.

    The groups of a level are contiguous blocks of ``group_size`` ranks of the
    overall process group (see :mod:`hieravg_optim.groups`).
    """

    period: int
    """Averaging period of this level, in optimizer steps."""

    group_size: int
    """Number of ranks (of the overall process group) in each averaging group of this level."""


def period_of_key(key: object) -> int | None:
    """The period a key of a per-level mapping names: an int, a numpy integer, or a string of digits
    (JSON object keys are strings); ``None`` for anything else."""
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key)
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return None


def entries_by_period(
    value: Mapping[Any, Any], levels: Sequence[AveragingLevel], name: str, example: str
) -> list[tuple[int, Any, Any]]:
    """The entries of a per-level mapping ``{period: value}`` (``comm_dtype``, ``outer_optimizers``).

    Local, no collective.

    Args:
        value: The mapping; its keys are read by :func:`period_of_key`.
        levels: The levels of the config.
        name: The setting's name, for the messages.
        example: A valid value, for the messages.

    Returns:
        ``(period, key, value)`` per entry, in the mapping's order.

    Raises:
        ValueError: for a key that is not the period of a level, or a period given twice
            (``{"4": ..., 4: ...}``), naming ``name``, the key and the periods.
    """
    periods = [lv.period for lv in levels]
    keys: dict[int, object] = {}
    entries = []
    for key, item in value.items():
        period = period_of_key(key)
        if period not in periods:
            raise ValueError(
                f"{name} key {key!r} must be the period of a level (one of {periods}), as in {example}."
            )
        if period in keys:
            raise ValueError(
                f"{name} keys {keys[period]!r} and {key!r} both name period {period}: give each period once (the "
                "keys of a JSON object are strings, so mix no ints in)."
            )
        keys[period] = key
        entries.append((period, key, item))
    return entries


def per_level(
    value: Any,
    levels: Sequence[AveragingLevel],
    name: str,
    one: Callable[[Any, str], Any],
    default: Any,
    example: str,
) -> tuple[Any, ...]:
    """A per-level setting in its canonical form: one value per level, in level order, or ``()`` for the default.

    The form of ``comm_dtype``, ``delay_steps``, ``fragments``, ``delay_mixing`` and ``delay_correction``: one value
    for every level, or a mapping ``{period: value}`` (keys read by :func:`entries_by_period`) whose omitted levels
    take ``default``. Local, no collective.

    Args:
        value: One value, or the mapping.
        levels: The levels of the config.
        name: The setting's name, for the messages.
        one: Checks one value and returns its canonical form; called as ``one(value, where)``, ``where`` being
            ``""`` or ``" of period P"`` for the messages. It raises the setting's ``ValueError``.
        default: The canonical default of one level.
        example: A valid mapping, for the messages.

    Returns:
        One canonical value per level, or ``()`` when every level has ``default``.

    Raises:
        ValueError: from ``one``; from :func:`entries_by_period` for a key that is not a period or a period given
            twice.
    """
    if isinstance(value, Mapping):
        by_period = {period: one(item, f" of period {period}") for period, _, item in entries_by_period(value, levels, name, example)}
        out = tuple(by_period.get(lv.period, default) for lv in levels)
    else:
        out = (one(value, ""),) * len(levels)
    return () if all(v == default and type(v) is type(default) for v in out) else out


def fragment_offsets(period: int, fragments: int) -> tuple[int, ...]:
    """The count offset of each fragment of a level: fragment ``j`` starts its rounds at the counts ``t`` with
    ``t % period == offsets[j]``; ``offsets[j]`` is ``j * period / fragments`` rounded half up.

    Streaming DiLoCo (https://arxiv.org/abs/2501.18512) staggers the fragments' rounds so. Pure.
    """
    return tuple((2 * j * period + fragments) // (2 * fragments) for j in range(fragments))


def fragment_spacing(period: int, fragments: int) -> int:
    """The fewest counts between two consecutive fragment rounds of a level (cyclically): ``period`` for one
    fragment. A delay must be below it, so that one fragment's round at most is in flight at a time. Pure."""
    offsets = fragment_offsets(period, fragments)
    return min(b - a for a, b in zip(offsets, (*offsets[1:], offsets[0] + period)))


def parse_levels(
    period_group_size: Mapping[int | str, int] | Iterable[AveragingLevel | tuple[int, int]],
) -> tuple[AveragingLevel, ...]:
    """Turn ``{period: group_size}`` (or a sequence of levels or pairs) into levels.

    The order is the order given; :class:`AveragingConfig` checks that the periods strictly
    increase. Periods are read by :func:`hieravg_optim.schedule.period_of_key`: ints, numpy
    integers, or (as in JSON) strings of digits.

    Raises:
        ValueError: if it is empty, or a period or group size is not an integer.
        TypeError: if ``period_group_size`` is neither a mapping nor an iterable of pairs.
    """
    if isinstance(period_group_size, Mapping):
        pairs = list(period_group_size.items())
    elif isinstance(period_group_size, Iterable) and not isinstance(period_group_size, (str, bytes)):
        pairs = []
        for item in period_group_size:
            if isinstance(item, AveragingLevel):
                pairs.append((item.period, item.group_size))
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                pairs.append((item[0], item[1]))
            else:
                raise TypeError(
                    f"period_group_size items must be AveragingLevel or (period, group_size) pairs, got {item!r}."
                )
    else:
        raise TypeError(
            "period_group_size must be a mapping {period: group_size}, e.g. {4: 8, 32: 16}, "
            f"got {type(period_group_size).__name__}."
        )
    if not pairs:
        raise ValueError(
            "period_group_size must not be empty: give at least one {period: group_size}, "
            "the last group size being the size of the process group."
        )
    levels = []
    for key, group_size in pairs:
        period = period_of_key(key)
        if period is None:
            raise ValueError(
                f"Period {key!r} in period_group_size must be a positive integer, got {key!r} ({type(key).__name__})."
            )
        if not isinstance(group_size, numbers.Integral) and not isinstance(group_size, bool):
            raise ValueError(
                f"Group size {group_size!r} of period {key!r} in period_group_size must be a positive integer "
                f"(a number of ranks), got {type(group_size).__name__}."
            )
        levels.append(AveragingLevel(period=period, group_size=int(group_size)))
    return tuple(levels)


Levels = Sequence[AveragingLevel] | Mapping[int, int] | Iterable[tuple[int, int]]
"""Levels as :class:`AveragingLevel` objects, torch's ``{period: group_size}`` mapping, or pairs."""


def as_levels(levels: Levels) -> tuple[AveragingLevel, ...]:
    """``levels`` as a tuple of :class:`AveragingLevel`, in the order given (no validation).

    Raises:
        TypeError: for anything that is not levels, a ``{period: group_size}`` mapping or pairs.
    """
    items = levels.items() if isinstance(levels, Mapping) else levels
    out = []
    for item in items:
        if isinstance(item, AveragingLevel):
            out.append(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            out.append(AveragingLevel(period=int(item[0]), group_size=int(item[1])))
        else:
            raise TypeError(
                f"levels must be AveragingLevel objects, a {{period: group_size}} mapping or (period, group_size) "
                f"pairs, got the item {item!r}; opt.averager.levels holds a wrapper's levels."
            )
    return tuple(out)


def level_at(count: int, levels: Levels, warmup_steps: int) -> int | None:
    """Return the index into ``levels`` of the level that averages at step ``count``.

    Args:
        count: The averaging step count, in optimizer steps, starting at 0.
        levels: The levels, periods strictly increasing (as validated by
            :class:`hieravg_optim.config.AveragingConfig`): :class:`AveragingLevel` objects,
            the ``{period: group_size}`` mapping given to the wrapper, or pairs.
        warmup_steps: Counts below this never average.

    Returns:
        The index (0 = the first, most frequent level) of the level with the largest period
        that divides ``count``, or ``None`` when ``count < warmup_steps`` or no period
        divides it: then nothing averages at that count.
    """
    if count < warmup_steps:
        return None
    if not (isinstance(levels, tuple) and all(type(lv) is AveragingLevel for lv in levels)):
        levels = as_levels(levels)  # a config's levels are such a tuple already
    for index in range(len(levels) - 1, -1, -1):
        if count % levels[index].period == 0:
            return index
    return None


def rounds_per_level(start: int, stop: int, levels: Levels, warmup_steps: int) -> list[int]:
    """Count the averaging rounds of each level over the step counts ``start <= k < stop``.

    Examples, benchmarks and tests use it to state the exact number of rounds
    they expect. ``levels`` takes the same forms as in :func:`level_at`.

    Returns:
        A list with one entry per level, in the order of ``levels``.
    """
    levels = as_levels(levels)
    rounds = [0] * len(levels)
    for count in range(start, stop):
        index = level_at(count, levels, warmup_steps)
        if index is not None:
            rounds[index] += 1
    return rounds

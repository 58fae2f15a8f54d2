"""The small pieces every check of a setting uses: number tests, one error type, warnings at the caller.

:func:`setting_error` builds what a check of one setting raises: a plain ``ValueError`` (or
``TypeError``) with today's Python message (``warmup_steps must be a non-negative integer (steps), got
-1.``), which :func:`in_section` renders as the DeepSpeed JSON section's message, naming the key
(``key "warmup_steps" must be a non-negative integer (optimizer steps), got -1 (int).``).
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "FieldCheck",
    "as_float",
    "as_real",
    "check_world_size",
    "is_bool",
    "is_int",
    "is_positive_int",
    "is_real",
    "local_world_size",
    "plain_number",
    "in_section",
    "resolve_ranks_per_node",
    "setting_error",
    "warn_at_caller",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside this package: the user's call.

    A fixed ``stacklevel`` is wrong as soon as the same check is reached through
    different call depths (the wrapper, the averager, the DeepSpeed adapter).
    """
    frame = sys._getframe(1)
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (a Python or numpy integer), ``bool`` excluded."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number (Python or numpy), ``bool`` excluded."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_bool(value: object) -> bool:
    """Whether ``value`` is ``True`` or ``False`` (not 0, 1 or a string)."""
    return isinstance(value, bool)


def is_positive_int(value: object) -> bool:
    """Whether ``value`` is an integer (``bool`` excluded) above 0."""
    return is_int(value) and value > 0  # type: ignore[operator]


def as_float(value: numbers.Real) -> float:
    """``float(value)``; an int beyond float's range is ``inf`` (then rejected as infinite), not an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def local_world_size() -> tuple[int | None, str]:
    """The ranks of this node, as the launcher says: ``LOCAL_WORLD_SIZE`` (torchrun), else ``LOCAL_SIZE``
    (the ``deepspeed`` launcher); with where it was read (``"LOCAL_SIZE=4"``), for the messages.

    Returns:
        ``(ranks, source)``; ``ranks`` is ``None`` when neither variable holds a positive integer.
    """
    source = "no environment variable"
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        found = os.environ.get(var)
        if found is not None and found.isdigit() and int(found) > 0:
            return int(found), f"{var}={found}"
        if found is not None and source == "no environment variable":
            source = f"{var}={found}"
    return None, source


def setting_error(
    name: str,
    value: object,
    expected: str = "",
    *,
    json: str | None = None,
    show_type: bool = False,
    tail: str = ".",
    message: str | None = None,
    kind: type[Exception] = ValueError,
) -> Exception:
    """The error for an invalid value of one setting: a plain ``ValueError`` (or ``kind``), whose
    ``setting`` attribute (``(name, value, json)``) lets :func:`in_section` render it for the JSON section.

    Args:
        name: The setting (a field of :class:`~hieravg_optim.AveragingConfig`, a JSON key).
        value: The value given.
        expected: What it must be, in Python's words: ``"{name} must be {expected}, got {value!r}"``.
        json: What it must be, in JSON's words (``true``, ``null``); ``None``: as in Python, or, with
            ``message``, the key followed by that message.
        show_type: Add the value's type after it.
        tail: What follows the value (default ``"."``), e.g. a hint.
        message: The whole Python message, when it does not follow the pattern above.
        kind: The exception class; ``TypeError`` for a value of a type torch would reject so.
    """
    if message is None:
        json = expected if json is None else json
        message = f"{name} must be {expected}, got {value!r}{f' ({type(value).__name__})' if show_type else ''}{tail}"
    error = kind(message)
    error.setting = (name, value, json)  # type: ignore[attr-defined]
    return error


def in_section(error: BaseException, section: str) -> ValueError:
    """``error`` as the DeepSpeed config section ``section`` reports it: naming the key for the error of a
    setting (:func:`setting_error`), else with the section's name before the message."""
    setting = getattr(error, "setting", None)
    if setting is None:
        return ValueError(f'DeepSpeed config section "{section}": {error}')
    name, value, json = setting
    where = f'DeepSpeed config section "{section}": key "{name}"'
    if json is None:
        return ValueError(f"{where}: {error}")
    return ValueError(f"{where} must be {json}, got {value!r} ({type(value).__name__}).")


def as_real(value: object) -> object:
    """A number of seconds or MB as a ``float`` (an int too, so that ``25`` and ``25.0`` agree across ranks)."""
    return as_float(value) if is_real(value) else value  # type: ignore[arg-type]


def plain_number(value: object) -> object:
    """Numpy and Python integers as ``int``, other reals as ``float``, anything else as given: the ranks
    compare configs by their repr, so ``warmup_steps=np.int64(8)`` on one rank and ``8`` on another must agree."""
    if is_int(value):
        return int(value)  # type: ignore[arg-type]
    return as_float(value) if is_real(value) else value  # type: ignore[arg-type]


def resolve_ranks_per_node(value: int | str | None) -> int | str | None:
    """``ranks_per_node="auto"`` as the ranks of this node (``LOCAL_WORLD_SIZE``, else ``LOCAL_SIZE``); other values
    as given (numpy integers as ints), for ``__post_init__`` to check.

    Raises:
        ValueError: for ``"auto"`` when neither variable holds a positive integer.
    """
    if value != "auto":
        return plain_number(value)  # type: ignore[return-value]
    ranks, _ = local_world_size()
    if ranks is None:
        raise ValueError(
            'ranks_per_node="auto" reads the ranks of one node from LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE '
            "(deepspeed launcher), but neither is set: pass ranks_per_node as a number of ranks."
        )
    return ranks


class FieldCheck(NamedTuple):
    """The check of one field: ``ok(value)``, else the error of :func:`setting_error` saying what the value must be."""

    ok: Callable[[object], bool]
    expected: str
    """In Python's words: ``"{name} must be {expected}, got {value!r}"``."""
    json: str | None = None
    """In the JSON section's words (``true``, ``null``); ``None``: as in Python."""
    show_type: bool = False
    tail: str = "."

    def __call__(self, name: str, value: object) -> None:
        if not self.ok(value):
            raise setting_error(name, value, self.expected, json=self.json, show_type=self.show_type, tail=self.tail)


def _check_ranks_per_node(levels: Sequence[Any], s: int, n: int | None, world_size: int) -> None:
    if n is None:
        return
    if world_size % n != 0 or n % s != 0:
        raise ValueError(
            f"ranks_per_node={n} must divide the size of the process group ({world_size}) and be a multiple of "
            f"ranks_per_replica={s}: nodes are blocks of ranks_per_node consecutive ranks holding whole replicas. "
            "Set it to the ranks of one node (LOCAL_WORLD_SIZE), or to None for a flat all-reduce."
        )
    for level in levels:
        if level.group_size > n and level.group_size % n != 0:
            raise ValueError(
                f"ranks_per_node={n} must divide group size {level.group_size} of period {level.period}: a level "
                "spanning several nodes averages whole nodes node-aware. Change the group size to a multiple of "
                f"{n}, or set ranks_per_node=None for a flat all-reduce."
            )


def check_world_size(levels: Sequence[Any], s: int, ranks_per_node: int | None, world_size: int) -> None:
    """:meth:`AveragingConfig.check_world_size` on the config's ``levels`` (``AveragingLevel`` objects),
    ``ranks_per_replica`` ``s`` and ``ranks_per_node``: a check across the config and the process group, as
    torchtitan's ``config/validation.py`` checks across configs."""
    if world_size % s != 0:
        raise ValueError(
            f"ranks_per_replica={s} must divide the size of the process group ({world_size}): "
            "every replica is a block of ranks_per_replica consecutive ranks."
        )
    for level in levels:
        if world_size % level.group_size != 0:
            raise ValueError(
                f"Group size {level.group_size} of period {level.period} must divide the size of the "
                f"process group ({world_size})."
            )
        if level.group_size % s != 0:
            raise ValueError(
                f"Group size {level.group_size} of period {level.period} must be a multiple of "
                f"ranks_per_replica={s}: a level averages whole replicas."
            )
    _check_ranks_per_node(levels, s, ranks_per_node, world_size)
    last = levels[-1].group_size
    if last != world_size:
        raise ValueError(
            f"The last group size in period_group_size ({last}, period {levels[-1].period}) must be "
            f"equal to the size of the process group ({world_size}): the top level averages all replicas."
        )
    if levels[-1].period == 1:
        warn_at_caller(
            "The largest period in period_group_size is 1: averaging parameters every step costs at least "
            "as much as all-reducing gradients. Use plain DDP / ZeRO / FSDP instead.",
        )
    for lower, upper in zip(levels, levels[1:]):
        if upper.group_size % lower.group_size != 0:
            warn_at_caller(
                f"Group size {lower.group_size} (period {lower.period}) does not divide group size "
                f"{upper.group_size} (period {upper.period}): the levels' groups do not nest, so this is "
                "not a hierarchy. It is legal, as in torch, but rarely intended.",
            )
    if world_size == s:
        warn_at_caller(
            f"ranks_per_replica={s} is the size of the process group: there is a single replica, so "
            "hierarchical averaging never averages anything. Lower ranks_per_replica (e.g. to the ranks of "
            "one node).",
        )
        return
    for level in levels[:-1]:
        if level.group_size == s:
            warn_at_caller(
                f"Level with period {level.period} has group size {level.group_size} == ranks_per_replica: "
                "its groups hold a single replica, so it never averages anything. Remove it.",
            )

"""The wire dtype of each level (``comm_dtype``): parsing, validation and lookup.

A level's *wire dtype* is the dtype its tensors are all-reduced in. By default it is
each tensor's own dtype, as in torch's ``average_parameters`` and DDP: bfloat16
parameters travel as bfloat16, float32 ones as float32; float16 ones travel as float32
(the sum is formed before the division, and float16 overflows at 65504; ``"fp16"``
sends them as float16). A level may instead send
every floating-point tensor in one dtype: ``"float32"`` sums float16 and bfloat16
tensors in float32 (no overflow, no lost low bits, twice the bytes), and
``"bfloat16"`` halves the bytes of float32 master weights (ZeRO, FSDP mixed
precision) on a slow link: they are rounded on the wire only, the tensors keep
their dtype. Complex tensors always travel in their own dtype.

Everything here is local (no collective), so a bad value raises on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

import torch

from ._validation import setting_error
from .schedule import AveragingLevel, per_level

__all__ = ["COMM_DTYPES", "CommDtype", "parse_comm_dtype", "wire_dtype"]

COMM_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
"""The canonical wire dtype names and their torch dtypes."""

_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}
_DEFAULTS = (None, "auto", "native")
"""Values meaning "each tensor's own dtype"."""

CommDtype = Union[str, torch.dtype, None, Mapping[Union[int, str], Union[str, torch.dtype, None]]]
"""What ``comm_dtype`` accepts: one value for every level, or ``{period: value}``."""


def _one(value: object, where: str) -> str | None:
    if isinstance(value, torch.dtype):
        for name, dtype in COMM_DTYPES.items():
            if dtype == value:
                return name
    elif value is None or isinstance(value, str):
        key = value.strip().lower() if isinstance(value, str) else None
        if key in _DEFAULTS:
            return None
        key = _ALIASES.get(key, key)  # type: ignore[arg-type]
        if key in COMM_DTYPES:
            return key
    raise setting_error(
        "comm_dtype",
        value,
        # JSON names the key for a value of another type (a number); a wrong name keeps this message.
        json=None if isinstance(value, (str, torch.dtype)) else 'a dtype name such as "bf16", or {"period": "bf16"}',
        message=f"comm_dtype{where} must be one of {list(COMM_DTYPES)} (or an alias: {sorted(_ALIASES)}), a matching "
        f"torch.dtype, or None / \"auto\" for each tensor's own dtype; got {value!r} ({type(value).__name__}).",
    )


def parse_comm_dtype(value: CommDtype, levels: tuple[AveragingLevel, ...]) -> tuple[str | None, ...]:
    """The wire dtype name of each level (``None``: each tensor's own dtype), in level order.

    Args:
        value: One dtype for every level (a name such as ``"bf16"`` or ``"float32"``, a
            ``torch.dtype``, or ``None`` / ``"auto"``), or a mapping ``{period: dtype}``
            whose keys are periods of ``levels`` (ints, or strings of digits as in JSON);
            the levels it omits use each tensor's own dtype.
        levels: The levels of the config.

    Returns:
        One canonical name (a key of :data:`COMM_DTYPES`) or ``None`` per level; ``()``
        when every level uses each tensor's own dtype.

    Raises:
        ValueError: naming the value (and the period), for an unknown dtype, a period
            that is not one of the levels', or a period given twice (``{"4": ..., 4: ...}``).
    """
    example = f'{{"{levels[-1].period}": "bf16"}}'
    return per_level(value, levels, "comm_dtype", _one, None, example)


def wire_dtype(dtype: torch.dtype, comm_dtype: str | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in, at a level whose wire dtype name is ``comm_dtype``.

    ``None`` (the default) keeps ``dtype``, except float16, which travels as float32: the sum is
    formed before the division, and a float16 sum of a few values near float16's largest (65504)
    would overflow, where torch's ``average_parameters`` divides first. The float8 dtypes
    (``float8_e4m3fn``, ``float8_e5m2``, ...) travel as float32 too: gloo cannot sum them, and their
    sums would overflow even sooner (448 for ``float8_e4m3fn``). Complex dtypes always keep theirs.
    """
    if dtype.is_complex:
        return dtype
    if comm_dtype is None:
        return torch.float32 if dtype == torch.float16 or dtype.itemsize == 1 else dtype
    return COMM_DTYPES[comm_dtype]

"""The settings ``compress`` and ``ef_decay``: their user forms, parsed into one canonical value per level.

``compress`` takes one spec for every level or ``{period: spec}``; a spec is ``None``, ``"int8"``,
``{"type": "int8", "block": 256}``, ``{"type": "topk", "density": 0.01, "chunk": 4096, "values": "int8"}``
(or a :class:`~hieravg_optim.compression.codecs.Int8Block` / :class:`~hieravg_optim.compression.codecs.TopK`).
``ef_decay`` takes one number in ``[0, 1]`` or ``{period: number}``. Everything here is local (no collective),
so a bad value raises on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Union

from .._validation import is_real, plain_number, setting_error
from ..comm_dtype import _ALIASES
from ..schedule import AveragingLevel, entries_by_period
from .codecs import VALUE_DTYPES, Codec, Int8Block, TopK

__all__ = ["CompressSpec", "check_compress", "parse_compress", "parse_ef_decay"]

CompressSpec = Union[None, str, Codec, Mapping[str, Any], Mapping[Union[int, str], Any]]
"""What ``compress`` accepts: one spec for every level, or ``{period: spec}``."""

_EXAMPLE = '"int8", {"type": "int8", "block": 256} or {"type": "topk", "density": 0.01, "values": "int8"}'
_JSON = f'null, {_EXAMPLE}, or {{"period": one of those}}'
_KEYS = {"int8": ("type", "block"), "topk": ("type", "density", "chunk", "values")}


def _error(value: object, where: str, why: str) -> ValueError:
    return setting_error(  # type: ignore[return-value]
        "compress", value, json=None, message=f"compress{where}: {why} (given {value!r}, {type(value).__name__})."
    )


def _one(value: object, where: str, comm_dtype: str | None) -> Codec | None:
    """One level's spec in its canonical form; ``comm_dtype``: the level's wire dtype name (the dtype of top-k
    values that the spec does not name)."""
    if value is None or isinstance(value, (Int8Block, TopK)):
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        key = value.strip().lower()
        if key in ("none", ""):
            return None
        if key == "int8":
            return Int8Block()
        if key == "topk":
            raise _error(value, where, 'needs a density: pass {"type": "topk", "density": 0.01, "values": "int8"}')
        raise _error(value, where, f"must name a codec: {_EXAMPLE}, or None")
    if not isinstance(value, Mapping) or "type" not in value:
        raise _error(value, where, f"must be None, {_EXAMPLE}")
    kind = str(value["type"]).strip().lower()
    if kind not in _KEYS:
        raise _error(value, where, f'names an unknown codec {value["type"]!r}: the codecs are "int8" and "topk"')
    unknown = [k for k in value if k not in _KEYS[kind]]
    if unknown:
        raise _error(value, where, f"has unknown key {unknown[0]!r}: a {kind} spec has the keys {list(_KEYS[kind])}")
    try:
        if kind == "int8":
            return Int8Block(block=plain_number(value.get("block", 256)))  # type: ignore[arg-type]
        if "density" not in value:
            raise ValueError('compress: a top-k spec needs a density, e.g. {"type": "topk", "density": 0.01}.')
        density = value["density"]
        density = float(density) if is_real(density) and math.isfinite(float(density)) else density
        values = value.get("values")
        if values is None:
            values = comm_dtype if comm_dtype is not None else "int8"
        elif isinstance(values, str):
            values = _ALIASES.get(values.strip().lower(), values.strip().lower())
        return TopK(density=density, chunk=plain_number(value.get("chunk", 4096)), values=values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise _error(value, where, str(exc).removeprefix("compress: ").rstrip(".")) from None


def parse_compress(
    value: CompressSpec, levels: Sequence[AveragingLevel], comm_dtype: Sequence[str | None] = ()
) -> tuple[Codec | None, ...]:
    """The codec of each level (``None``: uncompressed), in level order; ``()`` when no level is compressed.

    Args:
        value: One spec for every level, or ``{period: spec}`` (keys as for ``comm_dtype``, JSON strings too);
            a mapping with a ``"type"`` key is one spec.
        levels: The levels of the config.
        comm_dtype: The canonical ``comm_dtype`` (one name or ``None`` per level, or ``()``): the dtype of the
            kept values of a top-k spec that names none.

    Raises:
        ValueError: naming the value (and the period), for an unknown codec or key, a block or chunk that is not a
            positive integer, a density outside ``(0, 1]`` or too small to keep an element of a chunk.
    """
    wire = list(comm_dtype) if comm_dtype else [None] * len(levels)
    if isinstance(value, Mapping) and "type" not in value:
        periods = [lv.period for lv in levels]
        example = f'{{"{periods[-1]}": "int8"}}'
        by_period = {
            period: (key, spec) for period, key, spec in entries_by_period(value, levels, "compress", example)
        }
        specs = tuple(
            _one(by_period[lv.period][1], f"[{by_period[lv.period][0]!r}]", w) if lv.period in by_period else None
            for lv, w in zip(levels, wire)
        )
    else:
        specs = tuple(_one(value, "", w) for w in wire)
    return () if all(s is None for s in specs) else specs


def check_compress(compress: tuple, comm_dtype: tuple, levels: Sequence[AveragingLevel]) -> None:
    """Check the canonical ``compress`` against the levels and ``comm_dtype`` (from ``__post_init__``).

    Raises:
        ValueError: for a value that is not one codec (or ``None``) per level, an int8 level with a
            ``comm_dtype`` (int8 is its wire), or a top-k level whose values differ from its ``comm_dtype``.
    """
    if not (isinstance(compress, tuple) and len(compress) in (0, len(levels))) or any(
        c is not None and not isinstance(c, (Int8Block, TopK)) for c in compress
    ):
        raise setting_error("compress", compress, "one codec (or None) per level, or () (build it with create())")
    for lv, spec, wire in zip(levels, compress, comm_dtype or (None,) * len(levels)):
        if spec is None or wire is None:
            continue
        if isinstance(spec, Int8Block):
            raise setting_error(
                "compress", spec.describe(), json=None,
                message=f"compress of period {lv.period} is int8, which is its own wire dtype, but comm_dtype of that "
                f"period is {wire!r}: drop comm_dtype for that period (or use top-k, whose values may travel in it).",
            )  # fmt: skip
        if spec.values != wire:
            raise setting_error(
                "compress", spec.describe(), json=None,
                message=f"compress of period {lv.period} sends top-k values as {spec.values!r}, but comm_dtype of that "
                f"period is {wire!r}: give one of them (comm_dtype is the dtype of top-k values the spec does not "
                f"name; one of {list(VALUE_DTYPES)}).",
            )  # fmt: skip


def _decay(value: object, where: str) -> float:
    if not is_real(value) or not 0 <= float(value) <= 1:  # type: ignore[arg-type]
        raise setting_error(
            "ef_decay", value, json=None,
            message=f"ef_decay{where} must be a number in [0, 1] (1: plain error feedback, 0: none), got {value!r} "
            f"({type(value).__name__}).",
        )  # fmt: skip
    return float(value)  # type: ignore[arg-type]


def parse_ef_decay(
    value: float | Mapping[int | str, float] | None, levels: Sequence[AveragingLevel], compress: tuple
) -> tuple[float, ...]:
    """The error-feedback decay of each level, in level order; ``()`` when every level has the default, 1.0.

    Raises:
        ValueError: for a value outside ``[0, 1]``, or a period (in ``{period: decay}``) that is not a period of a
            level or has no ``compress``.
    """
    if value is None:
        return ()
    if isinstance(value, Mapping):
        periods = [lv.period for lv in levels]
        specs = compress or (None,) * len(levels)
        example = f'{{"{periods[-1]}": 0.9}}'
        by_period = {}
        for period, key, decay in entries_by_period(value, levels, "ef_decay", example):
            if specs[periods.index(period)] is None:
                raise setting_error(
                    "ef_decay", value, json=None,
                    message=f"ef_decay[{key!r}]: the level of period {period} has no compress, so it keeps no "
                    "error feedback: give ef_decay for compressed levels only.",
                )  # fmt: skip
            by_period[period] = _decay(decay, f"[{key!r}]")
        decays = tuple(by_period.get(p, 1.0) for p in periods)
    else:
        decays = (_decay(value, ""),) * len(levels)
    return () if all(d == 1.0 for d in decays) else decays


def check_ef_decay(ef_decay: tuple, levels: Sequence[AveragingLevel]) -> None:
    """Check the canonical ``ef_decay`` (from ``__post_init__``)."""
    if not (isinstance(ef_decay, tuple) and len(ef_decay) in (0, len(levels))):
        raise setting_error("ef_decay", ef_decay, "one number in [0, 1] per level, or () (build it with create())")
    for d in ef_decay:
        _decay(d, "")

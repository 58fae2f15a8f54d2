"""Outer optimizers per level (DiLoCo, HALoS): anchors, pseudo-gradients and the outer step.

Plain hierarchical averaging replaces a level's tensors by their group mean. With an outer
optimizer at that level, the mean instead gives a *pseudo-gradient* ``g = anchor - mean``,
where the *anchor* is a copy of the tensors taken after the level's previous round (or at the
end of the warm-up), and an ordinary ``torch.optim.Optimizer`` over the anchors steps with it;
the tensors then take the anchor's new value (DiLoCo, https://arxiv.org/abs/2311.08105, one
level; HALoS, https://arxiv.org/abs/2506.04531, one outer optimizer per level of a hierarchy;
the sign is torchft's, so that outer SGD with lr 1 and no momentum gives back the mean).

This module holds the outer optimizers' factories: the validation of ``outer_optimizers``
(:func:`check_outer_optimizers`, :func:`check_outer`), the probe of each factory, the build of
an outer optimizer, and the usual factory (:func:`nesterov_outer`). The per-level state at run
time (anchors, the outer step) is :mod:`hieravg_optim.anchors`. Everything here is local (no
collective).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .schedule import AveragingLevel, entries_by_period

__all__ = [
    "OuterFactory",
    "PLAIN_OUTER",
    "build_outer_optimizer",
    "check_outer_optimizers",
    "check_outer_state_device",
    "dry_step",
    "nesterov_outer",
    "probe_factory",
]

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds a level's outer optimizer over that level's anchor tensors (fp32, one per averaged tensor)."""


class _NesterovOuter:
    """The factory :func:`nesterov_outer` returns: picklable, with a readable ``repr``."""

    __slots__ = ("lr", "momentum")

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum

    def __call__(self, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(tensors, lr=self.lr, momentum=self.momentum, nesterov=True)

    def __repr__(self) -> str:
        return f"nesterov_outer(lr={self.lr!r}, momentum={self.momentum!r})"


class _PlainOuter:
    """The factory of a compressed level without an outer optimizer: outer SGD with lr 1 and no momentum."""

    __slots__ = ()

    def __call__(self, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(tensors, lr=1.0)

    def __repr__(self) -> str:
        return "PLAIN_OUTER"


PLAIN_OUTER: OuterFactory = _PlainOuter()
"""Outer SGD with lr 1 and no momentum: ``anchor - (anchor - mean) = mean``, plain averaging through anchors.
The implicit outer optimizer of a compressed level that has none (``compress``): its anchors give the
pseudo-gradient the level compresses."""


def nesterov_outer(lr: float = 0.7, momentum: float = 0.9) -> OuterFactory:
    """The usual outer optimizer: ``torch.optim.SGD(anchors, lr, momentum, nesterov=True)``.

    DiLoCo (https://arxiv.org/abs/2311.08105) found Nesterov SGD with lr 0.7 and momentum 0.9
    the best outer optimizer; torchft and HALoS (https://arxiv.org/abs/2506.04531) use it too.
    The outer optimizer holds one fp32 momentum buffer per anchor tensor (after its first step).

    Args:
        lr: The outer learning rate, a positive finite number (1 with ``momentum`` 0 would be plain
            averaging, but Nesterov needs a positive momentum).
        momentum: The outer momentum, in ``(0, 1)``.

    Returns:
        A factory for ``outer_optimizers={period: factory}``.

    Raises:
        ValueError: for a non-positive or non-finite ``lr``, or a ``momentum`` outside ``(0, 1)``.

    Example::

        >>> opt = HierarchicalAveragingOptimizer(
        ...     torch.optim.AdamW(model.parameters(), lr=1e-3), {8: 8, 64: dist.get_world_size()},
        ...     outer_optimizers={64: nesterov_outer(lr=0.7, momentum=0.9)})
    """
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"nesterov_outer lr must be a positive finite number, got {lr!r}; DiLoCo uses lr=0.7.")
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 < momentum < 1:
        raise ValueError(
            f"nesterov_outer momentum must be in (0, 1) (Nesterov needs a positive momentum), got {momentum!r}; "
            "DiLoCo uses momentum=0.9. For outer SGD without momentum pass "
            "lambda tensors: torch.optim.SGD(tensors, lr=...) instead."
        )
    return _NesterovOuter(float(lr), float(momentum))


def check_outer_optimizers(
    value: Mapping[int | str, OuterFactory] | None, levels: Sequence[AveragingLevel]
) -> dict[int, OuterFactory]:
    """Validate ``outer_optimizers``; local, no collective.

    Args:
        value: ``{period: factory}`` or ``None``. Keys are periods of ``levels``: ints, numpy
            integers, or strings of digits as in JSON (as ``period_group_size_dict`` accepts).
            Values are callables ``factory(tensors) -> torch.optim.Optimizer``.
        levels: The levels of the config.

    Returns:
        ``{period: factory}`` with int keys, in level order; ``{}`` for ``None`` or an empty mapping.

    Raises:
        TypeError: if ``value`` is not a mapping, or a factory is not callable (naming the period).
        ValueError: for a key that is not the period of a level, or a period given twice
            (``{"4": ..., 4: ...}``).
    """
    if value is None:
        return {}
    periods = [lv.period for lv in levels]
    if not isinstance(value, Mapping):
        raise TypeError(
            f"outer_optimizers must be a mapping {{period: factory}}, got {type(value).__name__}: pass e.g. "
            f"outer_optimizers={{{periods[-1]}: hieravg_optim.nesterov_outer()}}."
        )
    by_period: dict[int, OuterFactory] = {}
    example = f"outer_optimizers={{{periods[-1]}: hieravg_optim.nesterov_outer()}}"
    for period, key, factory in entries_by_period(value, levels, "outer_optimizers", example):
        if not callable(factory):
            raise TypeError(
                f"outer_optimizers[{key!r}] must be a factory, a callable that builds the outer optimizer from the "
                f"level's anchor tensors (tensors -> torch.optim.Optimizer), got {factory!r} "
                f"({type(factory).__name__}): pass e.g. hieravg_optim.nesterov_outer(lr=0.7, momentum=0.9) or "
                "lambda tensors: torch.optim.SGD(tensors, lr=0.7, momentum=0.9, nesterov=True)."
            )
        by_period[period] = factory
    return {p: by_period[p] for p in periods if p in by_period}


def check_outer_state_device(value: str | torch.device | None) -> torch.device | None:
    """Validate ``outer_state_device``; local, no collective.

    Returns:
        The device, or ``None`` (anchors and outer state on each tensor's own device).

    Raises:
        TypeError: if ``value`` is not ``None``, a string or a ``torch.device``.
        ValueError: for a string that is not a device, or a device whose backend is not available here.
    """
    if value is None:
        return None
    if not isinstance(value, (str, torch.device)):
        raise TypeError(
            f"outer_state_device must be None, a device name or a torch.device, got {value!r} "
            f'({type(value).__name__}): pass e.g. outer_state_device="cpu" to keep anchors and outer optimizer '
            "state in host memory."
        )
    try:
        device = torch.device(value)
    except RuntimeError as exc:
        raise ValueError(
            f'outer_state_device {value!r} is not a device: pass "cpu" (host memory), or None for each tensor\'s '
            f"own device ({exc})."
        ) from None
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        available = getattr(module, "is_available", None)
        if available is None or not available():
            raise ValueError(
                f'outer_state_device {value!r}: no {device.type} device is available on this machine; pass "cpu" '
                "or None (each tensor's own device)."
            )
    return device


def _level_name(period: int, group_size: int | None) -> str:
    """``outer_optimizers[period]`` and, when known, the level it belongs to, for error messages."""
    if group_size is None:
        return f"outer_optimizers[{period}]"
    return f"outer_optimizers[{period}] (the level of period {period}, group size {group_size})"


def _check_factory_result(
    optimizer: object,
    period: int,
    factory: OuterFactory,
    tensors: Sequence[torch.Tensor],
    group_size: int | None = None,
) -> torch.optim.Optimizer:
    """``optimizer`` if it is a ``torch.optim.Optimizer`` over exactly ``tensors`` (each once, by identity)."""
    name = _level_name(period, group_size)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{name}: the factory {factory!r} returned {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer: the factory must build the optimizer over the tensors it is given, e.g. "
            "lambda tensors: torch.optim.SGD(tensors, lr=0.7, momentum=0.9, nesterov=True)."
        )
    held = [p for group in optimizer.param_groups for p in group["params"]]
    given = {id(t) for t in tensors}
    if len(held) != len(tensors) or {id(p) for p in held} != given:
        foreign = sum(id(p) not in given for p in held)
        raise TypeError(
            f"{name}: the factory {factory!r} built an optimizer over {len(held)} tensor(s) ({foreign} of "
            f"them not among those it was given), but the factory must build the optimizer over exactly the "
            f"{len(tensors)} tensor(s) it is given, each once: they are the level's anchors, which the outer step "
            "updates (not the model's parameters, nor copies, nor an optimizer built once and returned again), e.g. "
            "lambda tensors: torch.optim.SGD(tensors, lr=0.7, momentum=0.9, nesterov=True)."
        )
    return optimizer


def build_outer_optimizer(
    period: int, group_size: int | None, factory: OuterFactory, tensors: Sequence[torch.Tensor]
) -> torch.optim.Optimizer:
    """``factory(tensors)``, checked; every failure names the level and the fix. Local, no collective.

    Raises:
        TypeError: if the factory returns something other than a ``torch.optim.Optimizer`` over exactly
            ``tensors``, or raises a ``TypeError`` itself.
        ValueError: if the factory raises a ``ValueError`` (e.g. torch.optim rejecting a hyperparameter).
        RuntimeError: if the factory raises anything else (e.g. out of memory for the outer state).
            The factory's own exception is chained (``__cause__``) and quoted.
    """
    try:
        result = factory(tensors)
    except Exception as exc:  # noqa: BLE001 - re-raised below, naming the level
        shapes = [tuple(t.shape) for t in tensors]
        listed = shapes if len(shapes) <= 4 else [*shapes[:4], f"... {len(shapes) - 4} more"]
        kind = TypeError if isinstance(exc, TypeError) else ValueError if isinstance(exc, ValueError) else RuntimeError
        raise kind(
            f"{_level_name(period, group_size)}: the factory {factory!r} raised {type(exc).__name__}: {exc} when "
            f"building the outer optimizer over the level's {len(tensors)} fp32 anchor tensor(s) of shapes "
            f"{listed} on {sorted({str(t.device) for t in tensors})}. The factory must accept any number of "
            "tensors of any shape (at construction it was only probed on one one-element tensor), e.g. "
            "lambda tensors: torch.optim.SGD(tensors, lr=0.7, momentum=0.9, nesterov=True); if the outer state does "
            'not fit in memory, pass outer_state_device="cpu" or put the outer optimizer on fewer levels.'
        ) from exc
    return _check_factory_result(result, period, factory, tensors, group_size)


def _simple(value: object) -> object:
    """``value`` if its ``repr`` is the same in every process (numbers, strings, tuples of them), else its type."""
    if value is None or isinstance(value, (bool, numbers.Number, str)):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_simple(v) for v in value)
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    return type(value).__qualname__


def probe_factory(
    period: int, factory: OuterFactory, group_size: int | None = None
) -> tuple[str, dict[str, object]] | None:
    """Call ``factory`` on one small fp32 tensor; check that it returns a ``torch.optim.Optimizer`` over it.

    Run at construction, so that a factory returning something else, or an optimizer over other tensors
    (the model's parameters, copies, an optimizer built once for every level), is a ``TypeError`` on every
    rank before any collective, not at the end of the warm-up; a non-finite hyperparameter, or
    ``maximize=True``, a ``ValueError``. A factory that raises on this probe (e.g. it
    expects a given number of tensors) is left to :meth:`OuterLevel.take`.

    Returns:
        What the ranks must agree on: the optimizer's class and its hyperparameters (``defaults``), or
        ``None`` if the factory raised on the probe.
    """
    probe = [torch.zeros(1, dtype=torch.float32)]
    try:
        result = factory(probe)
    except Exception:  # noqa: BLE001 - the real tensors decide, at take()
        return None
    optimizer = _check_factory_result(result, period, factory, probe, group_size)
    _check_hyperparameters(optimizer, _level_name(period, group_size), factory)
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}", {k: _simple(v) for k, v in sorted(optimizer.defaults.items())}


def _check_hyperparameters(optimizer: torch.optim.Optimizer, name: str, factory: OuterFactory) -> None:
    """Raise ``ValueError`` for a non-finite hyperparameter, or ``maximize=True`` (steps away from the mean)."""
    for key, value in optimizer.defaults.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if torch.is_tensor(v):
                finite = bool(torch.isfinite(v).all())
            else:
                finite = not isinstance(v, float) or math.isfinite(v)
            if not finite:
                raise ValueError(
                    f"{name}: the factory {factory!r} builds {type(optimizer).__name__} with {key}={value!r}: "
                    "every hyperparameter of an outer optimizer must be finite (a NaN or infinite one makes every "
                    "anchor non-finite at the first round); DiLoCo uses lr=0.7, momentum=0.9."
                )
    if optimizer.defaults.get("maximize") is True:
        raise ValueError(
            f"{name}: the factory {factory!r} builds {type(optimizer).__name__} with maximize=True: the "
            "pseudo-gradient is anchor - mean (torchft's sign), so maximizing would step the anchors away from the "
            "mean at every round. Leave maximize=False."
        )


def _meta_state(value: object) -> object:
    """``value`` with every tensor of one or more dimensions replaced by a meta tensor of its shape (no memory),
    and every scalar tensor cloned: an outer optimizer state dict a dry run may load and step."""
    if torch.is_tensor(value):
        return torch.empty_like(value, device="meta") if value.dim() > 0 else value.clone()
    if isinstance(value, Mapping):
        return {k: _meta_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_meta_state(v) for v in value)
    return value


@torch.no_grad()
def dry_step(factory: OuterFactory, anchors: Sequence[torch.Tensor], state: Mapping[str, Any] | None) -> None:
    """Build the outer optimizer over meta copies of ``anchors``, load ``state`` (if any) and step once."""
    params = [torch.empty_like(a, device="meta") for a in anchors]
    optimizer = factory(params)
    if state is not None:
        optimizer.load_state_dict(_meta_state(state))
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer.step()

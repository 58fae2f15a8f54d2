"""The wrapper's inner optimizer: its step under ``GradScaler``, its state made without a step, the saved count.

:class:`~hieravg_optim.HierarchicalAveragingOptimizer` steps an inner optimizer and then
averages. Two things around that inner step live here:

* :func:`inner_step`: ``torch.amp.GradScaler``'s protocol for an optimizer that sets
  ``_step_supports_amp_scaling`` (the scaler hands it ``grad_scale`` and ``found_inf`` and
  always calls its ``step``): the inner step is skipped on a rank with inf/NaN gradients, the
  gradients are unscaled as ``GradScaler.unscale_`` does, or both values are passed on to an
  inner optimizer that supports amp scaling itself;
* :func:`initialize_state` / :func:`initialize_state_step` / :func:`drop_initialized_state`: the inner state (Adam
  moments, momentum) created by a step with zero gradients, lr 0 and weight decay 0, as
  torch's ``torch.distributed.checkpoint.state_dict._init_optim_state`` does, with every
  ``"step"`` entry set back to 0, and dropped again before the next real step;
  :func:`called_by_torch_state_init` recognises torch's own call;

All of it is local: no collective.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .checkpoint import GROUP_STEP_KEY, STATE_KEY, pop_group_step, split_count  # re-exported: their old import path
from .config import is_int
from .nonfinite import repair_skipped_replica_state, zero_nonfinite_state  # re-exported: their old import path

__all__ = [
    "GROUP_STEP_KEY",
    "STATE_KEY",
    "called_by_torch_state_init",
    "drop_initialized_state",
    "initialize_state",
    "initialize_state_step",
    "inner_step",
    "pop_group_step",
    "run_step_hooks",
    "split_count",
    "unscale_grads",
    "repair_skipped_replica_state",
    "zero_nonfinite_state",
]

_TORCH_STATE_INIT = ("_init_optim_state", "torch.distributed.checkpoint.state_dict")
"""torch's function that fills an empty optimizer state by calling ``step(closure=None)`` with zero
gradients and lr 0 (``get_optimizer_state_dict``, ``set_optimizer_state_dict``, ``get_state_dict``, ...)."""

InitializedState = tuple[Any, dict[int, Any]]
"""What :func:`initialize_state_step` made: the state container and its new entries, by parameter id."""


def called_by_torch_state_init(max_depth: int = 4) -> bool:
    """Whether torch's state-initialising function is among the ``max_depth`` frames above the caller's caller.

    Matched by function name and module (not by code object), so a moved import still matches; the
    LR schedulers' patched ``step`` may sit in between. If torch ever fills the state another way,
    :meth:`HierarchicalAveragingOptimizer.initialize_state` before the first save does the same explicitly.
    """
    frame = sys._getframe(2)
    name, module = _TORCH_STATE_INIT
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code.co_name == name and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


def inner_step(
    inner: torch.optim.Optimizer,
    closure: Callable[[], float] | None,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
):
    """The inner step, or none when a ``GradScaler`` found inf/NaN gradients on this rank.

    Args:
        inner: The inner optimizer.
        closure: Passed to ``inner.step``, if not ``None``.
        grad_scale: The scale ``GradScaler.step`` set on the wrapper (0-dim float32 tensor), or
            ``None`` (no scaler, or ``scaler.unscale_`` already ran).
        found_inf: 0-dim float32 tensor, nonzero where an inf/NaN gradient was found, or ``None``.

    Returns:
        The inner step's return value (the closure's loss), or ``None`` if the step was skipped.
    """
    args = () if closure is None else (closure,)
    if grad_scale is None and found_inf is None:
        return inner.step(*args)
    if getattr(inner, "_step_supports_amp_scaling", False):
        # A fused optimizer unscales and skips by itself (GradScaler's protocol, one level down).
        inner.grad_scale, inner.found_inf = grad_scale, found_inf
        try:
            return inner.step(*args)
        finally:
            del inner.grad_scale, inner.found_inf
    if found_inf is not None and bool(found_inf.item()):
        return None  # what GradScaler does for an optimizer without amp support: skip its step
    if grad_scale is not None:  # None: the user already called scaler.unscale_(opt)
        unscale_grads(inner.param_groups, grad_scale)
    return inner.step(*args)


def unscale_grads(param_groups: list[dict[str, Any]], grad_scale: torch.Tensor) -> None:
    """Divide the gradients of ``param_groups`` by ``grad_scale`` in place, as ``GradScaler.unscale_`` does."""
    inv_scale = grad_scale.double().reciprocal().float()
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    p.grad = grad = grad.coalesce()
                grad = grad._values()
            by_device.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), grads in by_device.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))


def initialize_state(inner: torch.optim.Optimizer) -> InitializedState | None:
    """Create ``inner``'s state with zero gradients and lr 0 (see :func:`initialize_state_step`).

    Gradients and learning rates are restored afterwards. ``None`` (nothing done) if ``inner``
    already has state.
    """
    if inner.state:
        return None
    params = [p for group in inner.param_groups for p in group["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in inner.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in inner.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
    try:
        return initialize_state_step(inner)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        for group, lr in zip(inner.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr


def initialize_state_step(inner: torch.optim.Optimizer) -> InitializedState:
    """``inner``'s step with weight decay 0 (lr and gradients already 0), then its new ``"step"`` entries reset to 0.

    Returns:
        The state container and its entries, for :func:`drop_initialized_state`.
    """
    decays = [group.get("weight_decay") for group in inner.param_groups]
    for group in inner.param_groups:
        if "weight_decay" in group:
            group["weight_decay"] = 0.0
    try:
        inner.step()
    finally:
        for group, decay in zip(inner.param_groups, decays):
            if decay is not None:
                group["weight_decay"] = decay
    for entry in inner.state.values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if torch.is_tensor(step):
            step.zero_()
        elif is_int(step) or isinstance(step, float):
            entry["step"] = type(step)(0)
    return inner.state, {id(p): entry for p, entry in inner.state.items()}


def drop_initialized_state(inner: torch.optim.Optimizer, made: InitializedState) -> None:
    """Remove from ``inner``'s state the entries :func:`initialize_state_step` made, if nothing replaced them."""
    container, entries = made
    if inner.state is container:
        for p in [p for p, entry in container.items() if entries.get(id(p)) is entry]:
            del container[p]


def run_step_hooks(optimizer: torch.optim.Optimizer, step: Callable[..., Any], closure: Callable[[], float] | None):
    """``step(closure)`` between ``optimizer``'s own step pre- and post-hooks, as ``torch.optim.Optimizer`` runs
    them (a pre-hook may return new ``(args, kwargs)``); returns what ``step`` returns."""
    args: tuple = (optimizer,) if closure is None else (optimizer, closure)
    kwargs: dict[str, Any] = {}
    for pre_hook in list(optimizer._optimizer_step_pre_hooks.values()):
        result = pre_hook(optimizer, args, kwargs)
        if result is not None:
            if isinstance(result, tuple) and len(result) == 2:
                args, kwargs = result
            else:
                raise RuntimeError(f"A step pre-hook must return None or a tuple (new_args, new_kwargs), got {result!r}.")
    loss = step(*args[1:], **kwargs)
    for post_hook in list(optimizer._optimizer_step_post_hooks.values()):
        post_hook(optimizer, args, kwargs)
    return loss

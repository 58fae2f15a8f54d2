"""The wrapper's inner optimizer: its step under ``GradScaler``, its state made without a step, the saved count.

:class:`~hieravg_optim.HierarchicalAveragingOptimizer` steps an inner optimizer and then
averages. Three things around that inner step live here:

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
* :func:`split_count` / :func:`pop_group_step`: the count of a saved state dict, under
  :data:`STATE_KEY`, the top-level ``"step"`` (torch's format), or in every parameter group
  under :data:`GROUP_STEP_KEY`, which torch's optimizer-state helpers keep.

All of it is local: no collective.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .config import is_int

__all__ = [
    "GROUP_STEP_KEY",
    "STATE_KEY",
    "called_by_torch_state_init",
    "drop_initialized_state",
    "initialize_state",
    "initialize_state_step",
    "inner_step",
    "pop_group_step",
    "split_count",
    "unscale_grads",
    "repair_skipped_replica_state",
    "zero_nonfinite_state",
]

STATE_KEY = "hierarchical_averaging"
"""Key under which :meth:`HierarchicalAveragingOptimizer.state_dict` stores the averaging state."""

GROUP_STEP_KEY = "hierarchical_averaging_step"
"""Key under which :meth:`HierarchicalAveragingOptimizer.state_dict` also writes the count into every
parameter group: torch's optimizer-state helpers (DCP's ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``, FSDP1's ``optim_state_dict`` / ``optim_state_dict_to_load``) keep only
``"state"`` and ``"param_groups"``, and keep a group's extra keys."""

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


def zero_nonfinite_state(inner: torch.optim.Optimizer) -> list[str]:
    """Set every NaN and infinity in ``inner``'s state tensors to 0, in place; local, no collective.

    For a replica whose averaged tensors ``nonfinite="skip_replica"`` has just replaced by the
    finite replicas' mean: a NaN gradient that reached the inner step leaves NaN in its state too
    (SGD's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq``), and the next inner step
    would write it back into the parameters, so that the replica is skipped again at every round.
    The state restarts at 0 at those elements only (as a fresh optimizer's moments do); finite
    elements and the ``"step"`` counts are left as they are. Every floating-point and complex
    tensor of ``inner.state`` is checked (:func:`hieravg_optim.agreement.has_nonfinite`), one read.

    Returns:
        The entries changed, as ``"state[i][name]"`` (``i`` the parameter's index in ``param_groups``,
        else its position in ``state``), in order; empty if the state was finite.
    """
    from .agreement import has_nonfinite

    index = {id(p): i for i, p in enumerate(p for group in inner.param_groups for p in group["params"])}
    changed = []
    with torch.no_grad():
        for position, (param, entry) in enumerate(inner.state.items()):
            if not isinstance(entry, Mapping):
                continue
            for name, value in entry.items():
                if torch.is_tensor(value) and (value.is_floating_point() or value.is_complex()) and has_nonfinite([value]):
                    torch.nan_to_num_(value, nan=0.0, posinf=0.0, neginf=0.0)
                    changed.append(f"state[{index.get(id(param), position)}][{name!r}]")
    return changed


def repair_skipped_replica_state(inner: object, count: int) -> list[str]:
    """:func:`zero_nonfinite_state` on ``inner`` after the round at ``count`` replaced this replica's tensors.

    Logs a warning naming the changed entries through the ``hieravg_optim.optimizer`` logger. A no-op
    for an ``inner`` that is not a ``torch.optim.Optimizer``. Local, no collective.

    Returns:
        The entries changed (see :func:`zero_nonfinite_state`).
    """
    if not isinstance(inner, torch.optim.Optimizer):
        return []
    changed = zero_nonfinite_state(inner)
    if changed:
        logging.getLogger(__package__ + ".optimizer").warning(
            "rank %s: the averaging round at step %d gave this replica the finite replicas' mean "
            "(nonfinite=\"skip_replica\"); its inner optimizer's state held non-finite values too, set to 0 in %s",
            torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            count,
            ", ".join(changed),
        )
    return changed


def pop_group_step(state_dict: dict[str, Any]) -> int | None:
    """Remove the count from the param groups of ``state_dict`` (copied, not mutated) and return it, or ``None``.

    Raises:
        ValueError: if some groups carry it and others do not, or they carry different counts.
    """
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not any(
        isinstance(g, Mapping) and GROUP_STEP_KEY in g for g in groups
    ):
        return None
    values = [g.get(GROUP_STEP_KEY, "missing") if isinstance(g, Mapping) else "missing" for g in groups]
    plain = [int(v) if torch.is_tensor(v) and v.numel() == 1 and not v.is_floating_point() else v for v in values]
    if any(v != plain[0] for v in plain):
        raise ValueError(
            f"The parameter groups of the state dict disagree on the averaging step count '{GROUP_STEP_KEY}': "
            f"{plain} (one per group). Every group of a state dict saved by HierarchicalAveragingOptimizer carries "
            "the same count; load the unmodified state dict."
        )
    state_dict["param_groups"] = [
        {k: v for k, v in g.items() if k != GROUP_STEP_KEY} if isinstance(g, Mapping) else g for g in groups
    ]
    return plain[0]


def split_count(
    state_dict: Mapping[str, Any], averaging_step: int | None
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Split a wrapper state dict into the inner optimizer's part and the averaging state.

    The count is read from :data:`STATE_KEY`, else the top-level ``"step"`` (torch's
    ``PostLocalSGDOptimizer``), else :data:`GROUP_STEP_KEY` in the parameter groups, else
    ``averaging_step``. ``state_dict`` is not mutated.

    Returns:
        ``(inner state dict, averaging state for HierarchicalAverager.load_state_dict, where the count was
        found)``.

    Raises:
        ValueError: if there is no count anywhere and ``averaging_step`` is ``None``, naming the keys and
            the fix; if the parameter groups disagree on the count.
    """
    inner = dict(state_dict)
    ours = inner.pop(STATE_KEY, None)
    torch_step = inner.pop("step", None)
    group_step = pop_group_step(inner)
    if ours is not None:
        return inner, ours, f"'{STATE_KEY}'"
    if torch_step is not None:
        return inner, {"step": torch_step}, "the top-level 'step'"
    if group_step is not None:
        return inner, {"step": group_step}, f"the param_groups' '{GROUP_STEP_KEY}'"
    if averaging_step is not None:
        return inner, {"step": averaging_step}, "averaging_step"
    raise ValueError(
        f"The state dict has no averaging step count: no '{STATE_KEY}', no top-level 'step' (torch's "
        f"PostLocalSGDOptimizer) and no '{GROUP_STEP_KEY}' in its param_groups; it has keys "
        f"{sorted(map(str, state_dict))}. Load a state dict saved by this wrapper's state_dict(), or, to "
        "start from a plain inner-optimizer state dict on purpose, pass the count to resume at: "
        "load_state_dict(state_dict, averaging_step=N) (0 restarts the averaging schedule)."
    )

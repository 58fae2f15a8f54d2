"""Torch version shims, in one place: every import or private attribute that moved between torch releases.

Supported: torch 2.4 and later. Each shim names the releases it covers; drop it with them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # imported at first use below (module __getattr__)
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import Placement

_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")  # torch >= 2.5; torch 2.4


def __getattr__(name: str) -> Any:
    """``DTensor``, ``Placement``, ``Replicate`` and ``Shard``, imported at first use: ``torch.distributed.tensor``
    takes 0.7 s to import, which the core needs only for :func:`is_dtensor` (that imports nothing)."""
    if name not in ("DTensor", "Placement", "Replicate", "Shard"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:  # torch >= 2.5
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import Placement
    except ImportError:  # pragma: no cover - torch 2.4
        from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore[no-redef]
        from torch.distributed._tensor.placement_types import Placement  # type: ignore[no-redef]
    found = {"DTensor": DTensor, "Placement": Placement, "Replicate": Replicate, "Shard": Shard}
    globals().update(found)
    return found[name]


def is_dtensor(t: object) -> bool:
    """``isinstance(t, DTensor)``, without importing ``torch.distributed.tensor``: no object is a DTensor before that
    module is imported."""
    for name in _DTENSOR_MODULES:
        module = sys.modules.get(name)
        if module is not None and isinstance(t, getattr(module, "DTensor", ())):
            return True
    return False

__all__ = [
    "DTensor",
    "DistError",
    "eager_under_compile",
    "Placement",
    "Replicate",
    "Shard",
    "all_gather_single",
    "fsdp2_param_groups",
    "fully_shard",
    "is_dtensor",
    "process_group_timeout",
    "reduce_scatter_single",
]

DistError: type[BaseException] | None = getattr(dist, "DistError", None)
"""``torch.distributed.DistError``, the base of the backends' failure errors, where torch has it."""


def fully_shard(*args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.fsdp.fully_shard`` (torch >= 2.6), else its torch 2.4 / 2.5 location."""
    try:
        from torch.distributed.fsdp import fully_shard as fn
    except ImportError:  # pragma: no cover - torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import fully_shard as fn  # type: ignore[no-redef]
    return fn(*args, **kwargs)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """SUM-reduce-scatter ``input`` into ``output`` over ``group`` (``dist.reduce_scatter_single`` where torch has it)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=dist.ReduceOp.SUM, group=group)


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
) -> Any:
    """All-gather ``input`` into ``output`` over ``group`` (``dist.all_gather_single`` where torch has it); with
    ``async_op``, returns the work to wait for."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def process_group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout ``group`` was created with (``init_process_group(timeout=...)``), or ``None`` if unknown.

    Read from the group's private backend options (torch 2.4 to 2.13); local, no collective.
    """
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError, TypeError):
            continue
    return None


def fsdp2_param_groups(state: Any) -> list[Any]:
    """The FSDP2 parameter groups of a module's FSDP state (private: ``_fsdp_param_groups``, or one
    ``_fsdp_param_group`` on older torch)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per module
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    return groups


def eager_under_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run eagerly when ``torch.compile`` traces its caller (a graph break), and called directly otherwise.

    Under tracing, :func:`torch.compiler.is_compiling` is true and the call goes through
    :func:`torch.compiler.disable`'s version of ``fn``; in eager mode the call costs one function call more,
    where ``torch.compiler.disable`` alone would cost its context switch at every call (measured with
    ``bench/overhead.py``: about 2 microseconds per wrapped step). The disabled version is made at the first traced
    call, not at import: :func:`torch.compiler.disable` imports ``torch._dynamo`` (0.8 s), which a run that never
    compiles does not need.
    """
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not disabled:
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call

"""Which tensors: the local storage of a (D)Tensor, each parameter once, self-overlapping views."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._compat import is_dtensor

__all__ = ["local_tensor", "overlaps_itself", "unique_params"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank averages: the local shard of a DTensor, else ``t`` detached.

    Both share storage with ``t``; nothing is copied and nothing is rebound.
    """
    if is_dtensor(t):
        return t.to_local().detach()
    return t.detach()


def unique_params(param_groups: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, torch.Tensor]]:
    """``(group index, index in group, parameter)`` of each parameter of ``param_groups``, once, in order."""
    seen: set[int] = set()
    out = []
    for g, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((g, i, p))
    return out


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share a memory location (a stride of 0, as from ``expand()``)."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        return True
    return torch._debug_has_internal_overlap(t) == 1

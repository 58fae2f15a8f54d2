"""Per-replica FSDP checkpoints with ``torch.distributed.checkpoint`` (DCP).

Replicas differ between averagings, and DCP deduplicates identical keys across ranks, so
each replica is saved to its own folder ``replica_<r>`` over its ``"shard"`` process group.
Model and optimizer go through ``get_state_dict`` / ``set_state_dict``; the averaging state
(step count, levels) is saved beside them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.fsdp._flat_param import FlatParameter

from ..agreement import agree_across_ranks
from .mesh import SHARD_DIM
from .optimizer import FSDPHierarchicalAveragingOptimizer, optimizer_params

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor, Shard  # type: ignore[no-redef]

__all__ = ["load_checkpoint", "save_checkpoint"]


def _replica_folder(path: str | os.PathLike, optimizer: FSDPHierarchicalAveragingOptimizer) -> str:
    return os.path.join(os.fspath(path), f"replica_{optimizer.replica_index}")


def _optimizer_holds_flat_params(optimizer: FSDPHierarchicalAveragingOptimizer) -> bool:
    return any(isinstance(p, FlatParameter) for p in optimizer_params(optimizer.optimizer))


def _checkpoint_state(module: nn.Module, optimizer: FSDPHierarchicalAveragingOptimizer) -> dict[str, Any]:
    """What one rank saves: model and optimizer state (DCP state dicts) and the averaging state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    state: dict[str, Any] = {"hierarchical_averaging": optimizer.averager.state_dict()}
    # Before the first step the inner optimizer has no state; torch's helpers would fill it with a zero-lr step
    # that leaves Adam's "step" at 1. This makes the same state without a step (and the next real step drops it).
    optimizer.initialize_state()
    if _optimizer_holds_flat_params(optimizer):
        # FSDP1 with use_orig_params=False. torch 2.13's FSDP.optim_state_dict broadcasts from global rank 0
        # (_optim_utils._map_param_key_to_optim_keys), which is not in the shard group of replicas 1, 2, ...,
        # so get_state_dict fails there. The optimizer's state of each local flat shard (FSDP1 pads the
        # shards to equal sizes) is saved instead as a DTensor sharded over the "shard" dimension.
        state["model"] = get_model_state_dict(module)
        state["optim_flat"] = _flat_optimizer_state(optimizer)
    else:
        state["model"], state["optim"] = get_state_dict(module, optimizer.optimizer)
    return state


def _flat_optimizer_state(optimizer: FSDPHierarchicalAveragingOptimizer) -> dict[str, Any]:
    inner = optimizer.optimizer
    raw = inner.state_dict()
    shard_mesh = optimizer.mesh[SHARD_DIM]
    flat_state: dict[str, dict[str, Any]] = {}
    for index, entries in raw["state"].items():
        flat_state[str(index)] = {
            name: DTensor.from_local(value, shard_mesh, [Shard(0)], run_check=False)
            if torch.is_tensor(value) and value.dim() >= 1
            else value
            for name, value in entries.items()
        }
    return {"state": flat_state, "param_groups": raw["param_groups"]}


def _load_flat_optimizer_state(optimizer: FSDPHierarchicalAveragingOptimizer, saved: Mapping[str, Any]) -> None:
    state = {
        int(index): {name: v.to_local() if isinstance(v, DTensor) else v for name, v in entries.items()}
        for index, entries in saved["state"].items()
    }
    optimizer.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


class _ExactLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, minus its pre-2.4 key-format guess: loads exactly the entries asked for."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        return create_default_local_load_plan(self.state_dict, self.metadata, strict=True)


def save_checkpoint(
    path: str | os.PathLike, module: nn.Module, optimizer: FSDPHierarchicalAveragingOptimizer
) -> None:
    """Save model, optimizer and averaging state with ``torch.distributed.checkpoint`` (DCP).

    Each replica writes its own sharded checkpoint to ``path/replica_<r>`` over its
    ``"shard"`` group: replicas differ between averagings, and DCP would keep one copy of
    identically named shards. Model and optimizer go through
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` (FSDP1 with
    ``use_orig_params=False``: the model does, and the optimizer's local flat-shard state is
    saved as DTensors over the shard dimension, see the limitations in the README); the averaging state is
    :meth:`HierarchicalAverager.state_dict` (the step count and levels).

    .. warning:: Collective over the default process group: every rank must call this.

    Args:
        path: Folder shared by all ranks (created if missing).
        module: The sharded module the optimizer was built for.
        optimizer: The averaging optimizer.
    """
    from torch.distributed.checkpoint import save

    state = _checkpoint_state(module, optimizer)
    save(state, checkpoint_id=_replica_folder(path, optimizer), process_group=optimizer.mesh[SHARD_DIM].get_group())
    dist.barrier()


def load_checkpoint(
    path: str | os.PathLike, module: nn.Module, optimizer: FSDPHierarchicalAveragingOptimizer
) -> None:
    """Load what :func:`save_checkpoint` wrote, in place, with the same mesh shape and FSDP wrapping.

    The next :meth:`~FSDPHierarchicalAveragingOptimizer.step` checks that every rank resumed at the same count.

    .. warning:: Collective over the default process group: every rank must call this.

    Raises:
        FileNotFoundError: if ``path/replica_<r>`` does not exist (e.g. fewer replicas were saved).
        RuntimeError: on the other ranks, naming the rank that failed to load (instead of waiting for it).
    """
    error: BaseException | None = None
    try:
        _load_replica(path, module, optimizer)
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        error = exc
    # Replaces a barrier: a replica that failed (its folder missing: fewer replicas were saved) raises its
    # error, every other rank a RuntimeError naming it, instead of waiting in the next collective.
    agree_across_ranks(
        "the checkpoint load", None, None, error=error, fix="Resume with the mesh shape that saved the checkpoint."
    )


def _load_replica(
    path: str | os.PathLike, module: nn.Module, optimizer: FSDPHierarchicalAveragingOptimizer
) -> None:
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    folder = _replica_folder(path, optimizer)
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"No checkpoint for replica {optimizer.replica_index} at {folder}: resume with the mesh shape "
            "(replicas, shards) that saved it."
        )
    state = _checkpoint_state(module, optimizer)
    # A rank whose local shard of a parameter is empty (FSDP1 with uneven shards) has no entry for it while the
    # checkpoint has one; DefaultLoadPlanner then guesses "a checkpoint older than torch 2.4" and flattens
    # differently, silently skipping entries. _ExactLoadPlanner loads exactly this rank's entries, and still
    # raises for an entry missing from the checkpoint.
    load(
        state,
        checkpoint_id=folder,
        planner=_ExactLoadPlanner(),
        process_group=optimizer.mesh[SHARD_DIM].get_group(),
    )
    if "optim" in state:
        set_state_dict(module, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(module, state["model"])
        _load_flat_optimizer_state(optimizer, state["optim_flat"])
    optimizer.averager.load_state_dict(state["hierarchical_averaging"])

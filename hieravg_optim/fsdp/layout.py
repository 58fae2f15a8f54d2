"""Which FSDP tensors a replica averages: the module's sharding checked, FSDP1's flat shards found.

Used by :class:`~hieravg_optim.fsdp.FSDPHierarchicalAveragingOptimizer` at construction and in
``add_param_group``; every check here is local (no collective): the wrapper raises its errors on
every rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from .._compat import DTensor, Replicate, fsdp2_param_groups
from ..tensors import unique_params
from .mesh import HSDP_FIX, SHARD_DIM, check_fsdp1_strategy

__all__ = ["ParamGroups", "fsdp1_units", "local_flat_shard", "row_ranks", "validate_module"]


def fsdp1_units(module: nn.Module) -> list[FSDP]:
    """FSDP1 instances that own a flat parameter, in module order (the same on every rank)."""
    return [m for m in FSDP.fsdp_modules(module) if getattr(m, "_handle", None) is not None]


def row_ranks(mesh: DeviceMesh) -> list[int]:
    return [int(r) for r in mesh[SHARD_DIM].mesh.flatten().tolist()]


class ParamGroups(NamedTuple):
    """Parameter groups to check with :func:`validate_module` before they reach the inner optimizer."""

    param_groups: list[dict[str, Any]]


def local_flat_shard(flat: nn.Parameter) -> torch.Tensor:
    """The local shard of an FSDP1 flat parameter, detached (its own storage).

    Raises:
        RuntimeError: if the flat parameter is not sharded now (inside forward or ``summon_full_params``).
    """
    # Before FSDP's lazy initialisation (first forward) there is no _local_shard yet: the flat
    # parameter then is the local shard itself.
    local = getattr(flat, "_local_shard", None)
    if local is not None and flat.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
        raise RuntimeError(
            "An FSDP flat parameter is not in its sharded state: call step() after backward(), outside "
            "forward and summon_full_params(), so that the local fp32 shards are averaged."
        )
    return flat.detach()


def validate_module(
    module: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh
) -> tuple[int, list[nn.Parameter], dict[int, list[nn.Parameter]]]:
    """Check how ``module`` is sharded.

    Returns:
        The FSDP version and, for FSDP1, the flat parameters to average and, by ``id`` of each, the
        optimizer parameters it holds (itself with ``use_orig_params=False``).
    """
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    row = row_ranks(mesh)
    units = fsdp1_units(module) if isinstance(module, nn.Module) else []
    params = [p for _, _, p in unique_params(optimizer.param_groups)]
    dtensor_params = [p for p in params if isinstance(p, DTensor)]
    if units:
        if dtensor_params:
            raise NotImplementedError(
                "module mixes FSDP1 and FSDP2 (DTensor) parameters; shard it with one FSDP version."
            )
        owner: dict[int, nn.Parameter] = {}
        for unit in units:
            check_fsdp1_strategy(unit.sharding_strategy, "FSDPHierarchicalAveragingOptimizer")
            unit_ranks = dist.get_process_group_ranks(unit.process_group)
            if unit_ranks != row:
                raise ValueError(
                    f"An FSDP unit shards over ranks {unit_ranks}, but this rank's replica (mesh row) is {row}. "
                    + HSDP_FIX
                )
            flat = unit._handle.flat_param
            owner[id(flat)] = flat
            for orig in getattr(flat, "_params", None) or ():
                owner[id(orig)] = flat
        chosen: dict[int, list[nn.Parameter]] = {}
        for p in params:
            flat = owner.get(id(p))
            if flat is None:
                raise ValueError(
                    f"An optimizer parameter of shape {tuple(p.shape)} is not managed by FSDP: its gradients are not "
                    "reduced within the replica. Wrap the whole module with FSDP (shard_replica) and build the "
                    "optimizer from the wrapped module's parameters()."
                )
            chosen.setdefault(id(flat), []).append(p)
        flats = [u._handle.flat_param for u in units if id(u._handle.flat_param) in chosen]
        return 1, flats, chosen
    _check_no_unsharded_fsdp2_params(module, params)
    if not dtensor_params:
        raise TypeError(
            f"{type(module).__name__} is not sharded with FSDP (no FlatParameter, no DTensor parameter): shard it "
            "with hieravg_optim.fsdp.shard_replica(module, mesh), or use hieravg_optim.HierarchicalAveragingOptimizer "
            "for unsharded replicas."
        )
    for p in params:
        if not isinstance(p, DTensor):
            raise ValueError(
                f"An optimizer parameter of shape {tuple(p.shape)} is a plain tensor, not an FSDP2 DTensor: its "
                "gradients are not reduced within the replica. fully_shard the module owning it over mesh['shard']."
            )
        dmesh = p.device_mesh
        if any(isinstance(pl, Replicate) for pl in p.placements):
            raise ValueError(
                f"A DTensor parameter of shape {tuple(p.shape)} has placements {tuple(p.placements)} on a "
                f"{dmesh.ndim}-D mesh {dmesh.mesh.tolist()}: fully_shard with a 2-D mesh is HSDP. {HSDP_FIX}"
            )
        if dmesh.ndim != 1:
            raise NotImplementedError(
                f"A DTensor parameter of shape {tuple(p.shape)} lives on a {dmesh.ndim}-D mesh with placements "
                f"{tuple(p.placements)} (FSDP combined with tensor parallelism?): only FSDP2 over mesh['shard'] is "
                "supported; average such models with HierarchicalAverager on the local shards yourself."
            )
        p_ranks = [int(r) for r in dmesh.mesh.flatten().tolist()]
        if p_ranks != row:
            raise ValueError(
                f"A DTensor parameter of shape {tuple(p.shape)} is sharded over ranks {p_ranks}, but this rank's "
                f"replica (mesh row) is {row}. {HSDP_FIX}"
            )
    return 2, [], {}


def _check_no_unsharded_fsdp2_params(module: nn.Module, params: list[torch.Tensor]) -> None:
    """A ``TypeError`` if an optimizer parameter is the unsharded copy of an FSDP2 parameter.

    FSDP2 registers a module's unsharded parameters (plain tensors) in place of its sharded
    DTensor parameters from its all-gather in forward until it reshards. A module that does not
    reshard after forward (the root, whose ``reshard_after_forward`` defaults to False) keeps them
    registered until the backward has run, so ``module.parameters()`` taken right after a forward
    are the unsharded copies (https://github.com/pytorch/pytorch/issues/149205). An optimizer over
    them updates a temporary copy: plain torch then trains nothing. Replacing them by the sharded
    parameters behind the optimizer's back would leave its state, and any scheduler or user
    reference, on the copies, so this raises instead.
    """
    from torch.distributed.fsdp import FSDPModule

    copies: dict[int, str] = {}
    for name, sub in module.named_modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        for group in fsdp2_param_groups(state):
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    copies[id(unsharded)] = getattr(fsdp_param, "_param_fqn", None) or f"a parameter of {name or 'the root'}"
    for i, p in enumerate(params):
        fqn = copies.get(id(p))
        if fqn is not None:
            raise TypeError(
                f"Optimizer parameter {i} (shape {tuple(p.shape)}) is the unsharded copy of the FSDP2 parameter "
                f"{fqn!r}, not the sharded DTensor parameter: the optimizer was built after a forward, which left "
                "the parameters of a module that does not reshard after forward (the root module by default) "
                "unsharded (torch issue 149205); the optimizer would update a temporary copy. Build the optimizer "
                "before the first forward, or call module.reshard() (FSDPModule.reshard) on that module before "
                "taking module.parameters()."
            )

"""The ``(replicate, shard)`` device mesh, and each replica sharded with FSDP over its ``"shard"`` dimension.

:func:`init_replicate_shard_mesh` builds the mesh with the core's rank layout (replica ``r``
is the block of ``S`` consecutive ranks ``[r*S, (r+1)*S)``), :func:`check_replicate_shard_mesh`
rejects any other layout, and :func:`shard_replica` shards a module over ``mesh["shard"]``
with FSDP1 or FSDP2, never across replicas (no HYBRID_SHARD / HSDP).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from .._compat import fully_shard, process_group_timeout
from ..config import check_collective_timeout_s
from ..groups import averaging_timeout, new_timed_group

__all__ = [
    "HSDP_FIX",
    "REPLICATE_DIM",
    "SHARD_DIM",
    "backend_device_type",
    "check_fsdp1_strategy",
    "check_replicate_shard_mesh",
    "init_replicate_shard_mesh",
    "mesh_timeouts",
    "shard_replica",
]

REPLICATE_DIM = "replicate"
"""Name of the mesh dimension across replicas (averaged every ``period`` steps)."""
SHARD_DIM = "shard"
"""Name of the mesh dimension within a replica (FSDP shards and reduces gradients over it)."""

_HYBRID = {ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2}
_SUPPORTED_FSDP1 = {ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP}
HSDP_FIX = (
    "Shard each replica over the mesh's 'shard' dimension only: FSDP1 with "
    "process_group=mesh['shard'].get_group() and sharding_strategy=FULL_SHARD (or SHARD_GRAD_OP), "
    "FSDP2 with fully_shard(module, mesh=mesh['shard']); hieravg_optim.fsdp.shard_replica(module, mesh) does "
    "this. HYBRID_SHARD / HSDP all-reduce the gradients across replicas at every step, so the replicas never "
    "drift apart and periodic averaging would only cost communication."
)
"""The fix named by every error about a module sharded across replicas (HYBRID_SHARD, HSDP, another group)."""


def backend_device_type(group: dist.ProcessGroup | None = None) -> str:
    """The device type the backend of ``group`` (default: the default group) communicates on.

    ``"gloo"`` -> ``"cpu"``, ``"nccl"`` -> ``"cuda"``, ``"xccl"`` -> ``"xpu"`` (torch's
    ``Backend.default_device_backend_map``, read backwards); for a per-device backend such as
    ``"cpu:gloo,cuda:nccl"``, its first device type other than ``"cpu"``. Local, no collective.

    Raises:
        RuntimeError: if torch.distributed is not initialized.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group() first.")
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        devices = [part.split(":", 1)[0].strip() for part in backend.split(",")]
        return next((d for d in devices if d != "cpu"), "cpu")
    if backend == "gloo":
        return "cpu"
    for device, name in dist.Backend.default_device_backend_map.items():
        if name == backend:
            return device
    return "cpu"


def init_replicate_shard_mesh(
    shards_per_replica: int, device_type: str | None = None, *, timeout_s: float | None = None
) -> DeviceMesh:
    """Build the ``(replicate, shard)`` device mesh over the default process group.

    Its groups are created with a timeout (:func:`hieravg_optim.groups.new_timed_group`), where
    ``init_device_mesh`` gives torch's default for the backend (30 min on gloo, 10 min on NCCL) whatever
    ``init_process_group(timeout=...)`` said: FSDP reduces gradients over the ``"shard"`` groups every step,
    so a hung rank of a replica is reported in this time by FSDP too, as by the averaging.

    .. warning:: Collective over the default process group: every rank must call this.

    Args:
        shards_per_replica: ``S``, ranks per replica (the FSDP shard group size). Must divide the world size.
        device_type: ``"cpu"``, ``"cuda"`` or another device type; ``None``: the device type of the
            default process group's backend (see :func:`backend_device_type`: ``"gloo"`` -> ``"cpu"``,
            ``"nccl"`` -> ``"cuda"``), not whether CUDA is available: a gloo run of several ranks on
            a machine with fewer GPUs than ranks stays on the CPU.
        timeout_s: The timeout of the mesh's groups, in seconds: pass the optimizer's ``collective_timeout_s``;
            ``None``: the default process group's timeout.

    Returns:
        A mesh of shape ``(W // S, S)`` named ``("replicate", "shard")``; replica ``r`` is ranks
        ``r*S .. r*S + S - 1``.

    Raises:
        ValueError: if ``shards_per_replica`` is not a positive integer dividing the world size, or ``timeout_s``
            is not a positive number of seconds (at most ``1e9``).
        RuntimeError: if torch.distributed is not initialized.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group() first.")
    world_size = dist.get_world_size()
    if isinstance(shards_per_replica, bool) or not isinstance(shards_per_replica, int) or shards_per_replica <= 0:
        raise ValueError(f"shards_per_replica must be a positive integer (ranks), got {shards_per_replica!r}.")
    if world_size % shards_per_replica != 0:
        raise ValueError(
            f"shards_per_replica={shards_per_replica} must divide the world size ({world_size}): every replica "
            "is a block of shards_per_replica consecutive ranks."
        )
    if timeout_s is not None:
        check_collective_timeout_s(timeout_s)
    if device_type is None:
        device_type = backend_device_type()
    timeout = averaging_timeout(timeout_s, None)
    ranks = torch.arange(world_size).view(world_size // shards_per_replica, shards_per_replica)
    rank = dist.get_rank()
    mine: list[dist.ProcessGroup] = []
    for members in (ranks.t(), ranks):  # the replicate groups (one per shard index), then the shard groups
        for row in members.tolist():
            whole = len(row) == world_size and process_group_timeout(dist.group.WORLD) == timeout
            group = dist.group.WORLD if whole else new_timed_group(row, timeout)
            if rank in row:
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, mesh=ranks, mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


def mesh_timeouts(mesh: DeviceMesh) -> dict[str, float | None]:
    """The timeout of this rank's group of each dimension of ``mesh``, in seconds (``None``: unknown). Local."""
    result = {}
    for name in mesh.mesh_dim_names or ():
        timeout = process_group_timeout(mesh[name].get_group())
        result[name] = None if timeout is None else timeout.total_seconds()
    return result


def check_replicate_shard_mesh(mesh: object) -> tuple[int, int]:
    """Check that ``mesh`` is a ``(replicate, shard)`` mesh with the core's rank layout.

    Local: no collective; every rank raises the same error for the same mesh.

    Args:
        mesh: The device mesh to check.

    Returns:
        ``(R, S)``: the number of replicas and of shards per replica.

    Raises:
        TypeError: if ``mesh`` is not a ``DeviceMesh``.
        ValueError: if it is not 2-D, its dimension names are not ``("replicate", "shard")``, or its ranks
            are not ``arange(W).view(R, S)`` over the default process group.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; build one with "
            "hieravg_optim.fsdp.init_replicate_shard_mesh(shards_per_replica)."
        )
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != (REPLICATE_DIM, SHARD_DIM):
        raise ValueError(
            f"mesh must be 2-D with mesh_dim_names=('{REPLICATE_DIM}', '{SHARD_DIM}'), got {mesh.ndim}-D with "
            f"names {mesh.mesh_dim_names}; build it with init_device_mesh(device, (R, S), "
            f"mesh_dim_names=('{REPLICATE_DIM}', '{SHARD_DIM}'))."
        )
    replicas, shards = (int(x) for x in mesh.mesh.shape)
    world_size = dist.get_world_size()
    expected = torch.arange(world_size).view(replicas, shards) if replicas * shards == world_size else None
    if expected is None or not torch.equal(mesh.mesh.cpu(), expected):
        raise ValueError(
            f"mesh ranks {mesh.mesh.tolist()} must be arange(world_size={world_size}).view({replicas}, {shards}): "
            "hierarchical averaging lays replicas out as blocks of consecutive ranks (node-aligned under torchrun), "
            "rank i holding shard i % S. Build the mesh with init_device_mesh over the whole default group, or "
            "renumber the ranks so that each replica is a block of consecutive ranks."
        )
    return replicas, shards


def shard_replica(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    fsdp_version: Literal[1, 2] = 2,
    submodules: Iterable[nn.Module] = (),
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Shard ``module`` with FSDP over the mesh's ``"shard"`` dimension: one FSDP replica per mesh row.

    .. warning:: Collective over this rank's ``"shard"`` group (FSDP's initialisation is).

    Args:
        module: The model, with the same initial weights on every rank of the replica
            (:class:`~hieravg_optim.fsdp.FSDPHierarchicalAveragingOptimizer` then starts every replica
            from replica 0's).
        mesh: A ``(replicate, shard)`` mesh (see :func:`check_replicate_shard_mesh`).
        fsdp_version: 1 for ``FullyShardedDataParallel``, 2 for ``fully_shard``.
        submodules: FSDP2 only: modules to ``fully_shard`` first, bottom-up (e.g. transformer blocks);
            ``module`` is sharded last. For FSDP1 pass ``auto_wrap_policy`` instead.
        **fsdp_kwargs: Passed to ``FullyShardedDataParallel`` / ``fully_shard`` (e.g. ``use_orig_params``,
            ``mixed_precision``, ``mp_policy``). FSDP1 defaults: ``sharding_strategy=FULL_SHARD`` and
            ``device_id`` = the mesh's device.

    Returns:
        The FSDP1 wrapper, or ``module`` itself (FSDP2 shards in place).

    Raises:
        ValueError: for a hybrid sharding strategy, an explicit ``process_group`` / ``device_mesh`` / ``mesh``
            (the mesh decides them), or an unknown ``fsdp_version``.
    """
    check_replicate_shard_mesh(mesh)
    shard_mesh = mesh[SHARD_DIM]
    for key in ("process_group", "device_mesh", "mesh"):
        if key in fsdp_kwargs:
            raise ValueError(f"Do not pass {key}= to shard_replica: each replica is sharded over mesh['{SHARD_DIM}'].")
    if fsdp_version == 1:
        strategy = fsdp_kwargs.setdefault("sharding_strategy", ShardingStrategy.FULL_SHARD)
        check_fsdp1_strategy(strategy, "shard_replica")
        if "device_id" not in fsdp_kwargs:
            if mesh.device_type == "cpu":
                fsdp_kwargs["device_id"] = torch.device("cpu")
            else:
                device_module = torch.get_device_module(mesh.device_type)
                fsdp_kwargs["device_id"] = torch.device(mesh.device_type, device_module.current_device())
        return FSDP(module, process_group=shard_mesh.get_group(), **fsdp_kwargs)
    if fsdp_version == 2:
        for sub in submodules:
            fully_shard(sub, mesh=shard_mesh, **fsdp_kwargs)
        fully_shard(module, mesh=shard_mesh, **fsdp_kwargs)
        return module
    raise ValueError(f"fsdp_version must be 1 (FullyShardedDataParallel) or 2 (fully_shard), got {fsdp_version!r}.")


def check_fsdp1_strategy(strategy: object, where: str) -> None:
    """Reject a hybrid (``ValueError``) or unsupported (``NotImplementedError``) FSDP1 strategy, naming ``where``."""
    if strategy in _HYBRID:
        raise ValueError(f"{where}: sharding_strategy={strategy} is hybrid sharding (HSDP). {HSDP_FIX}")
    if strategy not in _SUPPORTED_FSDP1:
        raise NotImplementedError(
            f"{where}: sharding_strategy={strategy} is not supported; use FULL_SHARD or SHARD_GRAD_OP over "
            "mesh['shard'], or, for unsharded replicas (NO_SHARD), DDP with "
            "hieravg_optim.HierarchicalAveragingOptimizer."
        )



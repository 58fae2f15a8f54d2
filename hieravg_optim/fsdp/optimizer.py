"""The FSDP optimizer wrapper: local shards averaged across replicas, after checking how the module is sharded.

:class:`FSDPHierarchicalAveragingOptimizer` is :class:`~hieravg_optim.HierarchicalAveragingOptimizer`
with ``ranks_per_replica`` taken from the mesh, averaging FSDP1 flat-parameter shards or FSDP2
DTensor local shards. Its constructor rejects a module sharded across replicas (HYBRID_SHARD,
HSDP) or not by FSDP, on every rank, before any averaging collective.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ..agreement import raise_on_every_rank
from ..comm_dtype import CommDtype
from ..optimizer import HierarchicalAveragingOptimizer
from ..schedule import AveragingLevel
from .mesh import HSDP_FIX, REPLICATE_DIM, SHARD_DIM, check_fsdp1_strategy, check_replicate_shard_mesh

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor, Replicate  # type: ignore[no-redef]

__all__ = ["FSDPHierarchicalAveragingOptimizer", "optimizer_params"]

logger = logging.getLogger(__name__)


def _fsdp1_units(module: nn.Module) -> list[FSDP]:
    """FSDP1 instances that own a flat parameter, in module order (the same on every rank)."""
    return [m for m in FSDP.fsdp_modules(module) if getattr(m, "_handle", None) is not None]


def _row_ranks(mesh: DeviceMesh) -> list[int]:
    return [int(r) for r in mesh[SHARD_DIM].mesh.flatten().tolist()]


class FSDPHierarchicalAveragingOptimizer(HierarchicalAveragingOptimizer):
    """:class:`~hieravg_optim.HierarchicalAveragingOptimizer` for FSDP replicas on a ``(replicate, shard)`` mesh.

    Every replica is an FSDP1 or FSDP2 module sharded over the mesh's ``"shard"``
    dimension (see :func:`shard_replica`). Each :meth:`step` runs the inner step; then,
    on the schedule of torch's ``HierarchicalModelAverager`` + ``PostLocalSGDOptimizer``,
    the ranks holding the same shard in the replicas of a level's block average their
    local shards in place (FSDP1: the local ``FlatParameter`` shards, fp32 under mixed
    precision; FSDP2: the DTensors' ``to_local()`` shards). Group sizes count ranks, as in
    the core: with ``S`` shards per replica a level of group size ``G`` averages ``G / S``
    replicas; ``G`` must be a multiple of ``S`` and the last one the world size.

    .. warning::
        The constructor is collective over the default process group; :meth:`step` is
        collective over the averaging subgroup when averaging is due. Call :meth:`step`
        outside forward/backward (after ``backward()``), when FSDP has resharded.

    Args:
        optimizer: The inner optimizer, built over ``module.parameters()`` after FSDP wrapping.
        module: The FSDP1-wrapped module or the FSDP2-sharded module.
        mesh: The ``(replicate, shard)`` mesh the replicas are sharded over.
        period_group_size_dict: ``{period: group_size}`` in steps and ranks, e.g. ``{4: 2 * S, 32: W}``.
        warmup_steps: Steps that never average (post-local SGD's warm-up).
        bucket_cap_mb: Bucket size, in MB (10**6 bytes).
        comm_dtype: Wire dtype, one value or ``{period: dtype}``; ``None`` sends each tensor in its own
            dtype. ``"bf16"`` sends fp32 shards as bfloat16 and keeps them fp32 (see
            :class:`~hieravg_optim.HierarchicalAveragingOptimizer`).
        ranks_per_node: Ranks of one node (or ``"auto"``) for node-aware levels; ``None``: flat
            (see :class:`~hieravg_optim.HierarchicalAveragingOptimizer`).

    Raises:
        TypeError: if ``module`` is not sharded with FSDP, or ``mesh`` is not a ``DeviceMesh``.
        ValueError: on every rank, before the averaging groups are built: for a mesh with another layout,
            hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2, a 2-D FSDP2 mesh), FSDP sharded over other
            ranks than this rank's mesh row, an optimizer parameter FSDP does not manage, or a bad schedule.
        NotImplementedError: for FSDP1's NO_SHARD.
        RuntimeError: if the ranks disagree (one rank's validation failed: every rank raises, in the
            constructor's one agreement collective).

    Example::

        >>> mesh = init_replicate_shard_mesh(shards_per_replica=8)
        >>> model = shard_replica(build_model(), mesh, fsdp_version=2)
        >>> opt = FSDPHierarchicalAveragingOptimizer(
        ...     torch.optim.AdamW(model.parameters(), lr=1e-3), model, mesh, {8: 16, 64: dist.get_world_size()})
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        mesh: DeviceMesh,
        period_group_size_dict: Mapping[int, int] | Iterable[AveragingLevel],
        warmup_steps: int = 0,
        *,
        bucket_cap_mb: float = 25.0,
        comm_dtype: CommDtype = None,
        ranks_per_node: int | str | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group() first.")
        try:
            _, shards = check_replicate_shard_mesh(mesh)
            self._fsdp_version, self._flat_params = _validate_module(module, optimizer, mesh)
        except (TypeError, ValueError, NotImplementedError) as exc:
            # Raised here; the other ranks raise a RuntimeError naming this rank in the agreement of the
            # averager they are about to build (the constructor's one agreement collective).
            raise_on_every_rank(exc, None, "the FSDP module and mesh")
        self.module = module
        self.mesh = mesh
        super().__init__(
            optimizer,
            period_group_size_dict,
            warmup_steps,
            None,
            ranks_per_replica=shards,
            bucket_cap_mb=bucket_cap_mb,
            comm_dtype=comm_dtype,
            ranks_per_node=ranks_per_node,
        )
        if dist.get_rank() == 0:
            logger.info(
                "FSDP%d hierarchical averaging: %d replicas x %d shards, %d optimizer parameters",
                self._fsdp_version,
                self.averager.world_size // shards,
                shards,
                sum(1 for _ in optimizer_params(optimizer)),
            )

    @property
    def fsdp_version(self) -> int:
        """1 for ``FullyShardedDataParallel``, 2 for ``fully_shard``."""
        return self._fsdp_version

    @property
    def replica_index(self) -> int:
        """This rank's coordinate on the ``"replicate"`` dimension."""
        return int(self.mesh.get_local_rank(REPLICATE_DIM))

    def tensors_to_average(self) -> list[torch.Tensor]:
        """This rank's local shards to average, in order (the same shapes on every same-shard rank).

        FSDP1: the local flat-parameter shards of the FSDP units holding optimizer parameters.
        FSDP2: the ``to_local()`` shards of the optimizer's parameters.

        Raises:
            RuntimeError: for FSDP1 if a flat parameter is not sharded now (inside forward or
                ``summon_full_params``): averaging must run between iterations.
        """
        if self._fsdp_version == 2:
            return super().tensors_to_average()
        out = []
        for flat in self._flat_params:
            # Before FSDP's lazy initialisation (first forward) there is no _local_shard yet: the flat
            # parameter then is the local shard itself.
            local = getattr(flat, "_local_shard", None)
            if local is not None and flat.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
                raise RuntimeError(
                    "An FSDP flat parameter is not in its sharded state: call step() after backward(), outside "
                    "forward and summon_full_params(), so that the local fp32 shards are averaged."
                )
            out.append(flat.detach())
        return out


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[nn.Parameter]:
    """The parameters of ``optimizer``'s ``param_groups``, each once, in order."""
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def _validate_module(
    module: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh
) -> tuple[int, list[nn.Parameter]]:
    """Check how ``module`` is sharded; return the FSDP version and, for FSDP1, the flat parameters to average."""
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    row = _row_ranks(mesh)
    units = _fsdp1_units(module) if isinstance(module, nn.Module) else []
    params = list(optimizer_params(optimizer))
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
        chosen: dict[int, nn.Parameter] = {}
        for p in params:
            flat = owner.get(id(p))
            if flat is None:
                raise ValueError(
                    f"An optimizer parameter of shape {tuple(p.shape)} is not managed by FSDP: its gradients are not "
                    "reduced within the replica. Wrap the whole module with FSDP (shard_replica) and build the "
                    "optimizer from the wrapped module's parameters()."
                )
            chosen[id(flat)] = flat
        flats = [u._handle.flat_param for u in units if id(u._handle.flat_param) in chosen]
        return 1, flats
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
    return 2, []

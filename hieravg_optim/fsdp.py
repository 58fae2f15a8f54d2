"""Hierarchical averaging over FSDP: replicas sharded with FSDP, averaged across a device mesh.

Layout. The ``W`` ranks form a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh`
of shape ``(R, S)`` with dimension names ``("replicate", "shard")``, laid out as
``arange(W).view(R, S)``: replica ``r`` is the block of ``S`` consecutive ranks
``[r*S, (r+1)*S)``, and rank ``i`` holds shard ``i % S``. This is exactly the layout
of the core (:mod:`hieravg_optim.groups` with ``ranks_per_replica=S``), and the one
:func:`init_replicate_shard_mesh` builds (``init_device_mesh``). A mesh with another
layout is rejected with a ``ValueError``, never silently averaged over the wrong ranks.

* Each replica is sharded with FSDP over the ``"shard"`` dimension only
  (FSDP1: ``FullyShardedDataParallel(process_group=mesh["shard"].get_group(),
  sharding_strategy=FULL_SHARD)``; FSDP2: ``fully_shard(module, mesh=mesh["shard"])``),
  so gradients are reduce-scattered within the replica and never across replicas.
* :class:`FSDPHierarchicalAveragingOptimizer` then averages, every ``period`` steps,
  each rank's local shards with the ranks holding the same shard in the other
  replicas of its level block (hierarchical SGD, https://arxiv.org/abs/2010.12998).

Why not HYBRID_SHARD / HSDP. FSDP1's ``ShardingStrategy.HYBRID_SHARD`` and
``_HYBRID_SHARD_ZERO2``, and FSDP2's ``fully_shard`` with a 2-D mesh (HSDP), all-reduce
the gradients across replicas at every step: the replicas never drift apart, so
averaging them is a no-op that only costs communication, and the point of
hierarchical SGD (communicating across replicas only every ``period`` steps) is lost.
Both are rejected with a ``ValueError`` that names the strategy and the fix.

What is averaged, in place (never rebinding ``.data``):

* FSDP1: each FSDP unit's local ``FlatParameter`` shard, the fp32 master shard under
  mixed precision, whether ``use_orig_params`` is ``False`` (the optimizer holds the
  flat parameters) or ``True`` (the optimizer holds the original parameters, which
  are 1-D views, of different and sometimes empty sizes on each rank, into the flat
  shard). Averaging the flat shards writes through those views and keeps them
  views; ranks with the same shard index hold flat shards of the same size, so no
  rank waits on a collective that another rank skips. torch's
  ``average_parameters`` instead rebinds ``flat_param.data`` to a temporary buffer:
  FSDP's next reshard points the flat parameter back at its ``_local_shard`` and the
  average is lost after the next forward.
* FSDP2: each DTensor parameter's ``to_local()`` shard (a view into FSDP2's padded
  sharded storage). The averaging collectives run on plain local tensors over the
  replicate subgroups the core builds, never on a DTensor, so no DTensor
  collective runs over the shard mesh by mistake; placements are untouched.

Checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`) use
``torch.distributed.checkpoint`` with ``get_state_dict`` / ``set_state_dict``. Replicas
differ between averagings, and DCP deduplicates identical keys across ranks, so each
replica is saved to its own folder ``replica_<r>`` over its ``"shard"`` process group.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp._flat_param import FlatParameter

from .optimizer import HierarchicalAveragingOptimizer, _agree_across_ranks
from .schedule import AveragingLevel

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore[no-redef]

__all__ = [
    "REPLICATE_DIM",
    "SHARD_DIM",
    "FSDPHierarchicalAveragingOptimizer",
    "check_replicate_shard_mesh",
    "init_replicate_shard_mesh",
    "load_checkpoint",
    "save_checkpoint",
    "shard_replica",
]

logger = logging.getLogger(__name__)

REPLICATE_DIM = "replicate"
"""Name of the mesh dimension across replicas (averaged every ``period`` steps)."""
SHARD_DIM = "shard"
"""Name of the mesh dimension within a replica (FSDP shards and reduces gradients over it)."""

_HYBRID = {ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2}
_SUPPORTED_FSDP1 = {ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP}
_HSDP_FIX = (
    "Shard each replica over the mesh's 'shard' dimension only: FSDP1 with "
    "process_group=mesh['shard'].get_group() and sharding_strategy=FULL_SHARD (or SHARD_GRAD_OP), "
    "FSDP2 with fully_shard(module, mesh=mesh['shard']); hieravg_optim.fsdp.shard_replica(module, mesh) does "
    "this. HYBRID_SHARD / HSDP all-reduce the gradients across replicas at every step, so the replicas never "
    "drift apart and periodic averaging would only cost communication."
)


# -- the device mesh ----------------------------------------------------------------------------------------
def init_replicate_shard_mesh(shards_per_replica: int, device_type: str | None = None) -> DeviceMesh:
    """Build the ``(replicate, shard)`` device mesh over the default process group.

    .. warning:: Collective over the default process group: every rank must call this.

    Args:
        shards_per_replica: ``S``, ranks per replica (the FSDP shard group size). Must divide the world size.
        device_type: ``"cpu"`` or ``"cuda"``; ``None``: ``"cuda"`` when available, else ``"cpu"``.

    Returns:
        A mesh of shape ``(W // S, S)`` named ``("replicate", "shard")``; replica ``r`` is ranks
        ``r*S .. r*S + S - 1``.

    Raises:
        ValueError: if ``shards_per_replica`` is not a positive integer dividing the world size.
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
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(
        device_type,
        (world_size // shards_per_replica, shards_per_replica),
        mesh_dim_names=(REPLICATE_DIM, SHARD_DIM),
    )


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
        module: The model, with the same initial weights on every rank.
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
        _check_fsdp1_strategy(strategy, "shard_replica")
        if "device_id" not in fsdp_kwargs:
            if mesh.device_type == "cpu":
                fsdp_kwargs["device_id"] = torch.device("cpu")
            else:
                fsdp_kwargs["device_id"] = torch.device(mesh.device_type, torch.cuda.current_device())
        return FSDP(module, process_group=shard_mesh.get_group(), **fsdp_kwargs)
    if fsdp_version == 2:
        for sub in submodules:
            fully_shard(sub, mesh=shard_mesh, **fsdp_kwargs)
        fully_shard(module, mesh=shard_mesh, **fsdp_kwargs)
        return module
    raise ValueError(f"fsdp_version must be 1 (FullyShardedDataParallel) or 2 (fully_shard), got {fsdp_version!r}.")


def _check_fsdp1_strategy(strategy: object, where: str) -> None:
    if strategy in _HYBRID:
        raise ValueError(f"{where}: sharding_strategy={strategy} is hybrid sharding (HSDP). {_HSDP_FIX}")
    if strategy not in _SUPPORTED_FSDP1:
        raise NotImplementedError(
            f"{where}: sharding_strategy={strategy} is not supported; use FULL_SHARD or SHARD_GRAD_OP over "
            "mesh['shard'], or, for unsharded replicas (NO_SHARD), DDP with "
            "hieravg_optim.HierarchicalAveragingOptimizer."
        )


# -- the optimizer ----------------------------------------------------------------------------------------------
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

    Raises:
        TypeError: if ``module`` is not sharded with FSDP, or ``mesh`` is not a ``DeviceMesh``.
        ValueError: on every rank, before the averaging groups are built: for a mesh with another layout,
            hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2, a 2-D FSDP2 mesh), FSDP sharded over other
            ranks than this rank's mesh row, an optimizer parameter FSDP does not manage, or a bad schedule.
        NotImplementedError: for FSDP1's NO_SHARD.
        RuntimeError: if the ranks disagree (one rank's validation failed: every rank raises).

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
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group() first.")
        error: BaseException | None = None
        try:
            _, shards = check_replicate_shard_mesh(mesh)
            self._fsdp_version, self._flat_params = _validate_module(module, optimizer, mesh)
        except (TypeError, ValueError, NotImplementedError) as exc:
            error = exc
        _raise_together(error)
        self.module = module
        self.mesh = mesh
        super().__init__(
            optimizer,
            period_group_size_dict,
            warmup_steps,
            None,
            ranks_per_replica=shards,
            bucket_cap_mb=bucket_cap_mb,
        )
        if dist.get_rank() == 0:
            logger.info(
                "FSDP%d hierarchical averaging: %d replicas x %d shards, %d optimizer parameters",
                self._fsdp_version,
                self.averager.world_size // shards,
                shards,
                sum(1 for _ in _optimizer_params(optimizer)),
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


def _raise_together(error: BaseException | None) -> None:
    """Raise ``error`` on this rank, and a RuntimeError on every other rank, if any rank failed (collective)."""
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"FSDP hierarchical averaging setup failed on rank {rank}: {message}")


def _optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[nn.Parameter]:
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
    params = list(_optimizer_params(optimizer))
    dtensor_params = [p for p in params if isinstance(p, DTensor)]
    if units:
        if dtensor_params:
            raise NotImplementedError(
                "module mixes FSDP1 and FSDP2 (DTensor) parameters; shard it with one FSDP version."
            )
        owner: dict[int, nn.Parameter] = {}
        for unit in units:
            _check_fsdp1_strategy(unit.sharding_strategy, "FSDPHierarchicalAveragingOptimizer")
            unit_ranks = dist.get_process_group_ranks(unit.process_group)
            if unit_ranks != row:
                raise ValueError(
                    f"An FSDP unit shards over ranks {unit_ranks}, but this rank's replica (mesh row) is {row}. "
                    + _HSDP_FIX
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
                f"{dmesh.ndim}-D mesh {dmesh.mesh.tolist()}: fully_shard with a 2-D mesh is HSDP. {_HSDP_FIX}"
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
                f"replica (mesh row) is {row}. {_HSDP_FIX}"
            )
    return 2, []


# -- checkpoints ------------------------------------------------------------------------------------------------
def _replica_folder(path: str | os.PathLike, optimizer: FSDPHierarchicalAveragingOptimizer) -> str:
    return os.path.join(os.fspath(path), f"replica_{optimizer.replica_index}")


def _optimizer_holds_flat_params(optimizer: FSDPHierarchicalAveragingOptimizer) -> bool:
    return any(isinstance(p, FlatParameter) for p in _optimizer_params(optimizer.optimizer))


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
    _agree_across_ranks(
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

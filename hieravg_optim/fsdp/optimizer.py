"""The FSDP optimizer wrapper: local shards averaged across replicas, after checking how the module is sharded.

:class:`FSDPHierarchicalAveragingOptimizer` is :class:`~hieravg_optim.HierarchicalAveragingOptimizer`
with ``ranks_per_replica`` taken from the mesh, averaging FSDP1 flat-parameter shards or FSDP2
DTensor local shards. Its constructor rejects a module sharded across replicas (HYBRID_SHARD,
HSDP) or not by FSDP, on every rank, before any averaging collective.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from .._compat import DTensor, Placement, Replicate, Shard, fsdp2_param_groups
from ..agreement import raise_on_every_rank
from ..config import AveragingConfig
from ..tensors import local_tensor, unique_params
from ..optimizer import HierarchicalAveragingOptimizer
from ..schedule import AveragingLevel
from .mesh import HSDP_FIX, REPLICATE_DIM, SHARD_DIM, check_fsdp1_strategy, check_replicate_shard_mesh

__all__ = ["FSDPHierarchicalAveragingOptimizer", "ShardLayout", "optimizer_params"]

logger = logging.getLogger(__name__)

_SETTINGS = frozenset(f.name for f in fields(AveragingConfig) if f.init) - {"levels", "ranks_per_replica"}
"""The settings forwarded through ``**settings``: every field of the config but the levels and the mesh's."""


def _fsdp1_units(module: nn.Module) -> list[FSDP]:
    """FSDP1 instances that own a flat parameter, in module order (the same on every rank)."""
    return [m for m in FSDP.fsdp_modules(module) if getattr(m, "_handle", None) is not None]


def _row_ranks(mesh: DeviceMesh) -> list[int]:
    return [int(r) for r in mesh[SHARD_DIM].mesh.flatten().tolist()]


class ShardLayout(NamedTuple):
    """Where one averaged local shard sits in its full tensor: what ``DTensor.from_local`` needs."""

    mesh: DeviceMesh
    """The replica's ``"shard"`` mesh (FSDP2: the parameter's own device mesh)."""
    placements: tuple[Placement, ...]
    """FSDP1: ``(Shard(0),)`` over the flat shards; FSDP2: the parameter's placements."""
    shape: torch.Size
    """The full tensor's shape (FSDP1: the padded flat parameter, local numel times ``S``)."""
    stride: tuple[int, ...]
    """The full tensor's stride."""


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
        mesh: The ``(replicate, shard)`` mesh the replicas are sharded over; ``ranks_per_replica`` is its
            ``"shard"`` size (giving it too is a ``TypeError``).
        period_group_size_dict: ``{period: group_size}`` in steps and ranks, e.g. ``{4: 2 * S, 32: W}``.
        warmup_steps: Warm-up steps (counts ``0 .. warmup_steps - 1``) of post-local SGD.
        synchronous_warmup: [`synchronous_warmup`][hieravg_optim.AveragingConfig.synchronous_warmup];
            ``True`` by default here, because FSDP reduces gradients within a replica only.
        **settings: Any other setting of :meth:`~hieravg_optim.AveragingConfig.create` (``bucket_cap_mb``,
            ``average_frozen``, ``collective_timeout_s``, ``nonfinite``, ``comm_dtype``, ``ranks_per_node``,
            ``outer_optimizers``, ``outer_state_device``, ``log_metrics_every``), with its default there; see
            :class:`~hieravg_optim.AveragingConfig`. Here ``nonfinite`` is checked per shard index, and an
            FSDP1 flat parameter with ``use_orig_params=True`` mixing frozen and trainable parameters is
            averaged whole under ``average_frozen=False`` (put frozen modules in their own FSDP unit to skip
            them). Outer anchors are taken after the broadcast from replica 0.

    At construction, every replica's local shards (all FSDP1 flat parameters of the module, or
    all FSDP2 parameters, frozen ones included) are overwritten with those of replica 0, as
    :func:`hieravg_optim.deepspeed.initialize` does and as DDP broadcasts from rank 0, so that
    replicas seeded differently start from the same weights (see
    :meth:`~hieravg_optim.HierarchicalAverager.broadcast_from_first_replica`). Build the optimizer
    before loading a checkpoint into the module (:func:`~hieravg_optim.fsdp.load_checkpoint` loads
    both): weights loaded before construction are replaced by replica 0's on the other replicas.

    Raises:
        TypeError: if ``module`` is not sharded with FSDP, or ``mesh`` is not a ``DeviceMesh``; if an
            optimizer parameter is the unsharded copy FSDP2 registers between a forward and its reshard
            (the optimizer was built after a forward; build it before, or call ``module.reshard()``).
        ValueError: on every rank, before the averaging groups are built: for a mesh with another layout,
            hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2, a 2-D FSDP2 mesh), FSDP sharded over other
            ranks than this rank's mesh row, an optimizer parameter FSDP does not manage, or a bad schedule.
        NotImplementedError: for FSDP1's NO_SHARD.
        RuntimeError: if the ranks disagree (one rank's validation failed: every rank raises, in the
            constructor's one agreement collective), or the ranks holding the same shard hold local
            shards of different shapes or dtypes (checked before replica 0's are broadcast).

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
        synchronous_warmup: bool = True,
        **settings: Any,
    ) -> None:
        if "ranks_per_replica" in settings:
            raise TypeError(
                f"ranks_per_replica={settings['ranks_per_replica']!r} given to FSDPHierarchicalAveragingOptimizer: it "
                "is the size of the mesh's \"shard\" dimension. Remove it."
            )
        for name in settings:
            if name not in _SETTINGS:
                raise TypeError(f"FSDPHierarchicalAveragingOptimizer() got an unexpected keyword argument {name!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group() first.")
        try:
            _, shards = check_replicate_shard_mesh(mesh)
            self._fsdp_version, self._flat_params, self._flat_members = _validate_module(module, optimizer, mesh)
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
            synchronous_warmup=synchronous_warmup,
            **settings,
        )
        if dist.get_rank() == 0:
            logger.info(
                "FSDP%d hierarchical averaging: %d replicas x %d shards, %d optimizer parameters",
                self._fsdp_version,
                self.averager.world_size // shards,
                shards,
                sum(1 for _ in optimizer_params(optimizer)),
            )

    def _sync_replicas_at_construction(self) -> None:
        """Broadcast replica 0's local shards (sharded tensors; FSDP holds nothing whole), before the anchors of
        ``outer_optimizers`` are taken (see :func:`hieravg_optim.replica.broadcast_from_first_replica`)."""
        self.averager.broadcast_from_first_replica(self._module_shards())

    @property
    def fsdp_version(self) -> int:
        """1 for ``FullyShardedDataParallel``, 2 for ``fully_shard``."""
        return self._fsdp_version

    @property
    def replica_index(self) -> int:
        """This rank's coordinate on the ``"replicate"`` dimension."""
        return int(self.mesh.get_local_rank(REPLICATE_DIM))

    def _module_shards(self) -> list[torch.Tensor]:
        """This rank's local shards of every parameter of the module, frozen ones included, in order."""
        if self._fsdp_version == 1:
            return [_local_flat_shard(u._handle.flat_param) for u in _fsdp1_units(self.module)]
        return [local_tensor(p) for p in self.module.parameters()]

    def _frozen_context(self) -> dict[str, object]:
        if self._fsdp_version == 2:
            return super()._frozen_context()
        if self.average_frozen:
            return {}
        frozen = [i for i, flat in enumerate(self._flat_params) if not self._trainable(flat)]
        return {"skipped frozen FSDP flat parameters (requires_grad=False, index)": frozen}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (progressive unfreezing); its parameters are averaged from then on.

        The new parameters are checked as at construction (managed by FSDP, sharded over this rank's mesh row, of
        the module's FSDP version); FSDP1's flat parameters to average are then found again, so a flat parameter
        of another FSDP unit (a backbone unfrozen later) is averaged too. Every rank must add the same group.

        Raises:
            ValueError, TypeError, NotImplementedError: as the constructor, for a parameter FSDP does not manage
                or shards otherwise, naming it; the group is then not added. On every rank that adds it (the same
                group on every rank gives the same error), before any collective.
        """
        params = param_group.get("params") if isinstance(param_group, Mapping) else None
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is not None and not isinstance(params, (set, Mapping)):
            params = list(params)  # an iterator is read once, here and by the inner optimizer alike
            param_group = {**param_group, "params": params}
        if params is not None:
            candidate = _Groups([*self.optimizer.param_groups, {"params": params}])
            version, flats, members = _validate_module(self.module, candidate, self.mesh)
            if version != self._fsdp_version:
                raise NotImplementedError(
                    f"add_param_group adds FSDP{version} parameters to an optimizer of FSDP{self._fsdp_version} ones: "
                    "shard the module with one FSDP version."
                )
        super().add_param_group(param_group)  # torch's own checks of the group (a set, duplicates) first
        if params is not None:
            self._flat_params, self._flat_members = flats, members

    def _trainable(self, flat: nn.Parameter) -> bool:
        """Whether any optimizer parameter held by FSDP1 flat parameter ``flat`` has ``requires_grad``."""
        return any(p.requires_grad for p in self._flat_members[id(flat)])

    def tensors_to_average(self) -> list[torch.Tensor]:
        """This rank's local shards to average, in order (the same shapes on every same-shard rank).

        FSDP1: the local flat-parameter shards of the FSDP units holding optimizer parameters.
        FSDP2: the ``to_local()`` shards of the optimizer's parameters. Without ``average_frozen``,
        frozen parameters (FSDP1: flat parameters whose optimizer parameters are all frozen) are
        left out.

        Raises:
            RuntimeError: for FSDP1 if a flat parameter is not sharded now (inside forward or
                ``summon_full_params``): averaging must run between iterations.
        """
        if self._fsdp_version == 2:
            return super().tensors_to_average()
        return [
            _local_flat_shard(flat)
            for flat in self._flat_params
            if self.average_frozen or self._trainable(flat)
        ]

    def shard_layouts(self) -> list[ShardLayout]:
        """The layout of each tensor of :meth:`tensors_to_average` in its full tensor, in the same order.

        Anchors of outer optimizers are sharded like these tensors; :func:`~hieravg_optim.fsdp.save_checkpoint`
        stores them as DTensors with these layouts, so that every rank's shard is kept. Local, no collective.
        """
        if self._fsdp_version == 1:
            shard_mesh = self.mesh[SHARD_DIM]
            shards = shard_mesh.size()
            # FSDP1 pads the flat parameter so that every rank's local shard has the same numel.
            return [
                ShardLayout(shard_mesh, (Shard(0),), torch.Size([t.numel() * shards]), (1,))
                for t in self.tensors_to_average()
            ]
        return [
            ShardLayout(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))
            for _, _, p in unique_params(self.optimizer.param_groups)
            if self.average_frozen or p.requires_grad
        ]


class _Groups(NamedTuple):
    """Parameter groups to check with :func:`_validate_module` before they reach the inner optimizer."""

    param_groups: list[dict[str, Any]]


def _local_flat_shard(flat: nn.Parameter) -> torch.Tensor:
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
) -> tuple[int, list[nn.Parameter], dict[int, list[nn.Parameter]]]:
    """Check how ``module`` is sharded.

    Returns:
        The FSDP version and, for FSDP1, the flat parameters to average and, by ``id`` of each, the
        optimizer parameters it holds (itself with ``use_orig_params=False``).
    """
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

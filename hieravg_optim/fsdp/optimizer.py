"""The FSDP optimizer wrapper: local shards averaged across replicas, after checking how the module is sharded.

:class:`FSDPHierarchicalAveragingOptimizer` is :class:`~hieravg_optim.HierarchicalAveragingOptimizer`
with ``ranks_per_replica`` taken from the mesh, averaging FSDP1 flat-parameter shards or FSDP2
DTensor local shards. Its constructor rejects a module sharded across replicas (HYBRID_SHARD,
HSDP) or not by FSDP, on every rank, before any averaging collective.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import fields
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import Placement, Shard
from ..agreement import raise_on_every_rank
from ..config import AveragingConfig
from ..groups import group_timeout
from ..tensors import local_tensor, unique_params
from ..optimizer import HierarchicalAveragingOptimizer
from ..schedule import AveragingLevel
from .layout import ParamGroups, fsdp1_units, local_flat_shard, validate_module
from .mesh import REPLICATE_DIM, SHARD_DIM, check_replicate_shard_mesh, mesh_timeouts

__all__ = ["FSDPHierarchicalAveragingOptimizer", "ShardLayout"]

logger = logging.getLogger(__name__)

_SETTINGS = frozenset(f.name for f in fields(AveragingConfig) if f.init) - {"levels", "ranks_per_replica"}
"""The settings forwarded through ``**settings``: every field of the config but the levels and the mesh's."""




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
            ``average_frozen``, ``collective_timeout_s``, ``nonfinite``, ``comm_dtype``, ``delay_steps``,
            ``fragments``, ``delay_mixing``, ``delay_correction``, ``ranks_per_node``,
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
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group() first.")
        try:
            if "ranks_per_replica" in settings:
                raise TypeError(
                    f"ranks_per_replica={settings['ranks_per_replica']!r} given to FSDPHierarchicalAveragingOptimizer: "
                    "it is the size of the mesh's \"shard\" dimension. Remove it."
                )
            for name in settings:
                if name not in _SETTINGS:
                    raise TypeError(f"FSDPHierarchicalAveragingOptimizer() got an unexpected keyword argument {name!r}")
            _, shards = check_replicate_shard_mesh(mesh)
            self._fsdp_version, self._flat_params, self._flat_members = validate_module(module, optimizer, mesh)
        except Exception as exc:  # noqa: BLE001 - any error of the checks
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
        self._warn_if_mesh_waits_longer()
        if dist.get_rank() == 0:
            logger.info(
                "FSDP%d hierarchical averaging: %d replicas x %d shards, %d optimizer parameters",
                self._fsdp_version,
                self.averager.world_size // shards,
                shards,
                len(unique_params(optimizer.param_groups)),
            )

    def _warn_if_mesh_waits_longer(self) -> None:
        """Warn if a group of the mesh has a longer timeout than the averaging's: FSDP's own collectives wait on it.

        The averaging never communicates over the mesh's groups (it builds its own, with its timeout); FSDP does,
        every step, so a hung rank of the replica is reported by FSDP only at that group's timeout. Local.
        """
        expected = group_timeout(self.averager.config, self.averager.process_group)
        if expected is None:
            return
        limit = expected.total_seconds()
        for name, seconds in mesh_timeouts(self.mesh).items():
            if seconds is not None and seconds > limit:
                warnings.warn(
                    f"The mesh's {name!r} group has a timeout of {seconds:g} s, longer than the averaging's "
                    f"{limit:g} s (collective_timeout_s, else the process group's): FSDP's own collectives over "
                    f"it (all-gathers and gradient reduce-scatters) report a hung rank only after {seconds:g} s. "
                    f"Build the mesh with hieravg_optim.fsdp.init_replicate_shard_mesh(shards_per_replica, "
                    f"timeout_s={limit:g}) (init_device_mesh gives its groups torch's default, 30 min on gloo).",
                    stacklevel=3,
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
            return [local_flat_shard(u._handle.flat_param) for u in fsdp1_units(self.module)]
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
            candidate = ParamGroups([*self.optimizer.param_groups, {"params": params}])
            version, flats, members = validate_module(self.module, candidate, self.mesh)
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
            local_flat_shard(flat)
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

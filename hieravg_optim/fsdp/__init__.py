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
replica is saved to its own folder ``replica_<r>`` over its ``"shard"`` process group. The
anchors of outer optimizers (``outer_optimizers``), which are sharded like the local shards they
anchor, are saved as DTensors with those shards' layouts, so that DCP keeps every rank's shard.

The modules: :mod:`~hieravg_optim.fsdp.mesh` (the mesh and :func:`shard_replica`),
:mod:`~hieravg_optim.fsdp.optimizer` (the optimizer and the module checks) and
:mod:`~hieravg_optim.fsdp.checkpoint` (DCP per-replica checkpoints).
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .mesh import REPLICATE_DIM, SHARD_DIM, check_replicate_shard_mesh, init_replicate_shard_mesh, shard_replica
from .optimizer import FSDPHierarchicalAveragingOptimizer

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

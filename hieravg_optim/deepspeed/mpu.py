"""The replica ``mpu``: DeepSpeed's data-parallel group restricted to one replica.

DeepSpeed takes its data-parallel and model-parallel groups from an ``mpu`` (model
parallel unit) object. :class:`ReplicaParallelUnit` makes each block of
``ranks_per_replica`` consecutive ranks a data-parallel group, and each rank its own
model-parallel group.
"""

from __future__ import annotations

import torch.distributed as dist

from ..groups import averaging_timeout, new_timed_group

__all__ = ["ReplicaParallelUnit"]


class ReplicaParallelUnit:
    """An ``mpu`` that makes each replica (block of consecutive ranks) a DeepSpeed data-parallel group.

    DeepSpeed reads the data-parallel group, rank and size from it (gradient reduction,
    ZeRO partitioning, ``train_batch_size``, checkpoint file names) and all-reduces
    overflow flags and norms over its model-parallel group, which here is the rank alone.

    .. warning::
        The constructor is collective over the default process group: every rank creates
        every replica's group, in the same order, with :func:`torch.distributed.new_group`.

    The replica groups are also the averaging's replica groups (its finiteness vote, the buffers'
    average within the replica): the averager reuses them instead of building its own.

    Args:
        ranks_per_replica: Ranks per replica; must divide the world size.
        timeout_s: The timeout of the replica groups, in seconds (``collective_timeout_s``: the averaging
            uses them too, and DeepSpeed reduces gradients over them, so a hung rank of a replica is reported
            in this time); ``None``: the default process group's (``init_process_group(timeout=...)``), not
            torch's default for :func:`torch.distributed.new_group` (30 min on gloo, 10 min on NCCL).
    """

    def __init__(self, ranks_per_replica: int, *, timeout_s: float | None = None) -> None:
        world_size = dist.get_world_size()
        rank = dist.get_rank()
        if world_size % ranks_per_replica != 0:
            raise ValueError(
                f"ranks_per_replica={ranks_per_replica} must divide the world size ({world_size})."
            )
        self.ranks_per_replica = ranks_per_replica
        self.replica_index = rank // ranks_per_replica
        """Which replica this rank belongs to (0 .. world_size / ranks_per_replica - 1)."""
        first = self.replica_index * ranks_per_replica
        self._dp_ranks = list(range(first, first + ranks_per_replica))
        self._dp_group = None
        timeout = averaging_timeout(timeout_s, None)
        for start in range(0, world_size, ranks_per_replica):
            ranks = list(range(start, start + ranks_per_replica))
            whole_world = ranks_per_replica == world_size and timeout_s is None
            group = dist.group.WORLD if whole_world else new_timed_group(ranks, timeout)
            if rank in ranks:
                self._dp_group = group
        self._mp_group = None
        for other in range(world_size):
            group = new_timed_group([other], timeout)
            if other == rank:
                self._mp_group = group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._dp_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank() - self._dp_ranks[0]

    def get_data_parallel_world_size(self) -> int:
        return self.ranks_per_replica

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._mp_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()


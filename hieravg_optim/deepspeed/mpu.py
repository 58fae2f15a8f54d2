"""The replica ``mpu``: DeepSpeed's data-parallel group restricted to one replica.

DeepSpeed takes its data-parallel and model-parallel groups from an ``mpu`` (model
parallel unit) object. :class:`ReplicaParallelUnit` makes each block of
``ranks_per_replica`` consecutive ranks a data-parallel group, and each rank its own
model-parallel group.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["ReplicaParallelUnit"]


class ReplicaParallelUnit:
    """An ``mpu`` that makes each replica (block of consecutive ranks) a DeepSpeed data-parallel group.

    DeepSpeed reads the data-parallel group, rank and size from it (gradient reduction,
    ZeRO partitioning, ``train_batch_size``, checkpoint file names) and all-reduces
    overflow flags and norms over its model-parallel group, which here is the rank alone.

    .. warning::
        The constructor is collective over the default process group: every rank creates
        every replica's group, in the same order, with :func:`torch.distributed.new_group`.

    Args:
        ranks_per_replica: Ranks per replica; must divide the world size.
    """

    def __init__(self, ranks_per_replica: int) -> None:
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
        for start in range(0, world_size, ranks_per_replica):
            ranks = list(range(start, start + ranks_per_replica))
            group = dist.group.WORLD if ranks_per_replica == world_size else dist.new_group(ranks)
            if rank in ranks:
                self._dp_group = group
        self._mp_group = None
        for other in range(world_size):
            group = dist.new_group([other])
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


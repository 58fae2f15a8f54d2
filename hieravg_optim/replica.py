"""The ranks of one replica, for checks that must hold for a whole sharded replica.

With ``ranks_per_replica = s > 1`` the averaging subgroups of a level hold one shard index
each (see :mod:`hieravg_optim.groups`), so the ranks of one replica sit in ``s`` different
subgroups. A decision about a replica (``nonfinite``: is this replica finite?) taken in each
subgroup alone would differ between its shards: a NaN in shard 0 would make shard 0's subgroup
raise, or skip the replica, while shard 1's subgroup averaged the replica in. The functions here
give the ranks of a replica one answer first, over the replica's own group (the ``s``
consecutive ranks that already reduce gradients together every step).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ._handover import hand_over
from .config import AveragingConfig

__all__ = ["build_replica_group", "replica_any", "replica_dir"]


def replica_dir(root: str | os.PathLike, replica_index: int) -> str:
    """The folder of replica ``replica_index``'s checkpoints under ``root``: ``<root>/replica_<k>``.

    The one place of this name; both adapters' per-replica checkpoints use it.
    """
    return os.path.join(os.fspath(root), f"replica_{replica_index}")


def build_replica_group(
    config: AveragingConfig, process_group: dist.ProcessGroup, timeout: timedelta | None
) -> dist.ProcessGroup | None:
    """This rank's replica group (``ranks_per_replica`` consecutive ranks of ``process_group``), or ``None``.

    ``None`` when no replica-wide check is needed: ``ranks_per_replica == 1`` or
    ``nonfinite == "ignore"``.

    .. warning::
        Collective: every rank of ``process_group`` calls this with the same ``config``, because
        :func:`torch.distributed.new_group` is (with ``use_local_synchronization=True`` when
        ``process_group`` is smaller than the default group, as :func:`~hieravg_optim.groups.build_level_groups`).

    Args:
        config: A config checked with :meth:`AveragingConfig.check_world_size`.
        process_group: The overall group.
        timeout: The timeout of the new groups; ``None``: torch's default for the backend.
    """
    s = config.ranks_per_replica
    if s == 1 or config.nonfinite == "ignore":
        return None
    ranks = dist.get_process_group_ranks(process_group)
    local_sync = len(ranks) != dist.get_world_size()
    kwargs = {} if timeout is None else {"timeout": timeout}
    mine = None
    for start in range(0, len(ranks), s):
        members = ranks[start : start + s]
        if not local_sync:
            group = dist.new_group(members, **kwargs)
        elif dist.get_rank() in members:
            group = dist.new_group(members, use_local_synchronization=True, **kwargs)
        else:
            continue
        if dist.get_rank() in members:
            mine = group
    return mine


def replica_any(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``flag`` holds on any rank of this rank's replica ``group`` (``flag`` itself for ``None``).

    .. warning::
        Collective over ``group``: one all-reduce (MAX) of one int64.
    """
    if group is None:
        return flag
    probe = torch.tensor([int(flag)], dtype=torch.int64, device=_device(group))
    hand_over(probe)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    return bool(probe.item())


def _device(group: dist.ProcessGroup) -> torch.device:
    from .agreement import _collective_device

    return _collective_device(group)

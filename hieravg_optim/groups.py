"""Where to average: the averaging subgroups of each level, built once.

Layout: ranks are numbered by their rank
in the overall process group ``P`` of size ``W``.

* A *replica* is a block of ``s = ranks_per_replica`` consecutive ranks:
  ``[0, s)``, ``[s, 2s)``, ... Within a replica, rank ``i`` holds shard index ``i % s``.
* A level of group size ``G`` splits ``P`` into blocks of ``G`` consecutive ranks.
  Within a block, the ``G / s`` ranks that hold the same shard index form one
  averaging subgroup: ``{b*G + k*s + j : k = 0 .. G/s - 1}``.

Under ``torchrun`` and the ``deepspeed`` launcher, consecutive ranks share a node,
so blocks of ``LOCAL_WORLD_SIZE`` ranks are node-aligned. With ``s = 1`` this is
exactly the layout of ``torch.distributed.new_subgroups(group_size=G)``.

Every rank of ``P`` builds the groups, creating the same groups in the same order.
When ``P`` is the default group this is :func:`torch.distributed.new_group`'s usual
requirement; when ``P`` is smaller (a data-parallel group beside model-parallel ranks,
or disjoint groups each with its own hierarchy), the ranks outside ``P`` take no part:
each rank creates only its own subgroups, with ``use_local_synchronization=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ._compat import process_group_timeout
from .config import AveragingConfig
from .schedule import AveragingLevel

__all__ = [
    "LevelGroup",
    "NodeGroups",
    "averaging_subgroup_ranks",
    "averaging_timeout",
    "build_level_groups",
    "group_timeout",
    "new_timed_group",
    "node_split_ranks",
    "process_group_timeout",
    "timed_process_group",
    "timeout_seconds",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeGroups:
    """The subgroups of a node-aware level, for this rank (see :func:`build_level_groups`).

    The ``n = local_size * cross_size`` ranks of an averaging subgroup are split by node: the
    ``local_size`` of them on this rank's node form :attr:`local`, and the ``cross_size`` ranks
    with this rank's index on every node form :attr:`cross`.
    """

    local: dist.ProcessGroup
    """This rank's subgroup members on its own node (reduce-scatter and all-gather)."""
    local_size: int
    """Ranks in :attr:`local`, at least 2."""
    cross: dist.ProcessGroup | None
    """The members with this rank's index on every node (all-reduce of the shards); ``None`` for one node."""
    cross_size: int
    """Ranks in :attr:`cross`: the nodes the subgroup spans."""


@dataclass(frozen=True, slots=True)
class LevelGroup:
    """This rank's averaging subgroup at one level."""

    level: AveragingLevel
    ranks: tuple[int, ...]
    """Global ranks of the subgroup, this rank included, in ascending order."""
    group: dist.ProcessGroup | None
    """The process group to all-reduce over; ``None`` when the subgroup is this rank alone."""
    node: NodeGroups | None = None
    """The node subgroups when this level averages node-aware (``ranks_per_node`` set and the subgroup
    spanning several nodes with at least two of its ranks on each); ``None`` for a flat all-reduce."""

    @property
    def size(self) -> int:
        """Number of ranks that average together (replicas, one shard each)."""
        return len(self.ranks)


def averaging_subgroup_ranks(world_size: int, group_size: int, ranks_per_replica: int) -> list[list[int]]:
    """All averaging subgroups of one level, as lists of ranks in the overall group.

    Pure: no collective. The order is the creation order every rank follows.
    """
    s = ranks_per_replica
    subgroups = []
    for block_start in range(0, world_size, group_size):
        for shard in range(s):
            subgroups.append(list(range(block_start + shard, block_start + group_size, s)))
    return subgroups


def averaging_timeout(collective_timeout_s: float | None, process_group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout of every group this package creates: ``collective_timeout_s`` (seconds), else that of
    ``process_group`` (``None``: the default group), else ``None`` (unknown: torch's default for the backend)."""
    if collective_timeout_s is not None:
        return timedelta(seconds=collective_timeout_s)
    return process_group_timeout(process_group if process_group is not None else dist.group.WORLD)


def group_timeout(config: AveragingConfig, process_group: dist.ProcessGroup) -> timedelta | None:
    """The timeout of the groups created for ``config``: ``collective_timeout_s``, else that of ``process_group``."""
    return averaging_timeout(config.collective_timeout_s, process_group)


def new_timed_group(
    ranks: Sequence[int], timeout: timedelta | None, *, local_sync: bool = False
) -> dist.ProcessGroup | None:
    """A new process group of ``ranks`` (global ranks) with ``timeout``: the one place this package creates groups.

    :func:`torch.distributed.new_group` alone gives a group torch's default timeout for the backend (30 min on
    gloo, 10 min on NCCL), whatever ``init_process_group(timeout=...)`` said; every group created here gets
    ``timeout`` instead (see :func:`averaging_timeout`), so that a hung peer is reported in the user's time.

    .. warning::
        Collective: every rank of the default group calls this for every group, in one order; with
        ``local_sync``, only the members call it (``use_local_synchronization=True``), and the others get ``None``.
    """
    kwargs = {} if timeout is None else {"timeout": timeout}
    if not local_sync:
        return dist.new_group(list(ranks), **kwargs)
    if dist.get_rank() not in ranks:
        return None
    return dist.new_group(list(ranks), use_local_synchronization=True, **kwargs)


def timed_process_group(
    config: AveragingConfig, process_group: dist.ProcessGroup, level_groups: Sequence[LevelGroup]
) -> dist.ProcessGroup:
    """The ranks of ``process_group`` with the averaging's timeout, for the collectives over all of them after
    construction (the step count's check after a load, the anchors' agreement, the broadcast of whole tensors).

    ``process_group`` itself without ``collective_timeout_s`` or where its timeout is that one already; else the
    top level's group where it spans ``process_group`` (created with the timeout); else a new group.

    .. warning::
        Collective over ``process_group`` when a group is created (as :func:`build_level_groups`).
    """
    timeout = group_timeout(config, process_group)
    if config.collective_timeout_s is None or process_group_timeout(process_group) == timeout:
        return process_group
    ranks = dist.get_process_group_ranks(process_group)
    top = level_groups[-1]
    if top.group is not None and len(top.ranks) == len(ranks):
        return top.group
    group = new_timed_group(ranks, timeout, local_sync=len(ranks) != dist.get_world_size())
    assert group is not None
    return group


def timeout_seconds(config: AveragingConfig, group: dist.ProcessGroup | None) -> float | None:
    """The timeout of ``group`` in seconds, for error messages: ``collective_timeout_s``, else the group's own."""
    if config.collective_timeout_s is not None:
        return config.collective_timeout_s
    timeout = process_group_timeout(group) if group is not None else None
    return None if timeout is None else timeout.total_seconds()


def node_split_ranks(subgroup: list[int], ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """Split one averaging subgroup (ranks in the overall group) by node; pure, no collective.

    Returns:
        ``(local, cross)``: ``local`` holds the subgroup's ranks on each node, node by node;
        ``cross[j]`` holds the ``j``-th of them on every node. Both are empty when the subgroup lies in
        one node or has a single rank per node (a flat all-reduce is then as good).
    """
    by_node: dict[int, list[int]] = {}
    for r in subgroup:
        by_node.setdefault(r // ranks_per_node, []).append(r)
    local = list(by_node.values())
    if len(local) < 2 or len(local[0]) < 2:
        return [], []
    assert all(len(members) == len(local[0]) for members in local), f"uneven node split of {subgroup}"
    return local, [list(column) for column in zip(*local)]


def build_level_groups(
    config: AveragingConfig,
    process_group: dist.ProcessGroup | None = None,
    *,
    levels: Sequence[AveragingLevel] | None = None,
    fresh: bool = False,
) -> list[LevelGroup]:
    """Create the averaging subgroups of every level, once.

    .. warning::
        Collective: when ``process_group`` is the default group, every rank of it must
        call this with the same ``config``, because :func:`torch.distributed.new_group` is.
        For a smaller ``process_group``, only its ranks call this (each creates its own
        subgroups with ``use_local_synchronization=True``); disjoint process groups, each
        with its own hierarchy, work too.

    Args:
        config: A config already checked with :meth:`AveragingConfig.check_world_size`. Its
            ``collective_timeout_s`` (seconds) is the timeout of every group created here; ``None``
            gives them the timeout of ``process_group`` (:func:`torch.distributed.new_group` alone
            would give torch's default for the backend, 30 min on gloo, 10 min on NCCL).
        process_group: The overall group; ``None`` means the default (world) group.
        levels: The levels to build groups for (``None``: ``config.levels``).
        fresh: Create every group anew, never reusing ``process_group``: the groups of the rounds that run in the
            background (``delay_steps``), which no other collective may share. The levels of one call still share
            a group where their ranks are the same: call it once per level for groups of one level each.

    Returns:
        One :class:`LevelGroup` per level, in the order of ``config.levels`` (or ``levels``).
    """
    pg = process_group if process_group is not None else dist.group.WORLD
    global_ranks = dist.get_process_group_ranks(pg)
    world_size = len(global_ranks)
    my_rank = dist.get_rank()
    # A process group smaller than the default group (a data-parallel group beside model-parallel
    # ranks, or disjoint groups each with its own hierarchy): the other ranks of the default group do
    # not take part, so every rank creates only its own subgroups, synchronizing with their members.
    local_sync = world_size != dist.get_world_size()
    # With a timeout of its own, the top level cannot reuse ``pg`` (which keeps the process group's timeout).
    own_timeout = config.collective_timeout_s is not None
    timeout = group_timeout(config, pg)
    cache: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    def ensure_group(ranks: tuple[int, ...]) -> None:
        """Create the group of ``ranks`` once (every rank calls this for every group, in one order)."""
        if ranks in cache:
            return
        if len(ranks) == 1:
            cache[ranks] = None
        elif len(ranks) == world_size and not own_timeout and not fresh:
            cache[ranks] = pg
        elif not local_sync or my_rank in ranks:
            cache[ranks] = new_timed_group(ranks, timeout, local_sync=local_sync)

    result = []
    for level in config.levels if levels is None else levels:
        mine: tuple[int, ...] | None = None
        for local in averaging_subgroup_ranks(world_size, level.group_size, config.ranks_per_replica):
            ranks = tuple(sorted(global_ranks[i] for i in local))
            ensure_group(ranks)
            if my_rank in ranks:
                mine = ranks
        assert mine is not None, f"rank {my_rank} is in no subgroup of level {level}"
        node = None
        if config.ranks_per_node is not None:
            for local in averaging_subgroup_ranks(world_size, level.group_size, config.ranks_per_replica):
                on_node, across = node_split_ranks(local, config.ranks_per_node)
                for members in on_node + across:
                    ensure_group(tuple(sorted(global_ranks[i] for i in members)))
                mine_local = [m for m in on_node if my_rank in (global_ranks[i] for i in m)]
                if mine_local:
                    mine_cross = next(c for c in across if my_rank in (global_ranks[i] for i in c))
                    node = NodeGroups(
                        local=cache[tuple(sorted(global_ranks[i] for i in mine_local[0]))],
                        local_size=len(mine_local[0]),
                        cross=cache[tuple(sorted(global_ranks[i] for i in mine_cross))],
                        cross_size=len(mine_cross),
                    )
        result.append(LevelGroup(level=level, ranks=mine, group=cache[mine], node=node))
    if my_rank == global_ranks[0] and not fresh:
        for lg in result:
            logger.info(
                "hierarchical averaging: every %d steps, %d ranks per group average in subgroups of %d "
                "(ranks_per_replica=%d); rank %d averages with ranks %s",
                lg.level.period,
                lg.level.group_size,
                lg.size,
                config.ranks_per_replica,
                my_rank,
                list(lg.ranks),
            )
    return result

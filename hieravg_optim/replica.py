"""The replica: its group, its finiteness vote, equal replicas at construction, its checkpoint folder.

A *replica* is a block of ``ranks_per_replica`` consecutive ranks holding one copy of the model
between them (each rank a shard, or each rank a whole copy of some tensors). With ``ranks_per_replica = s > 1`` the averaging subgroups of a level hold one shard index
each (see :mod:`hieravg_optim.groups`), so the ranks of one replica sit in ``s`` different
subgroups. A decision about a replica (``nonfinite``: is this replica finite?) taken in each
subgroup alone would differ between its shards: a NaN in shard 0 would make shard 0's subgroup
raise, or skip the replica, while shard 1's subgroup averaged the replica in. The functions here
give the ranks of a replica one answer first, over the replica's own group (the ``s``
consecutive ranks that already reduce gradients together every step).

The replicas start equal by one rule, whatever the entry point: :func:`broadcast_from_first_replica`
sends replica 0's *sharded* tensors over the top level's same-shard subgroups and the *whole*
tensors (held whole by every rank, e.g. module buffers) from the first rank of the process group.
Whole tensors are averaged over a level's block in two steps: with the sharded ones over the
same-shard subgroup, then over the replica (:func:`average_within_replica`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ._handover import hand_over
from .agreement import collective_device, agree_across_ranks, check_agreement, tensor_signature
from .averaging import BucketPool, average_tensors_
from .config import AveragingConfig
from .faults import CollectiveError, named_collective
from .groups import LevelGroup, new_timed_group, process_group_timeout

__all__ = [
    "average_within_replica",
    "broadcast_from_first_replica",
    "build_replica_group",
    "replica_any",
    "replica_dir",
    "replica_group_for",
]


def replica_dir(root: str | os.PathLike, replica_index: int) -> str:
    """The folder of replica ``replica_index``'s checkpoints under ``root``: ``<root>/replica_<k>``.

    The one place of this name; both adapters' per-replica checkpoints use it.
    """
    return os.path.join(os.fspath(root), f"replica_{replica_index}")


def build_replica_group(
    config: AveragingConfig, process_group: dist.ProcessGroup, timeout: timedelta | None
) -> dist.ProcessGroup | None:
    """This rank's replica group (``ranks_per_replica`` consecutive ranks of ``process_group``), or ``None``.

    ``None`` with ``ranks_per_replica == 1``. The group serves the replica's finiteness vote, the average of
    the tensors held whole within the replica, and the adapters' collectives within a replica (checkpoints),
    all with ``timeout``.

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
    if s == 1:
        return None
    ranks = dist.get_process_group_ranks(process_group)
    local_sync = len(ranks) != dist.get_world_size()
    mine = None
    for start in range(0, len(ranks), s):
        members = ranks[start : start + s]
        group = new_timed_group(members, timeout, local_sync=local_sync)
        if dist.get_rank() in members:
            mine = group
    return mine


def replica_group_for(
    config: AveragingConfig,
    process_group: dist.ProcessGroup,
    timeout: timedelta | None,
    given: dist.ProcessGroup | None = None,
) -> dist.ProcessGroup | None:
    """This rank's replica group: ``given`` (an existing group of the replica's ranks, e.g. the DeepSpeed
    mpu's data-parallel group), else one built by :func:`build_replica_group`; ``None`` with one rank per replica.

    .. warning::
        Collective over ``process_group`` when ``given`` is ``None`` (see :func:`build_replica_group`);
        local otherwise.

    Raises:
        ValueError: if ``given`` does not hold exactly this rank's replica (``ranks_per_replica``
            consecutive ranks of ``process_group``).
    """
    if given is None:
        return build_replica_group(config, process_group, timeout)
    s = config.ranks_per_replica
    if s == 1:
        return None
    ranks = dist.get_process_group_ranks(process_group)
    first = dist.get_rank(process_group) // s * s
    expected = ranks[first : first + s]
    if dist.get_process_group_ranks(given) != expected:
        raise ValueError(
            f"replica_group holds ranks {dist.get_process_group_ranks(given)}, but rank {dist.get_rank()}'s replica "
            f"is ranks {expected} (ranks_per_replica={s} consecutive ranks of the process group). Pass the group of "
            "this rank's replica, or None to have one built."
        )
    return given


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
    return collective_device(group)


def _timeout_s(group: dist.ProcessGroup | None) -> float | None:
    """``group``'s timeout in seconds, for error messages; ``None`` if unknown."""
    timeout = None if group is None else process_group_timeout(group)
    return None if timeout is None else timeout.total_seconds()


@torch.no_grad()
def broadcast_from_first_replica(
    sharded: Sequence[torch.Tensor],
    whole: Sequence[torch.Tensor] = (),
    *,
    top: LevelGroup,
    process_group: dist.ProcessGroup,
    timeout_s: float | None = None,
) -> None:
    """Overwrite the tensors in place with the first replica's (as DDP broadcasts from rank 0).

    ``sharded`` (this rank's shards) come from the rank of ``top`` (the top level's same-shard subgroup)
    in replica 0, the one holding the same shard; ``whole`` (tensors every rank holds whole, e.g. module
    buffers, which may differ within a replica) from the first rank of ``process_group``.

    One agreement before any broadcast, so that a rank whose tensors differ in number, shapes or dtypes
    (a model with another set of buffers) is a ``RuntimeError`` on every rank of ``process_group``, not a
    hang: :func:`~hieravg_optim.agreement.check_agreement` over ``top`` (``sharded`` and ``whole``), then,
    where ``top`` is smaller than ``process_group``, :func:`~hieravg_optim.agreement.agree_across_ranks`
    over ``process_group`` (``whole``, and whether a subgroup disagreed).

    .. warning::
        Collective over ``process_group``: an all-reduce of four int64 over ``top``, an all-gather of two
        int64 per rank over ``process_group`` (unless ``top`` spans it), then one broadcast per tensor
        (``sharded`` over ``top``, ``whole`` over ``process_group``, or over ``top`` where it spans it).

    Args:
        sharded: This rank's shards, the same number, shapes and dtypes on every rank of ``top``.
        whole: Tensors held whole, the same number, shapes and dtypes on every rank of ``process_group``.
        top: This rank's subgroup at the top level.
        process_group: The overall group.
        timeout_s: ``top``'s timeout in seconds, quoted if a collective over it fails; ``None``: read
            from the group.

    Raises:
        RuntimeError: on every rank, before any broadcast, if the ranks disagree on the tensors; if a
            collective fails (a dead or hung peer), naming it and the group's ranks
            (:func:`hieravg_optim.faults.named_collective`).
    """
    ranks = dist.get_process_group_ranks(process_group)
    spans = top.group is not None and len(top.ranks) == len(ranks)
    what = "the tensors broadcast from the first replica at construction"
    context: dict[str, object] = {"operation": "broadcast from the first replica"}
    if whole:
        context["tensors held whole (from the first rank)"] = tensor_signature(whole)
    error: BaseException | None = None
    if timeout_s is None:
        timeout_s = _timeout_s(top.group)
    if top.group is not None:
        with named_collective(f"the agreement on {what}", top.ranks, timeout_s=timeout_s):
            try:
                check_agreement(sharded, top.group, top.ranks, context=context, what=what)
            except CollectiveError:
                raise
            except RuntimeError as exc:  # a disagreement in this subgroup: raised on every rank below
                if spans:
                    raise
                error = exc
    if not spans and (whole or top.group is not None):
        agree_across_ranks(
            what,
            context,
            process_group,
            error=error,
            fix="Build the model identically on every rank (the same parameters and buffers) before the averaging.",
        )
    if top.group is not None:
        with named_collective("the broadcast from the first replica at construction", top.ranks, timeout_s=timeout_s):
            for t in [*sharded, *whole] if spans else sharded:
                hand_over(t)
                dist.broadcast(t, src=top.ranks[0], group=top.group)
    if whole and not spans:
        what = "the broadcast of the tensors held whole from the first rank at construction"
        with named_collective(what, ranks, timeout_s=_timeout_s(process_group)):
            for t in whole:
                hand_over(t)
                dist.broadcast(t, src=ranks[0], group=process_group)


@torch.no_grad()
def average_within_replica(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    *,
    step: int,
    what: str,
    bucket_cap_bytes: int,
    pool: BucketPool,
) -> int:
    """Average ``tensors`` (held whole by every rank of the replica) in place over the replica ``group``.

    After a level's round has averaged them with the same-shard ranks of the other replicas, this gives
    each their mean over the level's whole block. Agreed first
    (:func:`~hieravg_optim.agreement.check_agreement`, with the step count), named
    (:func:`~hieravg_optim.faults.named_collective`, with the group's timeout).

    .. warning::
        Collective over ``group``: an all-reduce of four int64, then the averaging collective.

    Returns:
        The payload all-reduced, in bytes.

    Raises:
        RuntimeError: on every rank of ``group``, if the ranks disagree on the tensors or the step count,
            or if a collective fails (naming ``what`` and the replica's ranks).
    """
    ranks = dist.get_process_group_ranks(group)
    with named_collective(what, ranks, timeout_s=_timeout_s(group)):
        check_agreement(tensors, group, ranks, context={"step count": step}, what=f"the tensors of {what}")
        return average_tensors_(
            tensors, group, len(ranks), bucket_cap_bytes=bucket_cap_bytes, pool=pool, what=what
        )

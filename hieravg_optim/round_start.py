"""The synchronous start of a round, shared by every kind of round (synchronous, delayed, compressed): the
replica's non-finite vote, the agreement of the group's ranks, the non-finite policy, and the first average of
anchors not yet equal across the group.

:func:`agree_round` is what :func:`hieravg_optim.rounds.average_round`,
:meth:`hieravg_optim.delayed.DelayedRounds.start` and the compressed rounds
(:mod:`hieravg_optim.compression.round`, :mod:`hieravg_optim.compression.delayed`) run before their collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .agreement import check_agreement
from .anchors import OuterLevel
from .averaging import BucketPool, average_tensors_
from .config import AveragingConfig
from .faults import named_collective
from .groups import LevelGroup, timeout_seconds
from .nonfinite import skip_nonfinite
from .replica import replica_any

__all__ = ["agree_round", "replica_vote", "sync_anchors"]


def replica_vote(
    local: bool, name: str, config: AveragingConfig, replica_group: dist.ProcessGroup | None, replica_ranks: list[int]
) -> bool:
    """Whether any rank of this rank's replica holds non-finite tensors before the round ``name`` (``local``: this
    rank's), agreed over the replica, not the level's group, so that a hung peer there is named as such.

    .. warning::
        Collective over the replica's group (one int64; nothing with one rank per replica).
    """
    with named_collective(
        f"the agreement of the replica's ranks on whether it is finite, before {name}",
        replica_ranks,
        timeout_s=timeout_seconds(config, replica_group),
    ):
        return replica_any(local, replica_group)


def agree_round(
    tensors: Sequence[torch.Tensor],
    *,
    config: AveragingConfig,
    process_group: dist.ProcessGroup,
    lg: LevelGroup,
    step: int,
    name: str,
    what: str,
    context: Mapping[str, object],
    error: BaseException | None,
    replica_group: dist.ProcessGroup | None,
    replica_ranks: list[int],
    local_nonfinite: Callable[[], bool],
    anchors_unsynced: bool,
) -> tuple[list[int], int | None]:
    """The synchronous start of every round over ``lg``: the non-finite check and the replica's vote, the agreement
    of the group's ranks on ``tensors`` and ``context`` (with the step count and ``bucket_cap_mb``), and the
    non-finite policy. Shared by the synchronous, delayed and compressed rounds.

    ``local_nonfinite`` reads this rank's tensors (and anchors) for NaN and infinities (not called with
    ``nonfinite="ignore"``); its error, and ``error``, are raised on every rank of the group by the agreement.

    Returns:
        ``(bad, divisor)``: the ranks of ``lg`` whose replica is non-finite (the same on every rank) and the
        number of finite replicas to divide by (``None`` when every replica is finite).

    .. warning::
        Collective over this rank's replica (the vote) and over ``lg``'s group (the agreement).

    Raises:
        RuntimeError: from :func:`~hieravg_optim.agreement.check_agreement` (ranks that disagree, or a local error,
            on every rank of the group) and :func:`~hieravg_optim.nonfinite.skip_nonfinite` (``nonfinite="raise"``).
    """
    nonfinite = None
    if config.nonfinite != "ignore":
        try:
            local = local_nonfinite()
        except Exception as exc:  # noqa: BLE001 - raised on every rank of the group by the agreement
            local, error = False, error or exc
        nonfinite = replica_vote(local, name, config, replica_group, replica_ranks)
    bad = check_agreement(
        tensors,
        lg.group,
        lg.ranks,
        context={"step count": step, "bucket_cap_mb": config.bucket_cap_mb, **context},
        what=what,
        error=error,
        nonfinite=nonfinite,
    )
    divisor = skip_nonfinite(config, process_group, lg, bad, name, anchors=anchors_unsynced) if bad else None
    return bad, divisor


def sync_anchors(
    outer: OuterLevel,
    lg: LevelGroup,
    tensors: Sequence[torch.Tensor],
    pool: BucketPool,
    config: AveragingConfig,
    skipped: bool,
    divisor: int | None,
) -> int:
    """Average ``outer``'s anchors over ``lg`` (fp32, on the tensors' devices); returns the payload in bytes.

    Run at the level's first round after the anchors were taken, whose local copies may differ across
    replicas (e.g. without a synchronous warm-up). A rank ``skipped`` for non-finite tensors adds nothing.
    """
    assert outer.anchors is not None
    staged = [a if a.device == t.device else a.to(t.device) for a, t in zip(outer.anchors, tensors)]
    payload = average_tensors_(
        staged,
        lg.group,
        lg.size,
        bucket_cap_bytes=config.bucket_cap_bytes,
        pool=pool,
        divisor=divisor,
        node=lg.node,
        contribute_zeros=skipped,
    )
    for a, s in zip(outer.anchors, staged):
        if a is not s:
            a.copy_(s)
    outer.synced = True
    return payload

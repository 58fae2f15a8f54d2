"""One averaging round at one level: agreement, the non-finite policy, the collective, the outer step, metrics.

:func:`average_round` is what :meth:`hieravg_optim.HierarchicalAverager.average` runs; every collective of a
round is issued here, under one :func:`~hieravg_optim.faults.named_collective` naming the round.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .anchors import OuterLevels
from .averaging import BucketPool, Prescaled, average_tensors_, prescale_checked_
from .compression.round import compressed_round
from .config import AveragingConfig
from .faults import named_collective
from .groups import LevelGroup, timeout_seconds
from .metrics import LevelMetrics, bytes_sent
from .nonfinite import has_nonfinite
from .replica import average_within_replica
from .round_start import agree_round, replica_vote, sync_anchors

__all__ = ["average_round", "average_round_within_replica", "replica_vote", "round_name"]  # replica_vote: its old path


def round_name(step: int, lg: LevelGroup) -> str:
    """How errors and logs name the round at count ``step`` at level ``lg``."""
    return f"the averaging round at step {step} (period {lg.level.period}, group size {lg.level.group_size})"


def average_round(
    tensors: Sequence[torch.Tensor],
    *,
    config: AveragingConfig,
    process_group: dist.ProcessGroup,
    level_index: int,
    lg: LevelGroup,
    step: int,
    outers: OuterLevels,
    metrics: LevelMetrics,
    pool: BucketPool,
    replica_group: dist.ProcessGroup | None,
    replica_ranks: list[int],
    error: BaseException | None = None,
    context: Mapping[str, object] | None = None,
) -> bool:
    """Average ``tensors`` in place over ``lg``: :meth:`hieravg_optim.HierarchicalAverager.average`'s round.

    At a level with an outer optimizer whose anchors are taken (``take_anchors``), the round goes on
    after the in-place average gives ``mean``: the pseudo-gradient ``g = anchor - mean`` (torchft's sign:
    outer SGD with lr 1 and no momentum gives back ``mean``) is set as the anchors' ``.grad``, the outer
    optimizer steps once, and the anchors are copied into ``tensors`` in place (cast to their dtype). The
    level's first round after ``take_anchors`` first averages the anchors over the group too (one more
    all-reduce, in fp32). Then, after any level's round (outer or plain), the anchors of every lower level
    with an outer optimizer are reset to the new ``tensors``; higher levels keep theirs. Before the anchors
    are taken (warm-up rounds) the level averages plainly. The outer step is local: every rank of the group
    holds the same anchors, mean and outer state, so the replicas stay identical.

    With ``config.nonfinite`` other than ``"ignore"``, every rank first checks its tensors for NaN and
    infinities: the tensors reduced in place are divided by the group size in the same pass, where that is exact
    (:func:`hieravg_optim.averaging.prescale_checked_`), the others are read once
    (:func:`hieravg_optim.nonfinite.has_nonfinite`); the ranks agree on the result in the agreement collective,
    with no extra round trip. If the round does not go on as planned (a non-finite replica, an error before the
    all-reduce), the division is undone before anything else.

    A level with ``compress`` whose anchors are taken runs :func:`hieravg_optim.compression.round.compressed_round`
    instead.

    Returns:
        Whether this rank's tensors were replaced by the finite replicas' mean (``nonfinite="skip_replica"``).
    """
    outer = outers.by_level[level_index]
    if config.level_compress(level_index) is not None and outer is not None and outer.anchors is not None:
        return compressed_round(
            tensors, config=config, process_group=process_group, level_index=level_index, lg=lg, step=step,
            outers=outers, metrics=metrics, pool=pool, replica_group=replica_group, replica_ranks=replica_ranks,
            error=error, context=context, name=round_name(step, lg),
        )  # fmt: skip
    if outer is not None and error is None:
        error = outers.error(level_index, tensors, step, config.warmup_steps)
    if outer is not None and outer.anchors is None:
        outer = None  # warm-up: no anchors yet, plain averaging
    if lg.group is None:
        if error is not None:
            raise error
        start = time.perf_counter()
        if outer is not None:
            outer.step(outers.part(tensors))
            metrics.pseudo_grad_norm = outer.pseudo_grad_norm
        outers.reset_lower(level_index, tensors)
        metrics.rounds += 1
        metrics.seconds += time.perf_counter() - start
        return False
    start = time.perf_counter()
    name = round_name(step, lg)
    with torch.no_grad(), named_collective(name, lg.ranks, timeout_s=timeout_seconds(config, lg.group)):
        # Anchors not yet averaged over the group are local copies (taken at the end of the warm-up, or at
        # construction) and enter this round's mean of anchors: a non-finite one is checked as the tensors are.
        unsynced = outer is not None and not outer.synced
        comm_dtype = config.comm_dtype[level_index] if config.comm_dtype else None
        held: list[Prescaled] = []

        def local_nonfinite() -> bool:
            # The check fused into the division of the tensors reduced in place (see prescale_checked_).
            prescaled = prescale_checked_(
                tensors, lg.size, bucket_cap_bytes=config.bucket_cap_bytes, comm_dtype=comm_dtype, node=lg.node
            )
            held.append(prescaled)
            return prescaled.nonfinite or (unsynced and has_nonfinite(outer.anchors))

        try:
            bad, divisor = agree_round(
                tensors, config=config, process_group=process_group, lg=lg, step=step, name=name,
                what=f"the parameters to average at step {step} (period {lg.level.period}, group size "
                f"{lg.level.group_size})",
                context={**outers.context(level_index), **(context or {})}, error=error, replica_group=replica_group,
                replica_ranks=replica_ranks, local_nonfinite=local_nonfinite, anchors_unsynced=unsynced,
            )  # fmt: skip
        except BaseException:
            if held:  # the round does not run: every tensor back as it was
                held[0].undo()
            raise
        prescaled = held[0] if held else None
        if bad and prescaled is not None:
            # A non-finite replica (the rare path): the finite replicas' sum is divided after the all-reduce instead.
            prescaled.undo()
        replaced = dist.get_rank() in bad
        payload = average_tensors_(
            tensors,
            lg.group,
            lg.size,
            bucket_cap_bytes=config.bucket_cap_bytes,
            pool=pool,
            divisor=divisor,
            comm_dtype=comm_dtype,
            node=lg.node,
            check_wire=config.nonfinite != "ignore",
            what=name,
            contribute_zeros=replaced,
            prescaled=prescaled,
        )
        if outer is not None:
            if not outer.synced:
                payload += sync_anchors(outer, lg, outers.part(tensors), pool, config, replaced, divisor)
            outer.step(outers.part(tensors))
            metrics.pseudo_grad_norm = outer.pseudo_grad_norm
    outers.reset_lower(level_index, tensors)
    metrics.rounds += 1
    metrics.payload_bytes += payload
    metrics.bytes_sent += bytes_sent(payload, lg)
    metrics.seconds += time.perf_counter() - start
    return replaced


def average_round_within_replica(
    tensors: Sequence[torch.Tensor],
    replica_group: dist.ProcessGroup,
    *,
    config: AveragingConfig,
    step: int,
    metrics: LevelMetrics,
    pool: BucketPool,
) -> None:
    """Average whole ``tensors`` over this rank's replica after a round, counted in that round's ``metrics``
    (see :meth:`hieravg_optim.HierarchicalAverager.average_within_replica`)."""
    start = time.perf_counter()
    what = f"the average within the replica after the round of period {metrics.period}, at step {step}"
    payload = average_within_replica(
        tensors, replica_group, step=step, what=what, bucket_cap_bytes=config.bucket_cap_bytes, pool=pool
    )
    n = config.ranks_per_replica
    metrics.payload_bytes += payload
    metrics.bytes_sent += 2 * (n - 1) * payload // n
    metrics.seconds += time.perf_counter() - start

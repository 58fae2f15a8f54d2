"""The compressed round of a level with ``compress``: the payload, the exchange, the outer step.

A compressed level keeps anchors (:class:`~hieravg_optim.anchors.OuterLevel`; without an outer optimizer of its
own, outer SGD with lr 1, :data:`~hieravg_optim.outer.PLAIN_OUTER`). Its round, on every rank of the group:

1. the agreement and the non-finite guard, as an uncompressed round (before anything is compressed);
2. :func:`compute_payload`: the pseudo-gradient ``delta = anchor - theta`` of this rank's local tensors, plus
   ``ef_decay`` times its error-feedback residual ``e``, as one flat fp32 ``v``, encoded by the level's codec;
   the residual becomes ``v - decode(payload)`` (SparseLoCo, https://arxiv.org/abs/2508.15706);
3. :func:`exchange`: an all-gather of the fixed-size payloads over the group (an int8 sum would overflow and
   top-k indices differ per rank, so nothing is summed on the wire);
4. :func:`apply_mean`: every rank decodes the gathered payloads in rank order into one fp32 sum, divides it by
   the number of replicas, and steps the anchors with that mean pseudo-gradient
   (:meth:`~hieravg_optim.anchors.OuterLevel.step_with`), which gives the tensors their new value. The same
   payloads decoded in the same order: the replicas are bitwise equal after the round.

Node-aware (``ranks_per_node``): the node first sums its ranks' deltas at full precision (reduce-scatter inside
the node, :func:`node_shard`); each rank compresses its shard of that sum (divided by the number of replicas), the
payloads cross nodes by an all-gather among the ranks of the same index, and an all-gather inside the node
(:func:`node_mean`) assembles the mean. One payload per node crosses the slow link; the residual is that of the
node's shard on each rank. At a level with ``fragments`` ``F > 1`` each fragment is such a round of its own, with
its own shard and residual (:func:`residual_shapes`): the synchronous round runs them one after the other.

These three steps are separate functions so that rounds of other shapes (delayed or fragmented rounds)
reuse them. See ``docs/compression.md``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .._compat import all_gather_single, reduce_scatter_single
from .._handover import hand_over
from ..anchors import OuterLevel, OuterLevels
from ..averaging import BucketPool, average_tensors_
from ..config import AveragingConfig
from ..faults import named_collective
from ..groups import LevelGroup, NodeGroups, timeout_seconds
from ..metrics import LevelMetrics, bytes_sent
from ..nonfinite import has_nonfinite
from ..outer import PLAIN_OUTER
from ..round_start import agree_round, sync_anchors
from ..tensors import local_tensor
from .codecs import Codec

__all__ = [
    "apply_mean", "compressed_round", "compute_payload", "decode_mean", "exchange", "new_residuals", "node_inner_bytes",
    "node_mean", "node_shard", "residual_error", "residual_shapes",
]


def _flat(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One fp32 copy of ``tensors``, flattened and concatenated, on ``device``."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])


def _split_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``targets`` (shapes and devices theirs), in place."""
    offset = 0
    for t in targets:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape))
        offset += n


def _pieces(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into new tensors shaped like ``like``, each on its device."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape).to(t.device, copy=True))
        offset += n
    return out


def compute_payload(
    codec: Codec, delta: torch.Tensor, residual: torch.Tensor | None, decay: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode ``v = decay * residual + delta`` (fp32, 1-D); return the payload and the new residual.

    Args:
        codec: The level's codec.
        delta: This rank's flat pseudo-gradient (or its node's shard of the node-aware sum).
        residual: The error-feedback residual, shaped like ``delta``; ``None``: zero (first round).
        decay: ``ef_decay``; ``0`` keeps no residual (returned as ``None``).

    Returns:
        ``(payload, v - decode(payload))``: the ``uint8`` payload, and the new residual (``None`` for ``decay`` 0).
        Local, no collective.
    """
    v = delta if residual is None or decay == 0 else delta.add(residual, alpha=decay)
    payload = codec.encode(v)
    if decay == 0:
        return payload, None
    sent = torch.zeros(codec.padded_numel(v.numel()), dtype=torch.float32, device=v.device)
    codec.decode_add_(payload, sent)
    return payload, v.sub_(sent[: v.numel()]) if v is not delta else v.sub(sent[: v.numel()])


def exchange(payload: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """All-gather the ``uint8`` ``payload`` of every rank of ``group``: ``[size, payload bytes]``, in rank order.

    .. warning::
        Collective over ``group``: every rank of it must call this with a payload of the same size.
    """
    gathered = torch.empty(size * payload.numel(), dtype=torch.uint8, device=payload.device)
    hand_over(payload, gathered)
    all_gather_single(gathered, payload, group)
    return gathered.view(size, payload.numel())


def decode_mean(
    codec: Codec, gathered: torch.Tensor, numel: int, divisor: float, skip: Sequence[int] = ()
) -> torch.Tensor:
    """The sum of the decoded ``gathered`` payloads (rank order, those at the group indexes ``skip`` left
    out), divided by ``divisor``: fp32, ``numel`` elements. The same bits on every rank given the same payloads.
    Local, no collective."""
    total = torch.zeros(codec.padded_numel(numel), dtype=torch.float32, device=gathered.device)
    for index in range(gathered.shape[0]):
        if index not in skip:
            codec.decode_add_(gathered[index], total)
    mean = total[:numel]
    return mean if divisor == 1 else mean.div_(divisor)


def apply_mean(outer: OuterLevel, mean: torch.Tensor, local: Sequence[torch.Tensor]) -> None:
    """One outer step of ``outer`` with the flat mean pseudo-gradient ``mean`` (over every anchored element, in
    order); the anchors' new value goes into ``local`` (this rank's local tensors). At a level with fragments the
    outer optimizer steps the anchors' pieces (:attr:`OuterLevel.params`, which cover the anchors in order), all of
    them here. Local, no collective."""
    assert outer.anchors is not None and outer.params is not None
    if outer.pieces is None:
        outer.step_with(_pieces(mean, outer.anchors), local)
        return
    outer.step_with(_pieces(mean, outer.params), [torch.empty_like(p) for p in outer.params])
    for a, t in zip(outer.anchors, local):
        t.copy_(a)


def residual_shapes(
    local: Sequence[torch.Tensor], node: NodeGroups | None, segments: Sequence[int] | None = None
) -> list[tuple[int, ...]]:
    """The shapes of a compressed level's residuals: those of the local tensors (flat), or, node-aware, one node
    shard per segment: ``(ceil(n / ranks on the node),)`` for each ``n`` of ``segments`` (the anchored elements of
    each fragment, :meth:`~hieravg_optim.anchors.OuterLevels.segments`; ``None``: one segment of all of ``local``).
    Pure."""
    if node is None:
        return [tuple(t.shape) for t in local]
    if segments is None:
        segments = [sum(t.numel() for t in local)]
    return [(-(-n // node.local_size),) for n in segments]


def new_residuals(outer: OuterLevel, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Zero fp32 residuals of ``shapes``, with the anchors (their device). Local."""
    assert outer.anchors is not None
    device = outer.anchors[0].device if outer.anchors else None
    return [torch.zeros(shape, dtype=torch.float32, device=device) for shape in shapes]


def residual_error(
    outer: OuterLevel, local: Sequence[torch.Tensor], lg: LevelGroup, segments: Sequence[int] | None = None
) -> BaseException | None:
    """The error of residuals (loaded from a checkpoint) whose shapes do not fit the round's
    (:func:`residual_shapes` of ``local``, ``lg.node`` and ``segments``), or ``None``. Local."""
    if outer.residuals is None:
        return None
    have = [tuple(r.shape) for r in outer.residuals]
    want = residual_shapes(local, lg.node, segments)
    if have == want:
        return None
    return RuntimeError(
        f"The error-feedback residuals of the compressed level of period {lg.level.period} have shapes {have}, "
        f"but its round needs {want}: the checkpoint was saved with another ranks_per_node, fragments or sharding. "
        "Resume with the settings that saved it."
    )


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors))


def compressed_round(
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
    name: str,
) -> bool:
    """A round of a compressed level whose anchors are taken: :func:`hieravg_optim.rounds.average_round` for it.

    Its arguments and return value are :func:`~hieravg_optim.rounds.average_round`'s, plus the round's
    ``name`` for errors. The tensors the anchors follow (all but the last ``outer_skip_last``, the buffers)
    travel compressed as the pseudo-gradient ``anchor - theta`` plus the residual; the others are averaged
    uncompressed in the same round. The level's first round after its anchors were taken averages them first
    (full precision, once), as an uncompressed outer level does. A subgroup of one rank communicates nothing: a plain compressed level keeps its tensors,
    one with an outer optimizer steps it with its own pseudo-gradient, uncompressed. Node-aware at a level with
    ``fragments`` ``F > 1``, the node-aware exchange runs once per fragment (its anchored elements, with its own
    residual shard, as the fragments' own rounds keep them), then one outer step with the whole mean.

    .. warning::
        Collective over this rank's subgroup at the level (and its replica, for the non-finite vote).

    Raises:
        RuntimeError: as :func:`~hieravg_optim.rounds.average_round`, on every rank of the group; also when the
            saved residuals do not fit this round (a checkpoint of another ``ranks_per_node`` or sharding).
    """
    outer = outers.by_level[level_index]
    assert outer is not None and outer.anchors is not None
    codec = config.level_compress(level_index)
    assert codec is not None
    decay = config.level_ef_decay(level_index)
    if error is None:
        error = outers.error(level_index, tensors, step, config.warmup_steps)
    local = outers.part(tensors)
    rest = [local_tensor(t) for t in tensors[len(tensors) - outers.skip_last :]] if outers.skip_last else []
    start = time.perf_counter()
    if lg.group is None:
        if error is not None:
            raise error
        if outer.factory is PLAIN_OUTER:
            outer.reset(local)  # the mean of one replica: the tensors as they are
        else:
            outer.step(local)
            metrics.pseudo_grad_norm = outer.pseudo_grad_norm
        outers.reset_lower(level_index, tensors)
        metrics.rounds += 1
        metrics.seconds += time.perf_counter() - start
        return False
    with torch.no_grad(), named_collective(name, lg.ranks, timeout_s=timeout_seconds(config, lg.group)):
        unsynced = not outer.synced
        segments = None
        if error is None and lg.node is not None:
            try:
                segments = outers.segments(outer, tensors)
            except ValueError as exc:  # more fragments than elements: the same on every rank of equal shapes
                error = exc
        if error is None:
            error = residual_error(outer, local, lg, segments)
        device = local[0].device if local else torch.device("cpu")
        residual = None if outer.residuals is None or decay == 0 or error else _flat(outer.residuals, device)
        # What is encoded, read by the non-finite check (an fp32 overflow of finite tensors is caught): flat, the
        # delta plus the residual; node-aware, the delta (the residual is the node's shard). After the first
        # average of the anchors (unsynced), it is this rank's anchors' delta, computed again after that average.
        delta = None if error is not None else _flat(outer.anchors, device).sub_(_flat(local, device))
        if delta is not None and residual is not None and lg.node is None:
            delta, residual = delta.add_(residual, alpha=decay), None
        bad, divisor = agree_round(
            tensors, config=config, process_group=process_group, lg=lg, step=step, name=name,
            what=f"the parameters to average at step {step} (period {lg.level.period}, group size "
            f"{lg.level.group_size})",
            context={"compress": codec.describe(), **outers.context(level_index), **(context or {})}, error=error,
            replica_group=replica_group, replica_ranks=replica_ranks, anchors_unsynced=unsynced,
            # before anything is compressed: a non-finite delta is a non-finite tensor (or anchor)
            local_nonfinite=lambda: has_nonfinite([*(local if delta is None else [delta]), *rest])
            or (unsynced and has_nonfinite(outer.anchors)),
        )  # fmt: skip
        replaced = dist.get_rank() in bad
        comm_dtype = config.comm_dtype[level_index] if config.comm_dtype else None
        payload = 0
        if rest:
            payload += average_tensors_(
                rest, lg.group, lg.size, bucket_cap_bytes=config.bucket_cap_bytes, pool=pool, divisor=divisor,
                comm_dtype=comm_dtype, node=lg.node, check_wire=config.nonfinite != "ignore", what=name,
                contribute_zeros=replaced,
            )  # fmt: skip
        sent = bytes_sent(payload, lg)
        if unsynced:
            synced = sync_anchors(outer, lg, local, pool, config, replaced, divisor)
            payload, sent = payload + synced, sent + bytes_sent(synced, lg)
        numel = sum(t.numel() for t in local)
        if unsynced:
            delta = _flat(outer.anchors, device).sub_(_flat(local, device))
            if residual is None and lg.node is None and outer.residuals is not None and decay != 0:
                delta.add_(_flat(outer.residuals, device), alpha=decay)
        if replaced:
            delta.zero_()  # non-finite: this rank's payload is left out (flat) or adds zeros (node-aware)
        skip = [lg.ranks.index(r) for r in bad]
        replicas = float(lg.size if divisor is None else divisor)
        if lg.node is None:
            mine, new_residual = compute_payload(codec, delta, residual, decay)
            gathered = exchange(mine, lg.group, lg.size)
            mean = decode_mean(codec, gathered, numel, replicas, skip)
            compressed = (lg.size - 1) * mine.numel()
            payload, sent = payload + mine.numel(), sent + compressed
            uncompressed = bytes_sent(4 * numel, lg)
        else:
            assert segments is not None
            mean, new_residual, mine_bytes, compressed, inner = _node_aware(
                codec, delta, residual, decay, lg.node, replicas, segments
            )
            payload, sent = payload + mine_bytes, sent + compressed + inner
            m, q = lg.node.local_size, lg.node.cross_size
            uncompressed = 2 * (q - 1) * 4 * numel // (q * m)  # what crosses nodes uncompressed
        # Flat, a skipped rank's payload was left out: its residual stays. Node-aware, the residual is the node's.
        if new_residual is not None and (lg.node is not None or not replaced):
            if outer.residuals is None:
                outer.residuals = new_residuals(outer, residual_shapes(local, lg.node, segments))
            _split_into(new_residual, outer.residuals)
        elif decay == 0:
            outer.residuals = None
        apply_mean(outer, mean, local)
        metrics.pseudo_grad_norm = outer.pseudo_grad_norm
    outers.reset_lower(level_index, tensors)
    metrics.rounds += 1
    metrics.payload_bytes += payload
    metrics.bytes_sent += sent
    metrics.compressed_bytes += compressed
    metrics.uncompressed_bytes += uncompressed
    metrics.residual_norm = None if outer.residuals is None else _norm(outer.residuals)
    metrics.seconds += time.perf_counter() - start
    return replaced


def node_shard(delta: torch.Tensor, node: NodeGroups, replicas: float) -> torch.Tensor:
    """This rank's shard of the node's sum of ``delta`` (fp32, 1-D, ``n`` elements on every rank of the node),
    divided by ``replicas``: ``ceil(n / m)`` elements (``m`` ranks on the node; the sum zero-padded to ``m`` equal
    shards). The sum over the nodes of the same-index shards is then the mean's shard.

    .. warning::
        Collective over ``node.local`` (a reduce-scatter): every rank of it must call this with ``n`` elements.
    """
    m = node.local_size
    numel = delta.numel()
    padded = -(-numel // m) * m
    full = torch.zeros(padded, dtype=torch.float32, device=delta.device)
    full[:numel] = delta
    shard = torch.empty(padded // m, dtype=torch.float32, device=delta.device)
    hand_over(full, shard)
    reduce_scatter_single(shard, full, node.local)
    return shard.div_(replicas)  # this node's share of the mean: the sum over nodes is the mean


def node_mean(mean_shard: torch.Tensor, node: NodeGroups, numel: int) -> torch.Tensor:
    """The flat mean of ``numel`` elements assembled from every rank's ``mean_shard`` (fp32, ``ceil(numel / m)``
    elements, :func:`node_shard`'s shard index) by an all-gather inside the node: new storage.

    .. warning::
        Collective over ``node.local``: every rank of it must call this with a shard of the same size.
    """
    mean_shard = mean_shard.contiguous()
    full = torch.empty(mean_shard.numel() * node.local_size, dtype=torch.float32, device=mean_shard.device)
    hand_over(mean_shard, full)
    all_gather_single(full, mean_shard, node.local)
    return full[:numel]


def node_inner_bytes(numel: int, node: NodeGroups) -> int:
    """Bytes one rank sends inside the node for a node-aware compressed round of ``numel`` elements: the fp32
    reduce-scatter and all-gather of ``ceil(numel / m) * m`` elements, as ring collectives do."""
    m = node.local_size
    return 2 * (m - 1) * 4 * (-(-numel // m) * m) // m


def _node_aware(
    codec: Codec,
    delta: torch.Tensor,
    residual: torch.Tensor | None,
    decay: float,
    node: NodeGroups,
    replicas: float,
    segments: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None, int, int, int]:
    """The node-aware exchange: full-precision sum inside the node, compressed shards across nodes; one exchange
    per segment of ``delta`` (``segments``: its fragments' elements, in order; one segment without fragments),
    each with its own shard of ``residual`` (the concatenation of the segments' shards, or ``None``).

    Returns:
        ``(mean, new residual of this rank's shards (concatenated), payload bytes, compressed bytes sent across
        nodes, bytes sent inside the node)``.
    """
    means, residuals, mine_bytes, cross, inner = [], [], 0, 0, 0
    offset = shard_offset = 0
    for numel in segments:
        if numel == 0:  # a fragment of buffers only: nothing to exchange (the same on every rank)
            continue
        shard = node_shard(delta[offset : offset + numel], node, replicas)
        own = None if residual is None else residual[shard_offset : shard_offset + shard.numel()]
        mine, new_residual = compute_payload(codec, shard, own, decay)
        if node.cross is None:
            mean_shard = decode_mean(codec, mine.view(1, -1), shard.numel(), 1.0)
        else:
            gathered = exchange(mine, node.cross, node.cross_size)
            mean_shard = decode_mean(codec, gathered, shard.numel(), 1.0)
            cross += (node.cross_size - 1) * mine.numel()
        means.append(node_mean(mean_shard, node, numel))
        residuals.append(new_residual)
        mine_bytes += mine.numel()
        inner += node_inner_bytes(numel, node)
        offset, shard_offset = offset + numel, shard_offset + shard.numel()
    mean = torch.cat(means) if means else delta.new_zeros(0)
    new_residual = None if decay == 0 or not residuals else torch.cat(residuals)
    return mean, new_residual, mine_bytes, cross, inner

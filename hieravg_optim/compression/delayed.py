"""Compressed rounds that are delayed (``delay_steps``) or fragmented (``fragments``) at the same level.

A level with ``compress`` and ``delay_steps`` ``tau`` (or ``fragments`` ``F``) starts its round at count ``t`` as
:meth:`hieravg_optim.delayed.DelayedRounds.start` starts any delayed round (the agreement, the non-finite vote
and policy, the first average of the anchors, the snapshot ``theta_t`` for the eager correction), then, instead
of all-reducing copies of the tensors, on every rank of the group:

1. :func:`encode_round`: the pseudo-gradient ``delta = anchor - theta_t`` of the round's tensors (a fragment's
   tensors only, with ``fragments``), plus ``ef_decay`` times their error-feedback residual, encoded by the level's
   codec (:func:`hieravg_optim.compression.round.compute_payload`); the residual is updated at ``t``. The payloads
   are all-gathered over the level's background group by one asynchronous gloo collective while the next ``tau``
   inner steps run. Buffers (the last ``outer_skip_last`` tensors, which have no anchors) are averaged at
   ``t``, synchronously and uncompressed (in ``comm_dtype`` if set), as the synchronous compressed round does.
2. At ``t + tau``, :meth:`CompressedPayloads.result`: the collective is waited for, the payloads are decoded in
   rank order (:func:`~hieravg_optim.compression.round.decode_mean`: the same bits on every rank), and the anchors
   of the round's tensors take one outer step with that mean (outer SGD with lr 1 when the level has no outer
   optimizer of its own: ``anchor - mean``). That result ``R`` then goes through the level's
   ``delay_correction`` and ``delay_mixing`` exactly as an uncompressed delayed round's
   (:meth:`hieravg_optim.delayed.DelayedRounds.apply`).

The work on one fragment only ever sees "the list of the fragment's tensors" (its positions' local tensors,
anchors and residuals), so it does not depend on how the level's tensors are split into fragments.

Node-aware (``ranks_per_node``, the level's groups spanning nodes with several ranks on each), as the synchronous
node-aware round (:mod:`hieravg_optim.compression.round`): at ``t`` the delta (without the residual, which belongs
to the shard) is summed inside the node at full precision by a synchronous reduce-scatter over the level's node
group (:func:`~hieravg_optim.compression.round.node_shard`), each rank encodes its shard of that sum divided by the
number of replicas plus ``ef_decay`` times its residual of that shard (one residual shard per fragment), and only
the all-gather of those payloads across nodes (among the ranks of the same index) runs asynchronously, over the
background group's cross-node group. At ``t + tau`` each rank decodes its shard's payloads in node order and a
synchronous all-gather inside the node (:func:`~hieravg_optim.compression.round.node_mean`) assembles the mean.
The synchronous collectives inside the node run on the level's main node group, which no asynchronous collective
uses. See ``docs/compression.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import all_gather_single
from .._handover import hand_over
from ..anchors import OuterLevel
from ..averaging import BucketPool, average_tensors_
from ..config import AveragingConfig
from ..faults import named_collective
from ..groups import LevelGroup, NodeGroups, timeout_seconds
from ..metrics import LevelMetrics, bytes_sent
from .codecs import Codec
from .round import (
    _flat, _norm, _pieces, _split_into, compute_payload, decode_mean, new_residuals, node_inner_bytes, node_mean,
    node_shard, residual_shapes,
)

__all__ = ["CompressedPayloads", "encode_round", "encoded_delta", "load_payloads"]


def encoded_delta(
    local: Sequence[torch.Tensor], params_of: Sequence[int | None], outer: OuterLevel, decay: float
) -> torch.Tensor:
    """What this rank encodes for the anchored among ``local`` (``params_of`` as :func:`encode_round`'s): the flat
    fp32 ``v = (anchor - theta) + decay * residual``. Non-finite exactly where a tensor, anchor or residual is, or
    where the difference overflows fp32 (finite tensors of opposite signs near the fp32 limit), so the non-finite
    check of the round reads ``v`` instead of the tensors. Local, new storage."""
    assert outer.params is not None
    anchored = [k for k, i in enumerate(params_of) if i is not None]
    mine = [local[k] for k in anchored]
    device = mine[0].device if mine else torch.device("cpu")
    v = _flat([outer.params[params_of[k]] for k in anchored], device).sub_(_flat(mine, device))
    if outer.residuals is not None and decay != 0:
        v.add_(_flat([outer.at_params(outer.residuals)[params_of[k]] for k in anchored], device), alpha=decay)
    return v


@dataclass(eq=False)
class CompressedPayloads:
    """The compressed part of one round in flight (:attr:`hieravg_optim.delayed.InFlightRound.compressed`)."""

    codec: Codec
    gathered: torch.Tensor
    """``[group size, payload bytes]`` ``uint8``: every rank's payload in rank order (filled once waited for);
    node-aware, ``[nodes, payload bytes]``: the payloads of this rank's shard, one per node, in node order."""
    anchored: tuple[int, ...]
    """The places, in the round's tensors, of those that travel compressed (the others are buffers)."""
    numel: int
    """Elements of those tensors, flattened and concatenated."""
    skip: tuple[int, ...]
    """Group indexes of the non-finite replicas, whose payloads are left out (``nonfinite="skip_replica"``)."""
    replicas: float
    """What the decoded sum is divided by: the number of finite replicas."""
    sent: int = 0
    """Compressed bytes this rank sent ((group size - 1) payloads; node-aware, (nodes - 1) shard payloads)."""
    shard: int | None = None
    """Node-aware: the elements of this rank's shard of the node sum (``ceil(numel / ranks on the node)``), which
    :attr:`gathered` holds the payloads of; ``None``: a flat round."""
    inner: int = 0
    """Node-aware: bytes this rank sends inside the node (the reduce-scatter at the start, the all-gather at the
    apply, fp32)."""

    def nbytes(self) -> int:
        """Bytes held on this rank: the gathered payloads."""
        return self.gathered.numel()

    def result(
        self,
        params_of: Sequence[int | None],
        outer: OuterLevel,
        live: Sequence[torch.Tensor],
        metrics: LevelMetrics,
        *,
        node: NodeGroups | None = None,
        name: str = "the compressed round",
        ranks: Sequence[int] = (),
        timeout_s: float | None = None,
    ) -> list[torch.Tensor]:
        """``R`` of the anchored tensors, once the all-gather has completed: the payloads decoded in rank order,
        their mean stepping the outer optimizer's tensors at ``params_of[k]`` (:attr:`OuterLevel.params`, the
        anchors or their pieces) once. Returns new tensors shaped and typed like ``live[k]`` for each ``k`` of
        :attr:`anchored`. Local for a flat round. Node-aware (:attr:`shard`), the payloads of this rank's shard are
        decoded in node order and the mean is assembled by an all-gather over ``node.local``, named as the round
        (``name``, ``ranks``, ``timeout_s``) if it fails.

        .. warning::
            Node-aware, collective over ``node.local`` (the level's main node group): every rank of the node calls
            this for the same round.

        Raises:
            CollectiveError: node-aware, for a dead or hung peer on the node, naming the round.
        """
        assert outer.params is not None
        if self.shard is None:
            mean = decode_mean(self.codec, self.gathered, self.numel, self.replicas, self.skip)
        else:
            assert node is not None, "a node-aware round in flight at a level that is not node-aware"
            mean_shard = decode_mean(self.codec, self.gathered, self.shard, 1.0)  # divided before it was encoded
            if self.numel:
                with named_collective(name, ranks, timeout_s=timeout_s):
                    mean = node_mean(mean_shard, node, self.numel)
            else:
                mean = mean_shard
        indices = [params_of[k] for k in self.anchored]
        out = [torch.empty_like(live[k]) for k in self.anchored]
        outer.step_with(_pieces(mean, [outer.params[i] for i in indices]), out, indices)
        metrics.pseudo_grad_norm = outer.pseudo_grad_norm
        metrics.payload_bytes += self.gathered.shape[1]
        metrics.bytes_sent += self.sent + self.inner
        metrics.compressed_bytes += self.sent
        metrics.residual_norm = None if outer.residuals is None else _norm(outer.residuals)
        return out

    def state(self) -> dict[str, Any]:
        """The saved form (in a round's ``"compressed"`` entry of the averaging state dict); node-aware, with
        ``"shard"`` (:attr:`shard`) and ``"inner"``."""
        out = {"gathered": self.gathered, "anchored": list(self.anchored), "numel": self.numel,
               "skip": list(self.skip), "replicas": self.replicas, "sent": self.sent}  # fmt: skip
        if self.shard is not None:
            out.update(shard=self.shard, inner=self.inner)
        return out


@torch.no_grad()
def encode_round(
    local: Sequence[torch.Tensor],
    params_of: Sequence[int | None],
    *,
    outer: OuterLevel,
    codec: Codec,
    config: AveragingConfig,
    level_index: int,
    lg: LevelGroup,
    background: LevelGroup,
    pool: BucketPool,
    divisor: int | None,
    bad: Sequence[int],
    replaced: bool,
    metrics: LevelMetrics,
    what: str,
    encoded: torch.Tensor | None = None,
    segments: Sequence[int] | None = None,
    segment: int = 0,
) -> tuple[list[torch.Tensor], CompressedPayloads, list, int]:
    """Encode this rank's payload of the round over ``local`` (the round's local tensors or pieces of them; ``k``
    with anchors where ``params_of[k]`` is the index of its anchor, or anchor piece, in :attr:`OuterLevel.params`;
    ``None`` for a buffer; ``encoded``: their :func:`encoded_delta` if already computed, written here), update
    its residuals (the same pieces of them), and start the all-gather of the payloads over ``background`` (the
    level's background groups, asynchronous). The buffers among ``local`` are averaged now, synchronously over
    ``lg``. Nothing live is written.

    Node-aware (``lg.node``): ``encoded`` is the delta without the residual (:func:`encoded_delta` with ``decay``
    0); it is summed inside the node now, synchronously (a reduce-scatter over ``lg.node.local``), this rank encodes
    its shard of the sum divided by the replicas plus ``ef_decay`` times the residual shard ``segment`` (the
    fragment's index, 0 without fragments; ``segments``: every fragment's anchored elements,
    :meth:`~hieravg_optim.anchors.OuterLevels.segments`, which give the residual shards' shapes), and the payloads
    are all-gathered across nodes over ``background.node.cross``.

    Returns:
        ``(wire, payloads, works, payload)``: per tensor of ``local``, the averaged copy of a buffer or a stand-in
        of the anchored tensor's shape and dtype (no storage of its size); the compressed part of the round; the
        asynchronous work to wait for; the bytes this rank all-reduced uncompressed (the buffers).

    .. warning::
        Collective over ``lg`` (the buffers, when there are any; node-aware, its node group) and ``background``
        (the all-gather, started here).
    """
    assert outer.anchors is not None and outer.params is not None and lg.group is not None
    anchored = [k for k, i in enumerate(params_of) if i is not None]
    decay = config.level_ef_decay(level_index)
    node = lg.node
    v = encoded_delta(local, params_of, outer, 0.0 if node else decay) if encoded is None else encoded
    if replaced:
        v.zero_()  # non-finite: this rank's payload is left out (flat) or adds zeros to the node's sum
    numel = v.numel()
    replicas = float(lg.size if divisor is None else divisor)
    timeout_s = timeout_seconds(config, lg.group)
    shard = None
    if node is None:
        payload, new_residual = compute_payload(codec, v, None, decay)
    else:
        assert segments is not None and segments[segment] == numel, (segments, segment, numel)
        residual = None if outer.residuals is None or decay == 0 else outer.residuals[segment]
        if numel:
            with named_collective(what, lg.ranks, timeout_s=timeout_s):
                shard = node_shard(v, node, replicas)
        else:  # a fragment of buffers only: nothing to exchange (the same on every rank)
            shard = v.new_zeros(0)
        payload, new_residual = compute_payload(codec, shard, residual, decay)
    if new_residual is not None and (node is not None or not replaced):  # flat: a skipped replica's stays
        if node is None:
            if outer.residuals is None:
                outer.residuals = new_residuals(outer, [tuple(a.shape) for a in outer.anchors])
            _split_into(new_residual, [outer.at_params(outer.residuals)[params_of[k]] for k in anchored])
        else:
            if outer.residuals is None:
                outer.residuals = new_residuals(outer, residual_shapes(local, node, segments))
            outer.residuals[segment].copy_(new_residual)
    elif decay == 0:
        outer.residuals = None
    rows = lg.size if node is None else node.cross_size
    gathered = torch.empty(rows * payload.numel(), dtype=torch.uint8, device=payload.device)
    works = []
    if node is None or numel:
        hand_over(payload, gathered)
        group = background.group if node is None else background.node.cross
        works.append(all_gather_single(gathered, payload, group, async_op=True))
    rest = [k for k in range(len(local)) if k not in set(anchored)]
    wire = [torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape) for t in local]
    uncompressed = 0
    if rest:
        copies = [local[k].clone() for k in rest]
        comm_dtype = config.comm_dtype[level_index] if config.comm_dtype else None
        # The buffers' synchronous average: a dead or hung peer here is named as the round's (what) is.
        with named_collective(what, lg.ranks, timeout_s=timeout_s):
            uncompressed = average_tensors_(
                copies, lg.group, lg.size, bucket_cap_bytes=config.bucket_cap_bytes, pool=pool, divisor=divisor,
                comm_dtype=comm_dtype, node=node, check_wire=config.nonfinite != "ignore", what=what,
                contribute_zeros=replaced,
            )  # fmt: skip
        for k, c in zip(rest, copies):
            wire[k] = c
    if node is None:
        metrics.uncompressed_bytes += bytes_sent(4 * numel, lg)
        payloads = CompressedPayloads(
            codec=codec, gathered=gathered.view(lg.size, payload.numel()), anchored=tuple(anchored), numel=numel,
            skip=tuple(lg.ranks.index(r) for r in bad), replicas=replicas, sent=(lg.size - 1) * payload.numel(),
        )  # fmt: skip
    else:
        m, q = node.local_size, node.cross_size
        metrics.uncompressed_bytes += 2 * (q - 1) * 4 * numel // (q * m)  # what crosses nodes uncompressed
        payloads = CompressedPayloads(
            codec=codec, gathered=gathered.view(q, payload.numel()), anchored=tuple(anchored), numel=numel, skip=(),
            replicas=replicas, sent=(q - 1) * payload.numel(), shard=shard.numel(),
            inner=node_inner_bytes(numel, node) if numel else 0,
        )  # fmt: skip
    return wire, payloads, works, uncompressed


def load_payloads(
    entry: Mapping[str, Any], codec: Codec | None, lg: LevelGroup, where: str, device: torch.device
) -> CompressedPayloads | None:
    """The :class:`CompressedPayloads` of a saved round in flight (``entry``, whose ``"compressed"`` entry is
    :meth:`CompressedPayloads.state`), checked against this level's codec (``None``: uncompressed) and group; the
    payloads go to ``device``. ``None`` for an uncompressed round at an uncompressed level. Local.

    Raises:
        ValueError: naming the round (``where``), for a malformed entry, a compressed round at a level without
            ``compress`` here or the reverse, a node-aware round (``"shard"``) at a level that is not node-aware here
            or the reverse, a shard of another size than this level's nodes give (another ``ranks_per_node``), or
            payloads of another size than this level's codec and group give.
    """
    if "compressed" not in entry:
        if codec is None:
            return None
        raise ValueError(
            f"{where} was saved by an uncompressed level, but this averager compresses it ({codec.describe()}): "
            "resume with the saved run's compress setting."
        )
    saved = entry["compressed"]
    if codec is None:
        raise ValueError(
            f"{where} was saved by a compressed level, but this averager does not compress that level: resume with "
            "the saved run's compress setting."
        )
    keys = {"gathered", "anchored", "numel", "skip", "replicas"}
    if not isinstance(saved, Mapping) or not keys <= set(saved):
        raise ValueError(f"{where}: its 'compressed' entry must be a mapping with the keys {sorted(keys)}.")
    gathered, numel, shard = saved["gathered"], saved["numel"], saved.get("shard")
    node = lg.node
    if (shard is None) != (node is None):
        saved_as = "a level that is not node-aware" if shard is None else "a node-aware level (one payload per node)"
        here = "is not node-aware" if node is None else "is node-aware"
        raise ValueError(
            f"{where} was saved by {saved_as}, but this level {here} (ranks_per_node): the payloads cannot be "
            "decoded here. Resume with the saved run's ranks_per_node, or from a checkpoint saved without a round in "
            "flight (after apply_rounds_in_flight)."
        )
    if not isinstance(numel, int) or (shard is not None and not isinstance(shard, int)):
        raise ValueError(f"{where}: its 'numel' and 'shard' in 'compressed' must be integers, as state_dict() saves.")
    if node is not None and shard != -(-numel // node.local_size):
        raise ValueError(
            f"{where} holds the payloads of node shards of {shard} elements, but this level's {node.local_size} ranks "
            f"per node give shards of {-(-numel // node.local_size)} of its {numel} elements: the checkpoint was saved "
            "with another ranks_per_node. Resume with the saved run's ranks_per_node, or from a checkpoint saved "
            "without a round in flight (after apply_rounds_in_flight)."
        )
    if node is None:
        expected, what = (lg.size, codec.payload_nbytes(numel)), f"group of {lg.size} ranks"
    else:
        expected, what = (node.cross_size, codec.payload_nbytes(shard)), f"{node.cross_size} nodes"
    if not torch.is_tensor(gathered) or gathered.dtype != torch.uint8 or tuple(gathered.shape) != expected:
        shape = tuple(gathered.shape) if torch.is_tensor(gathered) else type(gathered).__name__
        raise ValueError(
            f"{where}: its gathered payloads are {shape}, but this level's codec ({codec.describe()}) and {what} give "
            f"uint8 {expected}: resume with the saved run's compress and group sizes."
        )
    return CompressedPayloads(
        codec=codec, gathered=gathered.to(device), anchored=tuple(int(k) for k in saved["anchored"]), numel=numel,
        skip=tuple(int(k) for k in saved["skip"]), replicas=float(saved["replicas"]), sent=int(saved.get("sent", 0)),
        shard=shard, inner=int(saved.get("inner", 0)),
    )  # fmt: skip

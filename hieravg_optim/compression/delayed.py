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

Not supported (a ``NotImplementedError`` from :func:`hieravg_optim.delay_settings.check_delay_settings`):
node-aware levels (``ranks_per_node``), whose residuals are one flat shard of the whole level. See
``docs/compression.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._compat import all_gather_single
from .._handover import hand_over
from ..anchors import OuterLevel
from ..averaging import BucketPool, average_tensors_
from ..config import AveragingConfig
from ..faults import named_collective
from ..groups import LevelGroup, timeout_seconds
from ..metrics import LevelMetrics, bytes_sent
from .codecs import Codec
from .round import _flat, _norm, _pieces, _split_into, compute_payload, decode_mean

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
    """``[group size, payload bytes]`` ``uint8``: every rank's payload in rank order (filled once waited for)."""
    anchored: tuple[int, ...]
    """The places, in the round's tensors, of those that travel compressed (the others are buffers)."""
    numel: int
    """Elements of those tensors, flattened and concatenated."""
    skip: tuple[int, ...]
    """Group indexes of the non-finite replicas, whose payloads are left out (``nonfinite="skip_replica"``)."""
    replicas: float
    """What the decoded sum is divided by: the number of finite replicas."""
    sent: int = 0
    """Compressed bytes this rank sent ((group size - 1) payloads)."""

    def nbytes(self) -> int:
        """Bytes held on this rank: the gathered payloads."""
        return self.gathered.numel()

    def result(
        self, params_of: Sequence[int | None], outer: OuterLevel, live: Sequence[torch.Tensor], metrics: LevelMetrics
    ) -> list[torch.Tensor]:
        """``R`` of the anchored tensors, once the all-gather has completed: the payloads decoded in rank order,
        their mean stepping the outer optimizer's tensors at ``params_of[k]`` (:attr:`OuterLevel.params`, the
        anchors or their pieces) once. Returns new tensors shaped and typed like ``live[k]`` for each ``k`` of
        :attr:`anchored`. Local.
        """
        assert outer.params is not None
        mean = decode_mean(self.codec, self.gathered, self.numel, self.replicas, self.skip)
        indices = [params_of[k] for k in self.anchored]
        out = [torch.empty_like(live[k]) for k in self.anchored]
        outer.step_with(_pieces(mean, [outer.params[i] for i in indices]), out, indices)
        metrics.pseudo_grad_norm = outer.pseudo_grad_norm
        metrics.payload_bytes += self.gathered.shape[1]
        metrics.bytes_sent += self.sent
        metrics.compressed_bytes += self.sent
        metrics.residual_norm = None if outer.residuals is None else _norm(outer.residuals)
        return out

    def state(self) -> dict[str, Any]:
        """The saved form (in a round's ``"compressed"`` entry of the averaging state dict)."""
        return {"gathered": self.gathered, "anchored": list(self.anchored), "numel": self.numel,
                "skip": list(self.skip), "replicas": self.replicas, "sent": self.sent}  # fmt: skip


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
    background: dist.ProcessGroup,
    pool: BucketPool,
    divisor: int | None,
    bad: Sequence[int],
    replaced: bool,
    metrics: LevelMetrics,
    what: str,
    encoded: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], CompressedPayloads, list, int]:
    """Encode this rank's payload of the round over ``local`` (the round's local tensors or pieces of them; ``k``
    with anchors where ``params_of[k]`` is the index of its anchor, or anchor piece, in :attr:`OuterLevel.params`;
    ``None`` for a buffer; ``encoded``: their :func:`encoded_delta` if already computed, written here), update
    its residuals (the same pieces of them), and start the
    all-gather of the payloads over ``background`` (asynchronous). The buffers among ``local`` are averaged now,
    synchronously over ``lg``. Nothing live is written.

    Returns:
        ``(wire, payloads, works, payload)``: per tensor of ``local``, the averaged copy of a buffer or a stand-in
        of the anchored tensor's shape and dtype (no storage of its size); the compressed part of the round; the
        asynchronous work to wait for; the bytes this rank all-reduced uncompressed (the buffers).

    .. warning::
        Collective over ``lg`` (the buffers, when there are any) and ``background`` (the all-gather, started here).
    """
    assert outer.anchors is not None and outer.params is not None and lg.group is not None
    anchored = [k for k, i in enumerate(params_of) if i is not None]
    decay = config.level_ef_decay(level_index)
    v = encoded_delta(local, params_of, outer, decay) if encoded is None else encoded
    if replaced:
        v.zero_()  # non-finite: this rank's payload is left out
    payload, new_residual = compute_payload(codec, v, None, decay)
    if new_residual is not None and not replaced:  # a skipped replica's residual stays as it was
        if outer.residuals is None:
            outer.residuals = [torch.zeros(a.shape, dtype=torch.float32, device=a.device) for a in outer.anchors]
        _split_into(new_residual, [outer.at_params(outer.residuals)[params_of[k]] for k in anchored])
    elif decay == 0:
        outer.residuals = None
    gathered = torch.empty(lg.size * payload.numel(), dtype=torch.uint8, device=payload.device)
    hand_over(payload, gathered)
    works = [all_gather_single(gathered, payload, background, async_op=True)]
    rest = [k for k in range(len(local)) if k not in set(anchored)]
    wire = [torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape) for t in local]
    uncompressed = 0
    if rest:
        copies = [local[k].clone() for k in rest]
        comm_dtype = config.comm_dtype[level_index] if config.comm_dtype else None
        # The buffers' synchronous average: a dead or hung peer here is named as the round's (what) is.
        with named_collective(what, lg.ranks, timeout_s=timeout_seconds(config, lg.group)):
            uncompressed = average_tensors_(
                copies, lg.group, lg.size, bucket_cap_bytes=config.bucket_cap_bytes, pool=pool, divisor=divisor,
                comm_dtype=comm_dtype, check_wire=config.nonfinite != "ignore", what=what, contribute_zeros=replaced,
            )  # fmt: skip
        for k, c in zip(rest, copies):
            wire[k] = c
    numel = v.numel()
    metrics.uncompressed_bytes += bytes_sent(4 * numel, lg)
    payloads = CompressedPayloads(
        codec=codec, gathered=gathered.view(lg.size, payload.numel()), anchored=tuple(anchored), numel=numel,
        skip=tuple(lg.ranks.index(r) for r in bad), replicas=float(lg.size if divisor is None else divisor),
        sent=(lg.size - 1) * payload.numel(),
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
            ``compress`` here or the reverse, or payloads of another size than this level's codec and group give.
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
    gathered, numel = saved["gathered"], saved["numel"]
    expected = (lg.size, codec.payload_nbytes(numel)) if isinstance(numel, int) else None
    if not torch.is_tensor(gathered) or gathered.dtype != torch.uint8 or tuple(gathered.shape) != expected:
        shape = tuple(gathered.shape) if torch.is_tensor(gathered) else type(gathered).__name__
        raise ValueError(
            f"{where}: its gathered payloads are {shape}, but this level's codec ({codec.describe()}) and group of "
            f"{lg.size} ranks give uint8 {expected}: resume with the saved run's compress and group sizes."
        )
    return CompressedPayloads(
        codec=codec, gathered=gathered.to(device), anchored=tuple(int(k) for k in saved["anchored"]), numel=numel,
        skip=tuple(int(k) for k in saved["skip"]), replicas=float(saved["replicas"]), sent=int(saved.get("sent", 0)),
    )  # fmt: skip

"""What each level has done on this rank: rounds, bytes, seconds, outer state; and the periodic log."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from .groups import LevelGroup

__all__ = ["LevelMetrics", "MetricsMixin", "bytes_sent", "logger"]

logger = logging.getLogger(__package__ + ".optimizer")
"""The metrics of ``log_metrics_every`` go to the ``hieravg_optim.optimizer`` logger, the name documented for it."""


@dataclass(slots=True)
class LevelMetrics:
    """What one level of the hierarchy has done on this rank since construction."""

    period: int
    """The level's period, in steps."""
    group_size: int
    """The level's group size, in ranks."""
    subgroup_size: int
    """Ranks this rank averages with at this level (replicas holding the same shard)."""
    rounds: int = 0
    """Averaging rounds run, as the schedule gives them: a level whose subgroup is this rank alone
    (``subgroup_size`` 1, a single replica) counts its rounds too, with no communication
    (``payload_bytes`` and ``bytes_sent`` stay 0; an outer optimizer still steps)."""
    payload_bytes: int = 0
    """Bytes this rank all-reduced, in the level's wire dtypes (``comm_dtype``), summed over rounds."""
    bytes_sent: int = 0
    """Bytes this rank sent, estimated as ring collectives do: ``2 (n - 1) / n`` times the payload for a flat
    all-reduce; node-aware, ``2 (m - 1) / m`` of it inside the node plus ``2 (q - 1) / (q m)`` across nodes
    (``m`` ranks per node, ``q`` nodes)."""
    seconds: float = 0.0
    """Wall-clock seconds spent averaging, agreement check included (and the outer step, if any)."""
    outer_bytes: int = 0
    """Bytes this rank holds for the level's outer optimizer: its fp32 anchors plus the outer optimizer's
    state (0 without an outer optimizer, or before the anchors are taken)."""
    rounds_started: int = 0
    """Delayed and fragment rounds started (``delay_steps``, ``fragments``); 0 at a level without them."""
    rounds_applied: int = 0
    """Delayed and fragment rounds applied (each also counts in ``rounds``); one less than ``rounds_started`` while
    one is in flight."""
    bytes_in_flight: int = 0
    """Bytes this rank holds now for the level's round in flight: its copies of the round's tensors (the
    all-reduced copy, plus the snapshot with the ``"eager"`` correction); 0 when none is in flight."""
    pseudo_grad_norm: float | None = None
    """L2 norm of this rank's pseudo-gradient (``anchor - mean``, over its shards) at the level's last round;
    ``None`` before the first round after the anchors were taken, or without an outer optimizer."""
    compressed_bytes: int = 0
    """Bytes this rank sent as compressed payloads (``compress``), summed over rounds: ``(n - 1)`` times its
    payload for the all-gather over ``n`` ranks; node-aware, the all-gather across the ``q`` nodes only,
    ``(q - 1)`` times the payload of its shard. 0 at an uncompressed level. Included in :attr:`bytes_sent`."""
    uncompressed_bytes: int = 0
    """Bytes the same compressed rounds would have sent for the pseudo-gradient uncompressed (an fp32
    all-reduce over the level, estimated as :attr:`bytes_sent` is; node-aware, across nodes only): the
    reference of :attr:`compression_ratio`."""
    compression_ratio: float | None = None
    """:attr:`compressed_bytes` / :attr:`uncompressed_bytes` (``None`` before a compressed round)."""
    residual_norm: float | None = None
    """L2 norm of this rank's error-feedback residuals after the level's last compressed round (``None``
    before one, or without error feedback, ``ef_decay=0``)."""


def bytes_sent(payload: int, lg: LevelGroup) -> int:
    """Bytes one rank sends to all-reduce ``payload`` bytes at level ``lg``, as ring collectives do."""
    if lg.node is None:
        return 2 * (lg.size - 1) * payload // lg.size
    m, q = lg.node.local_size, lg.node.cross_size
    return 2 * (m - 1) * payload // m + 2 * (q - 1) * payload // (q * m)


class MetricsMixin:
    """:class:`~hieravg_optim.HierarchicalAverager`'s metrics and their periodic log (a base class of it).

    Reads the averager's ``_metrics`` (one :class:`LevelMetrics` per level), ``_outers``, ``step`` and
    ``log_metrics_every``.
    """

    _metrics: list[LevelMetrics]
    _outers: Any
    step: int
    log_metrics_every: int | None

    def metrics(self) -> dict[int, dict[str, Any]]:
        """What each level has done on this rank since construction; local, no collective.

        Returns:
            A new dict per call, keyed by period (steps), in level order; each value is
            :class:`LevelMetrics` as a plain dict of ints, floats and ``None``: ``period``,
            ``group_size``, ``subgroup_size``, ``rounds``, ``payload_bytes``, ``bytes_sent``
            (bytes), ``seconds``, ``outer_bytes`` (bytes of fp32 anchors plus outer optimizer state
            held now), ``rounds_started``, ``rounds_applied`` and ``bytes_in_flight`` (delayed and fragment rounds),
            ``pseudo_grad_norm`` (at the level's last round, or ``None``), and for compressed levels
            ``compressed_bytes``, ``uncompressed_bytes``, ``compression_ratio`` and ``residual_norm``. Example
            for ``{4: 2, 8: 4}`` after 16 steps on 4 ranks
            of float32 parameters of 1,000 elements: ``{4: {"rounds": 2, "payload_bytes": 8000,
            "bytes_sent": 8000, ...}, 8: {"rounds": 2, "payload_bytes": 8000, "bytes_sent": 12000, ...}}``.
        """
        delayed = getattr(self, "_delayed", None)
        for i, (m, outer) in enumerate(zip(self._metrics, self._outers.by_level)):
            m.outer_bytes = 0 if outer is None else outer.nbytes()
            m.bytes_in_flight = 0 if delayed is None else delayed.held_bytes(i)
            m.compression_ratio = m.compressed_bytes / m.uncompressed_bytes if m.uncompressed_bytes else None
        return {m.period: asdict(m) for m in self._metrics}

    def _log_metrics_if_due(self) -> None:
        """Log :meth:`metrics` at INFO at step counts that are multiples of ``log_metrics_every``."""
        if self.log_metrics_every and self.step % self.log_metrics_every == 0:
            logger.info("hierarchical averaging at step %d: %s", self.step, self.metrics())

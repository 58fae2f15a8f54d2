"""The metrics API: per level rounds, bytes and seconds, readable as a dict, logged every N steps.

One spawn of 4 gloo ranks runs every scenario. Expected values are computed by hand from the model (bytes) and from
:func:`hieravg_optim.schedule.rounds_per_level` (rounds).
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

from hieravg_optim import optimizer as optimizer_module
from hieravg_optim.config import AveragingConfig
from hieravg_optim.optimizer import HierarchicalAverager, HierarchicalAveragingOptimizer
from hieravg_optim.schedule import AveragingLevel, rounds_per_level

from .harness import default_timeout, run_distributed

pytestmark = pytest.mark.timeout(default_timeout(120))  # scaled like the harness's deadline

WORLD_SIZE = 4
BAD_LOG_EVERY = (0, -2, 2.5, True, "10")
METRIC_KEYS = {
    "period",
    "group_size",
    "subgroup_size",
    "rounds",
    "payload_bytes",
    "bytes_sent",
    "seconds",
    "outer_bytes",
    "rounds_started",
    "rounds_applied",
    "bytes_in_flight",
    "pseudo_grad_norm",
    "compressed_bytes",
    "uncompressed_bytes",
    "compression_ratio",
    "residual_norm",
}


class _Records(logging.Handler):
    """Collects the records of one logger (pytest's caplog does not reach spawned ranks)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _model() -> tuple[torch.nn.Module, int]:
    """A model with float32, float16 and float64 tensors, and its payload per round in bytes.

    With the default ``comm_dtype``, float16 travels as float32 (4 bytes per element), float32 in 4,
    float64 in 8.
    """
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(10, 5)  # 50 + 5 float32 elements
    model.p16 = torch.nn.Parameter(torch.zeros(7, dtype=torch.float16))  # 7 float16
    model.p64 = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))  # 6 float64
    model.register_buffer("running", torch.zeros(4))  # 4 float32, averaged as a buffer
    model.register_buffer("count", torch.zeros(2, dtype=torch.int64))  # never averaged
    payload = (55 + 7) * 4 + 6 * 8 + 4 * 4
    return model, payload


def _sent(payload: int, n: int) -> int:
    return 2 * (n - 1) * payload // n


def _scenarios(rank: int, world_size: int) -> dict:
    out: dict = {}

    # 1. Two levels with warmup: exact rounds and bytes per level, seconds only where rounds ran.
    levels = {2: 2, 4: world_size}
    warmup, steps = 3, 23
    model, payload = _model()
    opt = HierarchicalAveragingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), levels, warmup_steps=warmup, buffers=model.buffers()
    )
    expected_rounds = rounds_per_level(0, steps, [AveragingLevel(p, g) for p, g in levels.items()], warmup)
    before = opt.metrics()
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    metrics = opt.metrics()
    out["two_levels"] = {"metrics": metrics, "before": before, "expected_rounds": expected_rounds, "payload": payload}
    json.dumps(metrics)  # plain, serialisable values
    copy = opt.metrics()
    copy[2]["rounds"] = -1  # a copy: mutating it must not touch the averager
    out["two_levels"]["after_mutation"] = opt.metrics()[2]["rounds"]

    # 2. A level whose subgroup is this rank alone ({1: 1}): rounds counted, no bytes.
    model, payload = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "never averages anything": legal, and what is tested
        opt = HierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), {1: 1, 3: world_size})
    for _ in range(7):
        opt.step()
    out["singleton"] = {"metrics": opt.metrics(), "payload": payload - 16}  # no buffers passed here

    # 3. Sharded: 2 ranks per replica, each rank holds its own shard; bytes are the shard's.
    shard = torch.nn.Parameter(torch.full((100 + 50 * (rank % 2),), float(rank)))
    averager = HierarchicalAverager(AveragingConfig.create({2: world_size}, ranks_per_replica=2))
    for _ in range(5):
        averager.step_and_average(lambda: [shard.detach()])
    out["sharded"] = {"metrics": averager.metrics(), "shard_bytes": shard.numel() * 4, "value": shard[0].item()}

    # 4. Logging at INFO, exactly at the step counts that are multiples of N.
    handler = _Records()
    log = logging.getLogger(optimizer_module.__name__)
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        model, _ = _model()
        opt = HierarchicalAveragingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), {2: 2, 4: world_size}, log_metrics_every=3
        )
        logged_at = []
        for step in range(1, 11):
            n_before = len(handler.records)
            opt.step()
            if len(handler.records) > n_before:
                logged_at.append(step)
        silent = HierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), {2: world_size})
        n_before = len(handler.records)
        for _ in range(6):
            silent.step()
        out["logging"] = {
            "logged_at": logged_at,
            "levels": [r.levelno for r in handler.records[:n_before]],
            "messages": [r.getMessage() for r in handler.records[:n_before]],
            "metrics": opt.metrics(),
            "silent_records": len(handler.records) - n_before,
        }
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)

    # 5. A bad log_metrics_every: ValueError naming the value, on every rank (no hang, no group left half-built).
    rejected = {}
    for bad in BAD_LOG_EVERY:
        errors = []
        model, _ = _model()
        for build in (
            lambda: HierarchicalAveragingOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), {2: world_size}, log_metrics_every=bad
            ),
            lambda: HierarchicalAverager(AveragingConfig.create({2: world_size}), log_metrics_every=bad),
        ):
            try:
                build()
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        rejected[repr(bad)] = errors
    out["rejected"] = rejected
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_scenarios, WORLD_SIZE)


def test_rounds_and_bytes_per_level_exact(results):
    for rank, res in enumerate(results):
        r = res["two_levels"]
        payload = r["payload"]
        assert list(r["metrics"]) == [2, 4]
        for period, subgroup, expected in zip((2, 4), (2, WORLD_SIZE), r["expected_rounds"]):
            m = r["metrics"][period]
            assert set(m) == METRIC_KEYS
            assert (m["period"], m["group_size"], m["subgroup_size"]) == (period, subgroup, subgroup)
            assert m["rounds"] == expected, (rank, period)
            assert m["payload_bytes"] == expected * payload, (rank, period)
            assert m["bytes_sent"] == expected * _sent(payload, subgroup), (rank, period)
            assert m["seconds"] > 0.0
            assert m["outer_bytes"] == 0 and m["pseudo_grad_norm"] is None  # no outer optimizer (tests/test_outer.py)
        # 23 steps from warmup 3: counts 4, 8, ..., 20 at period 4; 6, 10, 14, 18, 22 at period 2.
        assert r["expected_rounds"] == [5, 5]
        assert all(m["rounds"] == 0 and m["payload_bytes"] == 0 and m["seconds"] == 0.0 for m in r["before"].values())
        assert r["after_mutation"] == 5


def test_singleton_subgroup_counts_rounds_without_bytes(results):
    for res in results:
        m = res["singleton"]["metrics"]
        # counts 0..6: period 3 at 0, 3, 6; period 1 at the other four.
        assert m[1]["subgroup_size"] == 1 and m[1]["rounds"] == 4
        assert m[1]["payload_bytes"] == 0 and m[1]["bytes_sent"] == 0
        assert m[3]["rounds"] == 3 and m[3]["payload_bytes"] == 3 * res["singleton"]["payload"]


def test_sharded_bytes_are_the_shard(results):
    for rank, res in enumerate(results):
        s = res["sharded"]
        m = s["metrics"][2]
        assert m["subgroup_size"] == 2 and m["rounds"] == 3  # counts 0, 2, 4
        assert m["payload_bytes"] == 3 * s["shard_bytes"]
        assert m["bytes_sent"] == 3 * _sent(s["shard_bytes"], 2)
        # shard index rank % 2 averages with rank + 2 or rank - 2: mean of (r, r + 2).
        assert s["value"] == (rank % 2) + 1.0


def test_logging_at_most_once_per_n_steps(results):
    for res in results:
        log = res["logging"]
        assert log["logged_at"] == [3, 6, 9]
        assert log["levels"] == [logging.INFO] * 3
        assert "at step 9" in log["messages"][-1]
        # count 9 does not average, so the metrics logged at step 9 are the final ones.
        assert repr(log["metrics"]) in log["messages"][-1]
        assert log["silent_records"] == 0


def test_log_metrics_every_rejected_on_every_rank(results):
    for rank, res in enumerate(results):
        for bad in BAD_LOG_EVERY:
            for message in res["rejected"][repr(bad)]:
                assert message is not None, (rank, bad)
                assert "log_metrics_every must be a positive integer" in message and repr(bad) in message, message

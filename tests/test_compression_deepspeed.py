"""Compressed rounds on real DeepSpeed engines: CPU accelerator, gloo, 4 ranks as 2 replicas of 2.

The compressed level averages the 2 replicas' fp32 master partitions (each rank its own partition, ZeRO 0-3).

* A lossless codec (top-k of density 1 with float32 values), ZeRO 0-3 fp32, 3 rounds: every round's full
  masters within 1e-6 of the exact mean of the replicas' masters just before it (as outer SGD with lr 1), the
  replicas bitwise equal after it.
* int8 (blocks of 16) without error feedback, ZeRO-3 fp32: every round within the codec's bound of the exact mean
  (``max |anchor - masters| / 254``), the replicas bitwise equal.
* Resume: ZeRO-2 bf16 and ZeRO-3 fp32, int8 with error feedback (decay 0.9) under Nesterov, saved after 2
  rounds: the resumed run equals the uninterrupted one bit for bit; each rank restores its own residuals (which
  differ between the ranks of a replica) from its own file.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest

from tests.harness import run_distributed, run_scenarios
from tests.test_deepspeed import _full_masters, _full_module, _gather, _max_diff
from tests.test_outer_deepspeed import NESTEROV, PERIOD, WORLD, S, _build, _record_rounds, _section, _step

deepspeed = pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(900)

LOSSLESS = {"type": "topk", "density": 1.0, "chunk": 64, "values": "float32"}
INT8_16 = {"type": "int8", "block": 16}  # blocks smaller than the tiny model's partitions


def _rounds_case(rank, stage, prec, compress, ef_decay):
    """3 compressed rounds: per round the full masters before (both replicas) and after, and the anchors."""
    engine, state = _build(stage, prec, _section(compress={str(PERIOD): compress}, ef_decay=ef_decay))
    start = _full_masters(engine)
    rounds = _record_rounds(engine, state)
    for step in range(2 * PERIOD + 1):  # rounds at counts 0, 2, 4
        _step(engine, rank, step)
    everyone = _gather(rounds)
    errors, bounds, differed, equal_after = [], [], [], []
    anchor = start
    for k, (_, after) in enumerate(rounds):
        before = [everyone[0][k][0], everyone[S][k][0]]
        mean = [(x + y) / 2 for x, y in zip(*before)]
        errors.append(_max_diff(after, mean))
        bounds.append(max(_max_diff(anchor, b) for b in before) / 254 * (1 + 2**-14))
        differed.append(_max_diff(*before) > 0)
        equal_after.append(_max_diff(everyone[0][k][1], everyone[S][k][1]) == 0)
        anchor = after
    m = state.metrics()[PERIOD]
    return {
        "rounds": len(rounds), "errors": errors, "bounds": bounds, "differed": differed, "equal_after": equal_after,
        "ratio": m["compression_ratio"], "compressed_bytes": m["compressed_bytes"],
    }  # fmt: skip


def _resume_case(rank, stage, prec, folder):
    """Save after 3 steps (2 rounds), train 3 more; a fresh engine loading the checkpoint trains them the same."""
    import torch

    section = _section(NESTEROV, compress={str(PERIOD): "int8"}, ef_decay=0.9)
    engine, state = _build(stage, prec, section)
    for step in range(3):
        _step(engine, rank, step)
    saved = [r.clone() for r in state.averager.state_dict()["outer"][PERIOD]["residuals"]]
    engine.save_checkpoint(folder, tag="t3")
    for step in range(3, 6):
        _step(engine, rank, step)
    uninterrupted = _full_module(engine)
    resumed, resumed_state = _build(stage, prec, section)
    resumed.load_checkpoint(folder)
    loaded = resumed_state.averager.state_dict()["outer"][PERIOD]["residuals"]
    restored = len(loaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(loaded, saved))
    for step in range(3, 6):
        _step(resumed, rank, step)
    everyone = _gather([torch.cat([r.reshape(-1) for r in saved])])
    first = (rank // S) * S
    return {
        "diff": _max_diff(uninterrupted, _full_module(resumed)),
        "restored": restored,
        "nonzero": any(bool(r.abs().sum() > 0) for r in saved),
        "ranks_of_replica_differ": not torch.equal(everyone[first][0], everyone[first + 1][0])
        if everyone[first][0].shape == everyone[first + 1][0].shape
        else True,
    }


def _scenarios(rank, world_size, folder):
    import torch

    torch.set_num_threads(1)
    scenarios = {}
    for stage in (0, 1, 2, 3):
        scenarios[f"lossless_zero{stage}_fp32"] = lambda r, s=stage: _rounds_case(r, s, "fp32", LOSSLESS, 1.0)
    scenarios["int8_zero3_fp32"] = lambda r: _rounds_case(r, 3, "fp32", INT8_16, 0.0)
    scenarios["resume_zero2_bf16"] = lambda r: _resume_case(r, 2, "bf16", os.path.join(folder, "z2"))
    scenarios["resume_zero3_fp32"] = lambda r: _resume_case(r, 3, "fp32", os.path.join(folder, "z3"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_scenarios(scenarios, rank)


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory(prefix="hieravg-compress-ds-") as folder:
        return run_distributed(_scenarios, WORLD, folder, timeout=800, pg_timeout=300)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lossless_compressed_round_is_the_mean(results, stage):
    for rank, per_rank in enumerate(results):
        r = per_rank[f"lossless_zero{stage}_fp32"]
        assert r["rounds"] == 3 and all(r["differed"]), (rank, r)
        assert max(r["errors"]) <= 1e-6, (rank, r["errors"])
        assert all(r["equal_after"]), (rank, r)


def test_int8_round_within_the_codec_bound(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["int8_zero3_fp32"]
        assert r["rounds"] == 3 and all(r["differed"]) and all(r["equal_after"]), (rank, r)
        assert all(e <= b for e, b in zip(r["errors"], r["bounds"])), (rank, r["errors"], r["bounds"])
        assert max(r["errors"]) > 0, "int8 rounds nothing: the test is vacuous"
        # Two replicas: the all-gather sends one payload, 20 bytes per 16 elements (0.31x of an fp32 all-reduce
        # of the partition), plus the padding of the last block and of the payload to 8 bytes.
        assert r["compressed_bytes"] > 0 and r["ratio"] < 0.45, (rank, r)


@pytest.mark.parametrize("case", ["resume_zero2_bf16", "resume_zero3_fp32"])
def test_resume_equals_uninterrupted(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        assert r["restored"] and r["nonzero"], (rank, r)
        assert r["ranks_of_replica_differ"], (rank, r)
        assert r["diff"] == 0, (rank, r)  # the same ops on the same bits: the resumed run is the uninterrupted one

"""hieravg_optim.deepspeed on DeepSpeed's real fp16 path, on the CPU: 4 ranks as 2 replicas of 2.

DeepSpeed 0.19.8's CPU accelerator reports fp16 as unsupported unless
``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` is true (CPUs with AVX512-FP16/AMX), and
``DeepSpeedEngine`` then refuses ``"fp16": {"enabled": true}`` ("Type fp16 is not supported on
your device", ``runtime/engine.py``). torch itself runs fp16 Linear/matmul on any CPU, so inside
the spawned ranks (only there, never in the pytest process) this file overrides that one
capability check: ``CPU_Accelerator.is_fp16_supported`` returns True (``supported_dtypes()``
follows from it). Nothing else is patched: the engines, DeepSpeed's fp16 optimizers
(``FP16_UnfusedOptimizer`` for ZeRO-0 with a torch AdamW, ``DeepSpeedZeroOptimizer`` for ZeRO-1/2,
``DeepSpeedZeroOptimizer_Stage3``), dynamic loss scaling, overflow detection and skipped steps
are DeepSpeed's own code.

* For ZeRO stages 0-3 in fp16, with two parameter groups: after the averaging step the fp32
  master weights equal exactly ``(replica 0 + replica 1) / 2`` of the masters taken right before
  averaging, and every rank's module parameters are exactly that mean in fp16.
* An overflow (inf loss) in replica 1 only, at an averaging step: no hang, every rank's count
  equals ``engine.global_steps``, ``skipped_steps`` is 1 in replica 1 and 0 in replica 0, and the
  next averaging again gives the exact mean of the replicas' masters.
* ``ds_configs/zero2_fp16.json`` as shipped (its own optimizer, scheduler and loss scaling).

Runtime budget of this file: 60 s on 2 idle cores (one spawn of 4 ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_distributed
from tests.test_deepspeed import (
    S,
    assert_exact_replica_mean,
    capture_masters_before_averaging,
    WORLD,
    _all_equal,
    _averaging_case,
    _client_optimizer,
    _config,
    _full_masters,
    _full_module,
    _gather,
    _max_diff,
    _micro_step,
    _model,
    _two_groups,
)

deepspeed = pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(600)

# A loss scale of 2**8 (not DeepSpeed's default 2**16) so that the tiny model's first steps do not
# overflow on their own: the only overflow is the one this file forces.
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}

# (name, zero stage, precision, gradient accumulation, extra config): the rows of test_deepspeed.
FP16_CASES = [
    ("zero0_fp16", 0, "fp16", 1, FP16),
    ("zero1_fp16", 1, "fp16", 1, FP16),
    ("zero2_fp16", 2, "fp16", 1, FP16),
    ("zero3_fp16", 3, "fp16", 1, FP16),
]


def _allow_fp16_on_cpu():
    """Override DeepSpeed's CPU fp16 capability check (mkldnn fp16) and nothing else. Ranks only."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert isinstance(get_accelerator(), CPU_Accelerator), get_accelerator()
    CPU_Accelerator.is_fp16_supported = lambda self: True


def _overflow_then_average(rank, stage):
    """inf loss in replica 1 at count 2 (averaging), then the averaging at count 4 is still exact."""
    import torch

    import hieravg_optim.deepspeed as hds

    section = {"period_group_size": {"2": WORLD}, "warmup_steps": 0, "ranks_per_replica": S}
    model = _model()
    engine, _, _, _ = hds.initialize(model=model, optimizer=_client_optimizer(model),
                                     config=_config(stage, "fp16", 1, section, FP16))  # fmt: skip
    state = hds.get_averaging(engine)
    captured = capture_masters_before_averaging(engine, state)
    skipped_after_overflow = None
    for step in range(5):  # counts 0..4; averaging at 0, 2 and 4; overflow at 2 in replica 1
        overflow_here = step == 2 and rank >= S
        _micro_step(engine, rank, step, scale=float("inf") if overflow_here else 1.0)
        if step == 2:
            skipped_after_overflow = engine.skipped_steps
    before = _gather(captured["before"])
    after_masters = _full_masters(engine)
    after_module = _full_module(engine)
    mean = [(a + b) / 2 for a, b in zip(before[0], before[S])]
    return {
        "kind": state.kind,
        "count": state.step,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "skipped_after_overflow": skipped_after_overflow,
        "rounds": state.metrics()[2]["rounds"],
        "replicas_differed": _max_diff(before[0], before[S]) > 0,
        "masters_are_mean": all(a.equal(m) for a, m in zip(after_masters, mean)),
        "module_is_mean_in_fp16": all(a.equal(m.half().float()) for a, m in zip(after_module, mean)),
        "module_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "module_identical_everywhere": _all_equal(_gather(after_module)),
        "finite": all(bool(torch.isfinite(t).all()) for t in after_module),
    }


def _shipped_config(rank):
    """ds_configs/zero2_fp16.json as shipped: period 8 over 4 ranks, replicas of 2, loss scale 2**16."""
    import hieravg_optim.deepspeed as hds

    model = _model()
    engine, _, _, sched = hds.initialize(model=model, model_parameters=_two_groups(model),
                                         config=str(ROOT / "ds_configs" / "zero2_fp16.json"))  # fmt: skip
    state = hds.get_averaging(engine)
    for step in range(9):  # counts 0..8: averaging at 0 and 8
        _micro_step(engine, rank, step)
    return {
        "kind": state.kind,
        "fp16": engine.fp16_enabled(),
        "dp_world_size": engine.dp_world_size,
        "count": state.step,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "rounds": state.metrics()[8]["rounds"],
        "scheduler": sched is not None,
        "identical": _all_equal(_gather(_full_module(engine))),
    }


def _all_fp16_scenarios(rank, world_size):
    import torch

    torch.set_num_threads(1)
    _allow_fp16_on_cpu()
    results = {"averaging": {case[0]: _averaging_case(rank, *case) for case in FP16_CASES}}
    results["overflow"] = {f"zero{stage}": _overflow_then_average(rank, stage) for stage in (0, 1, 2, 3)}
    results["shipped"] = _shipped_config(rank)
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_fp16_scenarios, WORLD, timeout=300, pg_timeout=300)


@pytest.mark.parametrize("case", [c[0] for c in FP16_CASES])
def test_fp16_averaging_gives_exact_replica_mean(results, case):
    assert_exact_replica_mean(results, case)


def test_fp16_uses_deepspeeds_fp16_optimizers(results):
    kinds = {name: results[0]["averaging"][name]["kind"] for name, *_ in FP16_CASES}
    assert kinds == {"zero0_fp16": "fp16_unfused", "zero1_fp16": "zero12", "zero2_fp16": "zero12",
                     "zero3_fp16": "zero3"}, kinds  # fmt: skip


@pytest.mark.parametrize("case", ["zero0", "zero1", "zero2", "zero3"])
def test_fp16_overflow_in_one_replica_only(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank["overflow"][case]
        assert r["count"] == 5 == r["global_steps"], (rank, r)
        assert r["rounds"] == 3, (rank, r)
        overflowed = rank >= S
        assert r["skipped_after_overflow"] == (1 if overflowed else 0), (rank, r)
        assert r["skipped_steps"] == (1 if overflowed else 0), (rank, r)
        assert r["replicas_differed"], (rank, r)
        assert r["masters_are_mean"], f"rank {rank} {case}: masters are not the replica mean after the overflow"
        assert r["module_is_mean_in_fp16"] and r["module_identical_everywhere"], (rank, r)
        assert r["module_dtypes"] == ["torch.float16"], (rank, r)
        assert r["finite"], (rank, r)


def test_shipped_zero2_fp16_config_runs(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["shipped"]
        assert r["kind"] == "zero12" and r["fp16"] and r["scheduler"], (rank, r)
        assert r["dp_world_size"] == S, (rank, r)
        assert r["count"] == 9 == r["global_steps"], (rank, r)
        assert r["rounds"] == 2, (rank, r)
        assert r["identical"], f"rank {rank}: replicas differ right after the averaging at count 8"

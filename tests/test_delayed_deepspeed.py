"""Delayed rounds on real DeepSpeed engines (CPU accelerator, gloo, 4 ranks as 2 replicas of 2), ZeRO 0-3.

The section averages every 4 steps with ``delay_steps`` 2 after a local warm-up of 1 step: the round starts at
count 4 and is applied at count 6. The fp32 master weights are gathered (DeepSpeed's own accessors) right before
the round starts (``theta_4`` per replica) and right before it is applied (``theta_6``); after the step at count
6 every rank's masters equal exactly ``(theta_4[replica 0] + theta_4[replica 1]) / 2 + (theta_6 - theta_4)`` of
its replica, computed in float32 in that order, and the module holds them rounded to its dtype. The round of
count 8, landed at count 9 by ``get_averaging(engine).apply_rounds_in_flight()``, follows the same formula and
reaches the module. A checkpoint saved with the round in flight (after count 5) resumes to the uninterrupted run, bitwise; one with a compressed
round in flight (``compress`` int8 with error feedback under Nesterov at the same level, ZeRO-1; and node-aware,
ZeRO-2 with 4 replicas of one rank on 2 nodes of 2), bitwise too.
ZeRO-2 with ``fragments`` 4: the fragments are element ranges of the one flat fp32 partition each rank holds.
"""

from __future__ import annotations

import pytest

from tests.harness import default_timeout, run_distributed
from tests.test_delayed import capture_round_inputs
from tests.test_deepspeed import S, WORLD, _client_optimizer, _config, _dtype, _full_masters, _full_module, _gather
from tests.test_deepspeed import _micro_step, _model, _two_groups
from tests.test_outer_deepspeed import NESTEROV

deepspeed = pytest.importorskip("deepspeed")

pytestmark = pytest.mark.timeout(default_timeout(600))

CASES = [("zero0_fp32", 0, "fp32"), ("zero1_bf16", 1, "bf16"), ("zero2_fp32", 2, "fp32"), ("zero3_bf16", 3, "bf16"),
         ("zero3_fp32", 3, "fp32")]  # fmt: skip
SECTION = {"period_group_size": {"4": WORLD}, "warmup_steps": 1, "ranks_per_replica": S, "synchronous_warmup": False,
           "delay_steps": 2}  # fmt: skip

COMPRESSED_SECTION = {**SECTION, "compress": {"4": {"type": "int8", "block": 16}}, "ef_decay": 0.9,
                      "outer_optimizer": {"4": NESTEROV}}  # fmt: skip
NODE_AWARE_SECTION = {**COMPRESSED_SECTION, "ranks_per_replica": 1, "ranks_per_node": 2}
"""The compressed level node-aware: 4 replicas of one rank (ZeRO over one rank each) on 2 nodes of 2."""


def _applied_case(rank, name, stage, prec):
    import hieravg_optim.deepspeed as hds

    model = _model()
    engine, _, _, _ = hds.initialize(model=model, optimizer=_client_optimizer(model), config=_config(stage, prec, 1, SECTION))
    state = hds.get_averaging(engine)
    delayed = state.averager._delayed
    captured = capture_round_inputs(delayed, lambda: _full_masters(engine))
    held = []
    for step in range(7):  # counts 0 .. 6: the round starts at 4, lands at 6
        _micro_step(engine, rank, step)
        held.append(state.metrics()[4]["bytes_in_flight"])
    snap = _gather(captured["start"])
    live = _gather(captured["apply"])
    k = rank // S
    expected = [(a + b) / 2 + (c - d) for a, b, c, d in zip(snap[0], snap[S], live[k * S], snap[k * S])]
    masters, module = _full_masters(engine), _full_module(engine)
    metrics = state.metrics()[4]
    out = {
        "masters_exact": all(m.equal(e) for m, e in zip(masters, expected)),
        "module_in_dtype": all(a.equal(m.to(_dtype(engine)).float()) for a, m in zip(module, masters)),
        "replicas_differed": any(not a.equal(b) for a, b in zip(snap[0], snap[S])),
        "progress_kept": any(not a.equal(b) for a, b in zip(live[k * S], snap[k * S])),
        "held": [h > 0 for h in held],
        "started_applied": (metrics["rounds_started"], metrics["rounds_applied"], metrics["rounds"]),
    }
    # Counts 7, 8: the round of count 8 starts; apply_rounds_in_flight() lands it now (not at count 10) with the
    # same formula, no progress made since, and pushes the masters into the module.
    for step in range(7, 9):
        _micro_step(engine, rank, step)
    applied = state.apply_rounds_in_flight()
    snap, live = _gather(captured["start"]), _gather(captured["apply"])
    expected = [(a + b) / 2 + (c - d) for a, b, c, d in zip(snap[0], snap[S], live[k * S], snap[k * S])]
    masters, module = _full_masters(engine), _full_module(engine)
    out["at_end"] = {
        "applied": applied,
        "again": state.apply_rounds_in_flight(),
        "count": state.step,
        "masters_exact": all(m.equal(e) for m, e in zip(masters, expected)),
        "module_in_dtype": all(a.equal(m.to(_dtype(engine)).float()) for a, m in zip(module, masters)),
        "in_flight_bytes": state.metrics()[4]["bytes_in_flight"],
    }
    return out


def _resume_case(rank, name, stage, prec, folder, section=SECTION):
    import torch

    import hieravg_optim.deepspeed as hds
    from hieravg_optim.deepspeed.checkpoint import outer_state_file, replica_checkpoint_dir

    def build():
        model = _model()
        return hds.initialize(model=model, model_parameters=_two_groups(model),
                              config=_config(stage, prec, 1, section, optimizer_section=True))[0]  # fmt: skip

    engine = build()
    for step in range(5):
        _micro_step(engine, rank, step)
    assert hds.get_averaging(engine).averager._delayed.in_flight  # the round of count 4, applied at 6
    engine.save_checkpoint(folder, tag="t5")
    s = section["ranks_per_replica"]
    own = torch.load(outer_state_file(replica_checkpoint_dir(folder, rank // s, "t5"), rank % s), weights_only=True)
    in_file = [sorted(entry) for entry in own["in_flight"].values()]
    shards = [entry.get("compressed", {}).get("shard") for entry in own["in_flight"].values()]
    for step in range(5, 8):
        _micro_step(engine, rank, step)
    uninterrupted = _full_module(engine)
    resumed = build()
    resumed.load_checkpoint(folder)
    in_flight = hds.get_averaging(resumed).averager._delayed.in_flight
    loaded = {"in_flight_loaded": list(in_flight), "compressed": [r.compressed is not None for r in in_flight.values()],
              "saved_keys": in_file, "shards": shards}  # fmt: skip
    for step in range(5, 8):
        _micro_step(resumed, rank, step)
    after = _full_module(resumed)
    diff = max(float((a - b).abs().max()) for a, b in zip(uninterrupted, after))
    return {"equal": all(a.equal(b) for a, b in zip(uninterrupted, after)), "diff": diff, **loaded}


def _fragment_case(rank):
    """ZeRO-2, one parameter group: each rank averages one flat fp32 partition, split into 4 fragments of element
    ranges (``fragments`` 4 at period 8, ``delay_steps`` 1). After each apply, inside the fragment's range the
    partition is ``mean of the replicas' snapshots + (theta - snapshot)``, exactly; outside it, untouched."""
    import torch

    import hieravg_optim.deepspeed as hds
    from hieravg_optim.fragments import split_fragments

    section = {**SECTION, "period_group_size": {"8": WORLD}, "delay_steps": 1, "fragments": 4}
    model = _model()
    engine = hds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                            config=_config(2, "fp32", 1, section))[0]  # fmt: skip
    state = hds.get_averaging(engine)
    local = state.tensors_to_average()
    read = lambda: torch.cat([t.detach().reshape(-1).clone() for t in state.tensors_to_average()])  # noqa: E731
    captured = capture_round_inputs(state.averager._delayed, read)
    split = split_fragments([t.numel() for t in local], [t.element_size() for t in local], 4)
    checked = []
    for step in range(6):  # fragment 1 starts at count 2 (lands at 3), fragment 2 at 4 (lands at 5)
        _micro_step(engine, rank, step)
        if step in (3, 5):
            snap, live = _gather(captured["start"]), captured["apply"]
            expected = live.clone()
            (_, a, b), = split[(step - 1) // 2]
            shard = rank % S
            expected[a:b] = (snap[shard][a:b] + snap[shard + S][a:b]) / 2 + (live[a:b] - snap[rank][a:b])
            checked.append(torch.equal(read(), expected) and not torch.equal(expected, live))
    n = local[0].numel()
    return {"one_partition": len(local) == 1 and all(len(f) == 1 for f in split),
            "even": all(abs((f[0][2] - f[0][1]) - n / 4) <= 1 for f in split), "exact": checked}  # fmt: skip


def _all(rank, world, folder):
    import os

    out = {name: _applied_case(rank, name, stage, prec) for name, stage, prec in CASES}
    out["zero2_fragments"] = _fragment_case(rank)
    for name, stage, prec in (CASES[2], CASES[3]):
        out["resume_" + name] = _resume_case(rank, name, stage, prec, os.path.join(folder, name))
    # A compressed round in flight (int8 with error feedback under Nesterov): its gathered payloads travel in each
    # rank's outer state file.
    out["resume_compressed_zero1_fp32"] = _resume_case(
        rank, "compressed", 1, "fp32", os.path.join(folder, "compressed"), COMPRESSED_SECTION
    )
    # The same, node-aware (ZeRO-2, 2 nodes of 2 ranks): each rank's file holds its shard's payloads.
    out["resume_node_aware_zero2_fp32"] = _resume_case(
        rank, "node_aware", 2, "fp32", os.path.join(folder, "node_aware"), NODE_AWARE_SECTION
    )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all, WORLD, str(tmp_path_factory.mktemp("ckpt")), timeout=540)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_delayed_round_applies_the_eager_formula_to_the_masters(results, case):
    for r in results:
        got = r[case]
        assert got["replicas_differed"] and got["progress_kept"]
        assert got["masters_exact"] and got["module_in_dtype"], got
        assert got["held"] == [False] * 4 + [True, True, False]  # in flight after counts 4 and 5
        assert got["started_applied"] == (1, 1, 1)
        # get_averaging(engine).apply_rounds_in_flight() at count 9: the round of count 8 lands, once.
        assert got["at_end"] == {"applied": 1, "again": 0, "count": 9, "masters_exact": True, "module_in_dtype": True,
                                 "in_flight_bytes": 0}, got["at_end"]  # fmt: skip


def test_fragments_split_one_flat_partition_by_element_ranges(results):
    for r in results:
        assert r["zero2_fragments"] == {"one_partition": True, "even": True, "exact": [True, True]}, r["zero2_fragments"]


@pytest.mark.parametrize("case", ["zero2_fp32", "zero3_bf16"])
def test_deepspeed_resume_with_a_round_in_flight(results, case):
    for r in results:
        got = r["resume_" + case]
        assert got["equal"] and got["in_flight_loaded"] == [0] and got["compressed"] == [False], got
        assert len(got["saved_keys"]) == 1 and "compressed" not in got["saved_keys"][0], got


@pytest.mark.parametrize("case", ["resume_compressed_zero1_fp32", "resume_node_aware_zero2_fp32"])
def test_deepspeed_resume_with_a_compressed_round_in_flight(results, case):
    """The compressed round of count 4 saved after count 5 (its payloads gathered, in each rank's own outer state
    file) resumes to the uninterrupted run, bitwise; node-aware, the payloads are this rank's shard's, one per
    node."""
    for r in results:
        got = r[case]
        assert got["in_flight_loaded"] == [0] and got["compressed"] == [True], got
        assert len(got["saved_keys"]) == 1 and "compressed" in got["saved_keys"][0], got  # in this rank's own file
        assert "meaning" in got["saved_keys"][0], got  # checked at the load as the core state dict's
        assert (got["shards"][0] is not None) == (case == "resume_node_aware_zero2_fp32"), got
        assert got["equal"] and got["diff"] == 0.0, got  # the payloads decoded in rank order: bitwise

"""Adversarial tests: bad input on some ranks only, partial resumes, dead ranks, odd tensors.

The bar (developers' guide): bad input gets a clear error naming the value and the fix, raised
on every rank; never a hang, never silently wrong averaging, never lost state. Every scenario
runs in real gloo processes (tests/harness.py) and asserts that the error came well within the
process group's timeout: a regression to "wait for the timeout" fails.

Covered: settings invalid or different on one rank (core wrapper, FSDP adapter, DeepSpeed section
including "auto" resolving differently per node, a string number, a disabled section); a
checkpoint loaded on some ranks only; malformed averaging state; resuming with more replicas
than were saved (FSDP DCP, DeepSpeed); parameter sets, frozen parameters, parameter groups and
dtypes differing across ranks; aliased, tied and self-overlapping tensors; float16 / bfloat16
near their maximum; a NaN on one rank; schedule edge cases (warm-up not a multiple of a period,
a count near 2**62, zero_grad(set_to_none=False), a closure); a rank killed mid-training.

Runtime budget of this file: 2 minutes on 2 idle cores (measured 24-76 s on the shared, loaded machine; four spawns: core
scenarios on 4 ranks, a killed rank on 2, DeepSpeed on 4, FSDP on 4).
"""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import DistributedTestError, default_timeout, run_distributed

pytestmark = pytest.mark.timeout(600)

PG_TIMEOUT = 60.0
"""Collective timeout in the ranks. Every expected error comes within a second or two; a hang would
end at this timeout with a gloo error, which no scenario accepts."""


def _raises(fn, exc_type):
    """Run ``fn``; return ``(type name, message, seconds)``; fail if it does not raise ``exc_type``."""
    start = time.monotonic()
    try:
        fn()
    except exc_type as err:
        return type(err).__name__, str(err), time.monotonic() - start
    raise AssertionError(f"no {exc_type.__name__}")


def _group_still_works(rank: int, world_size: int) -> None:
    """No collective was left half-done: a fresh all-reduce still pairs up, in order."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert float(t) == world_size * (world_size + 1) / 2, float(t)


# --------------------------------------------------------------------------------------------------
# Core scenarios (4 ranks)
# --------------------------------------------------------------------------------------------------
class _BrokenGroups:
    """An optimizer whose ``param_groups`` raise: a RuntimeError while the settings are checked."""

    @property
    def param_groups(self):
        raise RuntimeError("param_groups failed on this rank")

    def step(self):
        pass


def _averager_warning_as_error(error: bool, world_size: int):
    """HierarchicalAverager with a config that warns (period 1), the warning an error on this rank if ``error``."""
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    with warnings.catch_warnings():
        warnings.simplefilter("error" if error else "ignore")
        return HierarchicalAverager(AveragingConfig.create({1: world_size}))


def _one_rank_bad_config(rank: int, world_size: int) -> list:
    """A config that is invalid on rank 1 only: rank 1 raises the ValueError / TypeError naming the value,
    every other rank a RuntimeError naming rank 1 and that error, at once (before: they waited in the
    constructor's collective until the process group's timeout)."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    p = nn.Parameter(torch.zeros(3))
    inner = torch.optim.SGD([p], lr=0.1)
    full = {2: 2, 4: world_size}
    cases = [
        ("warmup", lambda: HierarchicalAveragingOptimizer(inner, full, warmup_steps=-1 if rank == 1 else 0),
         ValueError, "warmup_steps must be a non-negative integer (steps), got -1"),
        ("levels", lambda: HierarchicalAveragingOptimizer(inner, {2: 3, 4: 4} if rank == 1 else full),
         ValueError, "Group size 3 of period 2 must divide the size of the process group (4)"),
        ("bucket", lambda: HierarchicalAveragingOptimizer(inner, full, bucket_cap_mb=0 if rank == 1 else 25),
         ValueError, "bucket_cap_mb must be a positive, finite number of MB, got 0"),
        ("float period", lambda: HierarchicalAveragingOptimizer(inner, {2.0: 2, 4: 4} if rank == 1 else full),
         ValueError, "Period 2.0 in period_group_size must be a positive integer"),
        ("optimizer", lambda: HierarchicalAveragingOptimizer(object() if rank == 1 else inner, full),
         TypeError, "optimizer must be a torch.optim.Optimizer"),
        ("metrics", lambda: HierarchicalAveragingOptimizer(inner, full, log_metrics_every=0 if rank == 1 else None),
         ValueError, "log_metrics_every must be a positive integer"),
        # Any exception of the checks, not only TypeError / ValueError, reaches the agreement.
        ("param_groups", lambda: HierarchicalAveragingOptimizer(_BrokenGroups() if rank == 1 else inner, full),
         RuntimeError, "param_groups failed on this rank"),
        ("warning as error", lambda: _averager_warning_as_error(rank == 1, world_size),
         UserWarning, "The largest period in period_group_size is 1"),
    ]  # fmt: skip
    out = []
    for label, build, exc_type, needle in cases:
        name, message, seconds = _raises(build, exc_type if rank == 1 else RuntimeError)
        if rank != 1:
            assert f"Rank 1 failed while checking the averaging config: {exc_type.__name__}: " in message, message
        assert needle in message, (label, message)
        assert seconds < PG_TIMEOUT / 2, (label, seconds)
        out.append((label, name))
    _group_still_works(rank, world_size)
    return out


def _load_on_some_ranks(rank: int, world_size: int) -> dict:
    """A checkpoint loaded on rank 0 only, before the first step: RuntimeError on every rank at the first step,
    naming both counts, before the inner step touched the parameters (before: a collective mismatch that
    ended only at the process group's timeout)."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    p = nn.Parameter(torch.full((3,), float(rank)))
    p.grad = torch.ones(3)
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([p], lr=0.5), {2: 2, 4: world_size})
    if rank == 0:
        state = opt.state_dict()
        state["hierarchical_averaging"]["step"] = 7
        opt.load_state_dict(state)
    _, message, seconds = _raises(opt.step, RuntimeError)
    assert "Ranks disagree on the averaging step count after load_state_dict" in message, message
    assert "rank 0 has 7, rank 1 has 0" in message, message
    assert "Load the same checkpoint on every rank" in message, message
    assert seconds < PG_TIMEOUT / 2, seconds
    assert torch.equal(p.detach(), torch.full((3,), float(rank))), "the failed step changed the parameters"
    _group_still_works(rank, world_size)
    return {"message": message}


def _bad_state_dicts(rank: int, world_size: int) -> dict:
    """Malformed averaging state: ValueError naming the value, never a KeyError, a truncated float or a reset."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    p = nn.Parameter(torch.zeros(3))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([p], lr=0.1), {2: 2, 4: world_size}, warmup_steps=2)
    good = opt.state_dict()
    out = {}
    for label, patch, needle in [
        ("no step", {"hierarchical_averaging": {"levels": [[2, 2], [4, 4]]}}, "under 'step'"),
        ("float step", {"hierarchical_averaging": {"step": 3.7}}, "got 3.7 (float)"),
        ("negative step", {"hierarchical_averaging": {"step": -1}}, "got -1 (int)"),
        ("torch step None", {"hierarchical_averaging": None, "step": "12"}, "got '12' (str)"),
    ]:
        state = {**good, **patch}
        if state.get("hierarchical_averaging") is None:
            del state["hierarchical_averaging"]
        _, message, _ = _raises(lambda s=state: opt.load_state_dict(s), ValueError)
        assert needle in message, (label, message)
        out[label] = message
    assert opt.averaging_step == 0, "a rejected state dict changed the count"
    # The inner optimizer rejects its part (another number of parameter groups): the count is not changed either.
    wrong = {**good, "param_groups": good["param_groups"] * 2, "hierarchical_averaging": {"step": 9}}
    _, out["inner rejects"], _ = _raises(lambda: opt.load_state_dict(wrong), ValueError)
    assert opt.averaging_step == 0, "the count was loaded although the inner optimizer rejected the state dict"
    # A 0-d integer tensor (torch.save of a tensor count) is a count.
    opt.load_state_dict({**good, "hierarchical_averaging": {"step": torch.tensor(5)}})
    assert opt.averaging_step == 5
    # Another warm-up in the checkpoint: a warning at the caller, not a silent change.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict({**good, "hierarchical_averaging": {**good["hierarchical_averaging"], "warmup_steps": 9}})
    mine = [w for w in caught if "warmup_steps" in str(w.message)]
    assert len(mine) == 1 and "saved with warmup_steps=9" in str(mine[0].message), [str(w.message) for w in mine]
    assert mine[0].filename == __file__, mine[0].filename
    assert opt.averaging_step == good["hierarchical_averaging"]["step"]
    # Another synchronous_warmup: another warm-up schedule, warned about too.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict({**good, "hierarchical_averaging": {**good["hierarchical_averaging"], "synchronous_warmup": True}})
    mine = [w for w in caught if "synchronous_warmup" in str(w.message)]
    assert len(mine) == 1 and "saved with synchronous_warmup=True" in str(mine[0].message), [str(w.message) for w in mine]
    assert good["hierarchical_averaging"]["synchronous_warmup"] is False
    opt.step()  # every rank loaded the same state: the check at the first step passes
    return out


def _asymmetric_models(rank: int, world_size: int) -> dict:
    """Parameter sets that differ across ranks (a frozen parameter left out on one rank, a param group added on
    one rank only, a different dtype): RuntimeError at the averaging step on every rank, naming the ranks."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    out = {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if rank == 2:
        model[0].bias.requires_grad_(False)  # a frozen parameter, filtered out below on this rank only
    params = [p for p in model.parameters() if p.requires_grad]
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD(params, lr=0.1), {1: world_size})
    _, out["frozen"], _ = _raises(opt.step, RuntimeError)
    assert "disagree on the parameters to average at step 0" in out["frozen"], out["frozen"]
    assert "Ranks 0 and 2" in out["frozen"], out["frozen"]

    a = nn.Parameter(torch.zeros(4))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([a], lr=0.1), {1: world_size})
    if rank == 3:
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    _, out["param_group"], _ = _raises(opt.step, RuntimeError)
    assert "Ranks 0 and 3" in out["param_group"] and "1 tensors vs 2 tensors" in out["param_group"], out["param_group"]

    b = nn.Parameter(torch.zeros(4, dtype=torch.float64 if rank == 1 else torch.float32))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([b], lr=0.1), {1: world_size})
    _, out["dtype"], _ = _raises(opt.step, RuntimeError)
    assert "dtype float32 vs shape (4,) dtype float64" in out["dtype"], out["dtype"]
    _group_still_works(rank, world_size)
    return out


def _aliasing_and_numerics(rank: int, world_size: int) -> dict:
    """Tensors that share storage, tied weights, half precision near its max, and a NaN on one rank."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    out = {}
    # Two parameters viewing the same storage (overlapping), a tied weight listed twice, and buffers that
    # alias a parameter: every element ends at the exact mean, once (the average of identical values).
    storage = torch.arange(8, dtype=torch.float32) + 10 * rank
    first = nn.Parameter(storage[:6])
    second = nn.Parameter(storage[2:])  # overlaps first on [2, 6)
    tied = nn.Parameter(torch.full((3,), float(rank)))
    opt = HierarchicalAveragingOptimizer(
        torch.optim.SGD([{"params": [first, tied]}, {"params": [second]}], lr=0.0),
        {1: world_size},
        buffers=[storage[::2], storage[5:7]],
    )
    opt.param_groups[0]["params"].append(tied)  # a tied weight appearing twice (the inner optimizer allows it)
    opt.step()
    mean_offset = 10 * sum(range(world_size)) / world_size
    assert torch.equal(storage, torch.arange(8, dtype=torch.float32) + mean_offset), storage
    assert first.data_ptr() == storage.data_ptr() and second.data_ptr() == storage[2:].data_ptr()
    assert torch.equal(tied.detach(), torch.full((3,), sum(range(world_size)) / world_size))

    # float16 / bfloat16 near their largest values: summed in float32, so the mean is exact, no inf.
    h = nn.Parameter(torch.tensor([65504.0 if rank % 2 else 60000.0, -65504.0], dtype=torch.float16))
    bf = nn.Parameter(torch.tensor([3.0e37 * (rank + 1)], dtype=torch.bfloat16))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([h, bf], lr=0.0), {1: world_size})
    before = [_gather(x.detach().float()) for x in (h, bf)]
    opt.step()
    assert torch.equal(h.detach(), torch.tensor([62752.0, -65504.0], dtype=torch.float16)), h
    assert torch.equal(bf.detach(), torch.stack(before[1]).mean(0).to(torch.bfloat16)), (bf, before[1])
    out["fp16"] = h.tolist()

    # A NaN on rank 0, unchecked: no hang; it reaches exactly the ranks rank 0 averages with, at that level.
    # (The default, nonfinite="raise", is tested in tests/test_faults.py.)
    c = nn.Parameter(torch.tensor([float("nan") if rank == 0 else float(rank)]))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([c], lr=0.0), {1: 2, 2: world_size}, nonfinite="ignore")
    opt.load_state_dict({**opt.state_dict(), "hierarchical_averaging": {"step": 1}})  # count 1: the pairs
    opt.step()
    assert bool(torch.isnan(c).all()) == (rank in (0, 1)), (rank, c)
    out["nan_after_pair"] = c.tolist()

    # An expanded (stride-0) buffer cannot hold per-element means. On one rank only: RuntimeError on every rank
    # from the agreement check (before: that rank raised after the collective, the other went on silently);
    # on every rank: TypeError on every rank, before any averaging collective.
    d = nn.Parameter(torch.full((4,), float(rank)))
    expanded = torch.zeros(1).expand(4)
    opt = HierarchicalAveragingOptimizer(
        torch.optim.SGD([d], lr=0.0), {1: world_size}, buffers=[expanded if rank == 1 else torch.zeros(4)]
    )
    _, out["expanded_one_rank"], _ = _raises(opt.step, RuntimeError)
    assert "Ranks 0 and 1" in out["expanded_one_rank"], out["expanded_one_rank"]
    assert "dtype float32 vs shape (4,) dtype float32, internally overlapping" in out["expanded_one_rank"]
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([d], lr=0.0), {1: world_size}, buffers=[expanded])
    _, message, _ = _raises(opt.step, TypeError)
    assert "Tensor 1 to average (shape (4,), strides (0,)) is internally overlapping" in message, message
    assert torch.equal(d.detach(), torch.full((4,), float(rank))), "a rejected round changed the parameters"
    _group_still_works(rank, world_size)
    return out


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _schedules(rank: int, world_size: int) -> dict:
    """Warm-up not a multiple of a period, a huge count, zero_grad(set_to_none=False), a closure."""
    from hieravg_optim import HierarchicalAveragingOptimizer
    from hieravg_optim.schedule import AveragingLevel, level_at

    levels = {2: 2, 3: world_size}
    p = nn.Parameter(torch.full((2,), float(rank)))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([p], lr=0.0), levels, warmup_steps=5)
    seen = []
    for _ in range(10):
        opt.zero_grad(set_to_none=False)
        loss = opt.step(lambda: torch.tensor(1.5))
        assert float(loss) == 1.5
        seen.append(opt.metrics()[2]["rounds"] + opt.metrics()[3]["rounds"])
    as_levels = [AveragingLevel(k, v) for k, v in levels.items()]
    expected = [sum(level_at(c, as_levels, 5) is not None for c in range(k + 1)) for k in range(10)]
    assert seen == expected, (seen, expected)  # counts 6 and 9 (all: 3 divides them), 8 (pairs); 5, 7 never
    assert seen[-1] == 3
    # A count near 2**62 keeps the schedule (no overflow in the count, the check or the schedule).
    big = 2**62 - 2**62 % 6  # divisible by 2 and 3: the top level
    opt.load_state_dict({**opt.state_dict(), "hierarchical_averaging": {"step": big}})
    p.data.fill_(float(rank))
    opt.step()
    assert opt.averaging_step == big + 1 and opt.metrics()[3]["rounds"] == 3
    assert torch.equal(p.detach(), torch.full((2,), sum(range(world_size)) / world_size))
    return {"rounds": seen}


def _bad_level_index(rank: int, world_size: int) -> list:
    """``average_now`` with an index that is not a level: a ValueError naming it and the levels, before any
    collective (the group still pairs up afterwards); a good one still averages."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    p = nn.Parameter(torch.full((2,), float(rank)))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([p], lr=0.0), {2: 2, 4: world_size})
    messages = [_raises(lambda: opt.average_now(bad), ValueError)[1] for bad in (2, -3, 1.0, True)]
    _group_still_works(rank, world_size)
    opt.average_now(-2)  # the level of period 2: pairs {0, 1}, {2, 3}
    assert torch.equal(p.detach(), torch.full((2,), float(rank // 2 * 2) + 0.5)), p
    return messages


def _core_scenarios(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    return {
        "one_rank_bad_config": _one_rank_bad_config(rank, world_size),
        "load_on_some_ranks": _load_on_some_ranks(rank, world_size),
        "bad_state_dicts": _bad_state_dicts(rank, world_size),
        "asymmetric_models": _asymmetric_models(rank, world_size),
        "aliasing_and_numerics": _aliasing_and_numerics(rank, world_size),
        "schedules": _schedules(rank, world_size),
        "bad_level_index": _bad_level_index(rank, world_size),
    }


@pytest.fixture(scope="module")
def core():
    return run_distributed(_core_scenarios, 4, timeout=240, pg_timeout=PG_TIMEOUT)


def test_config_bad_on_one_rank_raises_on_every_rank(core):
    for rank, r in enumerate(core):
        names = [name for _, name in r["one_rank_bad_config"]]
        expected = ["ValueError"] * 4 + ["TypeError", "ValueError", "RuntimeError", "UserWarning"]
        assert names == (expected if rank == 1 else ["RuntimeError"] * 8)


def test_a_level_index_that_is_no_level_is_a_value_error(core):
    for r in core:
        for got, bad in zip(r["bad_level_index"], ("2", "-3", "1.0", "True")):
            assert got == (
                f"level_index must be an integer from -2 to 1 (the levels of the periods [2, 4], -1 the top one), "
                f"got {bad}."
            ), got


def test_checkpoint_loaded_on_some_ranks_raises_at_the_first_step(core):
    assert all("rank 0 has 7" in r["load_on_some_ranks"]["message"] for r in core)


def test_malformed_averaging_state_is_a_value_error(core):
    assert len({json.dumps(r["bad_state_dicts"], sort_keys=True) for r in core}) == 1


def test_parameter_sets_differing_across_ranks_raise(core):
    for r in core:
        assert set(r["asymmetric_models"]) == {"frozen", "param_group", "dtype"}


def test_aliased_tensors_half_precision_and_nan(core):
    assert [r["aliasing_and_numerics"]["fp16"] for r in core] == [[62752.0, -65504.0]] * 4


def test_schedule_edge_cases(core):
    assert [r["schedules"]["rounds"] for r in core] == [core[0]["schedules"]["rounds"]] * 4


# --------------------------------------------------------------------------------------------------
# A rank dies mid-training
# --------------------------------------------------------------------------------------------------
def _killed_rank(rank: int, world_size: int, folder: str) -> str:
    """Rank 1 dies (os._exit) at its 4th step; rank 0 must get an error from its next collective, not hang."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    p = nn.Parameter(torch.full((3,), float(rank)))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([p], lr=0.1), {2: world_size})
    start = time.monotonic()
    try:
        for k in range(8):
            if rank == 1 and k == 3:
                os._exit(3)
            opt.step()
        outcome = {"error": None}
    except RuntimeError as err:
        outcome = {"error": str(err), "seconds": time.monotonic() - start, "step": opt.averaging_step}
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    return "done"


def test_a_dead_rank_fails_its_peers_instead_of_hanging(tmp_path):
    with pytest.raises(DistributedTestError, match="rank 1 exited with code 3"):
        run_distributed(_killed_rank, 2, str(tmp_path), timeout=120, pg_timeout=PG_TIMEOUT)
    outcome = json.loads((tmp_path / "rank0.json").read_text())
    assert outcome["error"] is not None, "rank 0 finished training although its averaging peer was dead"
    # gloo notices the closed connection at once; without that (a stalled rather than dead peer) it would be
    # the process group's timeout (README, Limitations).
    assert outcome["seconds"] < default_timeout(PG_TIMEOUT), outcome
    assert outcome["step"] == 4, outcome  # counts 0 and 2 averaged; the round at count 4 failed


# --------------------------------------------------------------------------------------------------
# DeepSpeed: the section differs across ranks
# --------------------------------------------------------------------------------------------------
def _deepspeed_asymmetric(rank: int, world_size: int, folder: str) -> dict:
    """Before: each case hung (new_group / the averager's check waiting for ranks that built other groups)."""
    import hieravg_optim.deepspeed as hds
    from tests.test_deepspeed import _client_optimizer, _config, _model

    torch.set_num_threads(1)
    base = {"period_group_size": {"2": 4}, "ranks_per_replica": 2}
    cases = {
        # "auto" resolves to LOCAL_WORLD_SIZE: nodes with different numbers of ranks
        "auto_differs": ({"period_group_size": {"2": 4}}, {"LOCAL_WORLD_SIZE": "2" if rank < 2 else "4"}),
        "bad_on_rank_1": (dict(base, warmup_steps=-1) if rank == 1 else base, {}),
        "warmup_on_rank_3": (dict(base, warmup_steps=3) if rank == 3 else base, {}),
        "string_number_on_rank_2": (dict(base, ranks_per_replica="2") if rank == 2 else base, {}),
        "disabled_on_rank_0": (dict(base, enabled=False) if rank == 0 else base, {}),
    }
    out = {}
    for label, (section, env) in cases.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        model = _model()
        try:
            hds.initialize(model=model, optimizer=_client_optimizer(model), config=_config(1, "fp32", 1, section))
            out[label] = "no error"
        except (ValueError, RuntimeError) as err:
            out[label] = f"{type(err).__name__}: {err}"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    out["missing_replica_checkpoint"] = _deepspeed_missing_replica(rank, folder)
    _group_still_works(rank, world_size)
    return out


def _deepspeed_missing_replica(rank: int, folder: str) -> str:
    """Replica 1 has no checkpoint (as when resuming with more replicas than saved): RuntimeError on every rank at
    load_checkpoint (before: DeepSpeed only logged a warning there, and replica 1 trained on from fresh weights)."""
    import shutil

    import hieravg_optim.deepspeed as hds
    from tests.test_deepspeed import _client_optimizer, _config, _micro_step, _model

    section = {"period_group_size": {"2": 4}, "ranks_per_replica": 2}

    def build():
        model = _model()
        return hds.initialize(model=model, optimizer=_client_optimizer(model), config=_config(1, "fp32", 1, section))[0]

    engine = build()
    _micro_step(engine, rank, 0)
    engine.save_checkpoint(folder, tag="t1")
    if rank == 0:
        shutil.rmtree(os.path.join(folder, "t1", "replica_1"))
    dist.barrier()
    _, message, seconds = _raises(lambda: build().load_checkpoint(folder), RuntimeError)
    assert seconds < 120, seconds
    return message


def test_deepspeed_section_differing_across_ranks_raises_on_every_rank(tmp_path):
    pytest.importorskip("deepspeed")
    results = run_distributed(_deepspeed_asymmetric, 4, str(tmp_path), timeout=300, pg_timeout=300)
    for rank, r in enumerate(results):
        auto = r["auto_differs"]
        assert auto.startswith("RuntimeError: Ranks disagree on the \"hierarchical_averaging\" section"), auto
        assert "'ranks_per_replica': 2" in auto and "'ranks_per_replica': 4" in auto, auto
        assert 'set "ranks_per_replica" explicitly' in auto, auto
        bad = r["bad_on_rank_1"]
        if rank == 1:
            assert bad.startswith('ValueError: DeepSpeed config section "hierarchical_averaging": key "warmup_steps"')
        else:
            assert bad.startswith("RuntimeError: Rank 1 failed while checking"), bad
            assert "got -1" in bad, bad
        warm = r["warmup_on_rank_3"]
        assert "'warmup_steps': 0" in warm and "'warmup_steps': 3" in warm and "rank 3" in warm, warm
        text = r["string_number_on_rank_2"]
        if rank == 2:
            assert 'key "ranks_per_replica" must be a positive integer (ranks), or "auto" or "local_world_size"' in text
            assert "got '2' (str)" in text, text
        else:
            assert text.startswith("RuntimeError: Rank 2 failed while checking"), text
        disabled = r["disabled_on_rank_0"]
        assert disabled.startswith('RuntimeError: Ranks disagree on the "hierarchical_averaging" section'), disabled
        assert "rank 0 has 'disabled', rank 1 has {'levels'" in disabled, disabled
        missing = r["missing_replica_checkpoint"]
        assert missing.startswith("Ranks disagree on whether their replica found a checkpoint under"), missing
        assert "rank 0 has True, rank 2 has False" in missing and "resume with the world size" in missing, missing


# --------------------------------------------------------------------------------------------------
# Local: numbers that compare equal must give equal configs on every rank
# --------------------------------------------------------------------------------------------------
def test_config_numbers_are_plain_python_numbers():
    """The ranks compare configs by their repr: numpy integers and int bucket sizes are normalised, so
    ``warmup_steps=np.int64(8)`` on one rank and ``8`` on another agree; an int too large for a float is a
    ValueError, not an OverflowError."""
    np = pytest.importorskip("numpy")
    from hieravg_optim.config import AveragingConfig

    a = AveragingConfig.create({np.int64(2): 2, "4": np.int32(4)}, warmup_steps=np.int64(8), bucket_cap_mb=25)
    b = AveragingConfig.create({2: 2, 4: 4}, warmup_steps=8, ranks_per_replica=np.int64(1), bucket_cap_mb=25.0)
    assert repr(a) == repr(b), (a, b)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive, finite number of MB, got inf"):
        AveragingConfig.create({2: 2}, bucket_cap_mb=10**400)
    for bad, pattern in [(4.0, "warmup_steps .*got 4.0"), ("4", "warmup_steps .*got '4'"), (None, "got None")]:
        with pytest.raises(ValueError, match=pattern):
            AveragingConfig.create({2: 2}, warmup_steps=bad)


# --------------------------------------------------------------------------------------------------
# FSDP: resuming with more replicas than were saved
# --------------------------------------------------------------------------------------------------
def _fsdp_missing_replica(rank: int, world_size: int, folder: str) -> dict:
    """Replica 1's checkpoint folder is missing (as when resuming with more replicas than saved): its ranks raise
    FileNotFoundError, replica 0's ranks a RuntimeError naming them (before: replica 0 waited in a barrier until
    the process group's timeout)."""
    import shutil

    from hieravg_optim.fsdp import (
        FSDPHierarchicalAveragingOptimizer,
        init_replicate_shard_mesh,
        load_checkpoint,
        save_checkpoint,
        shard_replica,
    )

    torch.set_num_threads(1)
    mesh = init_replicate_shard_mesh(2, "cpu")
    torch.manual_seed(0)
    model = shard_replica(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)), mesh, fsdp_version=2)
    opt = FSDPHierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, mesh, {2: 4})
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    save_checkpoint(folder, model, opt)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(folder, "replica_1"))
    dist.barrier()
    expected = FileNotFoundError if rank >= 2 else RuntimeError
    name, message, seconds = _raises(lambda: load_checkpoint(folder, model, opt), expected)
    out = {"error": name}
    assert seconds < PG_TIMEOUT / 2, seconds
    if rank < 2:
        assert message.startswith("Rank 2 failed while checking the checkpoint load (ranks [3] failed too): "), message
        assert "FileNotFoundError: No checkpoint for replica 1" in message, message
        assert "Resume with the mesh shape" in message, message
    # The adapter's settings differing across ranks: the core's agreement, on every rank.
    build = lambda **kw: FSDPHierarchicalAveragingOptimizer(  # noqa: E731
        torch.optim.SGD(model.parameters(), lr=0.1), model, mesh, {2: 4}, **kw
    )
    bad_cap = {"bucket_cap_mb": -1.0} if rank == 3 else {}
    _, message, _ = _raises(lambda: build(**bad_cap), ValueError if rank == 3 else RuntimeError)
    assert "bucket_cap_mb must be a positive, finite number of MB, got -1.0" in message, message
    out["bad_cap"] = message
    _, message, _ = _raises(lambda: build(warmup_steps=rank), RuntimeError)
    assert "Ranks disagree on the averaging config" in message and "'warmup_steps': 1" in message, message
    _group_still_works(rank, world_size)
    return out


def test_fsdp_resume_with_a_missing_replica_raises_on_every_rank(tmp_path):
    results = run_distributed(_fsdp_missing_replica, 4, str(tmp_path), timeout=180, pg_timeout=PG_TIMEOUT)
    assert [r["error"] for r in results] == ["RuntimeError"] * 2 + ["FileNotFoundError"] * 2
    assert [r["bad_cap"].startswith("Rank 3 failed while checking") for r in results] == [True] * 3 + [False]


def test_agreement_signature_cache_is_the_signature_of_the_tensors_now():
    """The agreement caches each (shape, dtype, strides) list's signature: a tensor resized in place, a view that
    overlaps itself or another dtype is a new key, whose signature and digest are those computed from scratch."""
    from hieravg_optim.agreement import _digest_text, _signature_with_repr, digest, tensor_signature

    t = torch.zeros(3, 4)
    cases = [[t, torch.zeros(5)], [t.t(), torch.zeros(5)], [t, torch.zeros(5).expand(2, 5)], [t.half(), torch.zeros(5)]]
    context = {"step count": 7}
    for tensors in cases + cases:  # the second pass reads the cache
        signature, text = _signature_with_repr(tensors)
        assert signature == tensor_signature(tensors) and text == repr(signature)
        assert _digest_text(f"[{context!r}, {text}]") == digest([context, tensor_signature(tensors)])
    before = _signature_with_repr([t])[0]
    t.resize_(2, 6)
    assert _signature_with_repr([t])[0] == [((2, 6), "float32")] != before

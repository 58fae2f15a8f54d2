"""Faults on 4 real gloo ranks with 2 levels ({1: 2, 2: 4}): a rank killed (SIGKILL) or stopped (SIGSTOP)
during an averaging round, and a replica holding NaN or infinities under each ``nonfinite`` policy.

In the fault tests one rank injects its own fault at a chosen round, after that round's agreement check
(its peers are then inside the averaging all-reduce): it records the time and kills or stops itself. Every
survivor records when it raised and with what message, then exits non-zero (the harness's child exits 1 on
an exception). The test checks every survivor's exit code, message and delay; a rank that hangs is a
failure (killed at the test's deadline).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

import pytest
import torch
from torch import nn

from tests.harness import default_timeout, mp_context, run_distributed, run_scenarios, start_ranks, wait_for_survivors

WORLD = 4
LEVELS = {1: 2, 2: 4}  # count 1, 3, ...: pairs {0, 1} and {2, 3}; count 0, 2, ...: all four ranks
pytestmark = pytest.mark.timeout(default_timeout(240))

BOUND_S = 10.0
"""Survivors must raise within the collective timeout plus this, after the fault."""


# -- a dead or hung peer ---------------------------------------------------------------------------
def _train_until_fault(
    rank: int, world_size: int, victim: int, fault: str, count: int, timeout_s: float, out: str, sharded: bool
):
    """Step until the fault; the victim injects it at the round of step count ``count``: after the round's
    agreement or, ``sharded`` (2 replicas of 2 shards, one level of 4), before its replica's finiteness check."""
    from hieravg_optim import HierarchicalAveragingOptimizer
    from hieravg_optim import round_start as round_start_module
    from hieravg_optim import rounds as averager_module

    param = nn.Parameter(torch.full((1000,), float(rank)))
    opt = HierarchicalAveragingOptimizer(
        torch.optim.SGD([param], lr=0.0), {1: WORLD} if sharded else LEVELS, collective_timeout_s=timeout_s,
        ranks_per_replica=2 if sharded else 1,
    )  # fmt: skip
    if rank == victim:
        # The replica's finiteness vote runs in round_start (the start every round shares); the all-reduce in rounds.
        averager_module = round_start_module if sharded else averager_module
        name = "replica_any" if sharded else "average_tensors_"
        original = getattr(averager_module, name)

        def faulty(*args, **kwargs):
            if opt.averager.step == count:  # the round's agreement is done: the peers are all-reducing
                with open(os.path.join(out, "fault.json"), "w") as f:
                    json.dump({"t": time.monotonic()}, f)
                os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            return original(*args, **kwargs)

        setattr(averager_module, name, faulty)
    try:
        for _ in range(count + 4):
            opt.step()
    except RuntimeError as exc:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"t": time.monotonic(), "message": str(exc), "type": type(exc).__name__, "cause": repr(exc.__cause__)}, f)
        raise
    raise AssertionError(f"rank {rank} finished {count + 4} steps without noticing the fault")


def _run_fault(fault: str, victim: int, count: int, timeout_s: float, sharded: bool = False) -> dict[int, dict]:
    """Spawn the 4 ranks, wait for every survivor to exit, then kill the victim. Returns what each survivor saw."""
    ctx = mp_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hieravg-faults-") as tmp:
        args = (victim, fault, count, timeout_s, tmp, sharded)
        procs = start_ranks(ctx, _train_until_fault, WORLD, os.path.join(tmp, "rendezvous"), args, results, 60.0)
        survivors = [r for r in range(WORLD) if r != victim]
        deadline = time.monotonic() + default_timeout(60.0) + timeout_s + BOUND_S
        hung = wait_for_survivors(procs, survivors, deadline)
        assert not hung, f"ranks {hung} still running {deadline:.0f} s after the start: they hang after the {fault}"
        assert os.path.exists(os.path.join(tmp, "fault.json")), "the victim never reached the round"
        with open(os.path.join(tmp, "fault.json")) as f:
            fault_t = json.load(f)["t"]
        seen = {}
        for r in survivors:
            path = os.path.join(tmp, f"rank{r}.json")
            assert os.path.exists(path), f"rank {r} exited with code {procs[r].exitcode} without a RuntimeError"
            with open(path) as f:
                seen[r] = json.load(f)
            seen[r]["delay"] = seen[r]["t"] - fault_t
            seen[r]["exitcode"] = procs[r].exitcode
        return seen


def _check_survivors(seen: dict[int, dict], rounds: dict[int, tuple[str, list[int]]], timeout_s: float) -> None:
    print("delays after the fault, s:", {r: round(s["delay"], 2) for r, s in seen.items()})
    for r, (round_name, ranks) in rounds.items():
        s = seen[r]
        assert s["exitcode"] == 1, (r, s)
        assert s["type"] == "CollectiveError", (r, s)
        assert round_name in s["message"], (r, s["message"])
        assert f"in the group of ranks {ranks}" in s["message"], (r, s["message"])
        assert "dead or hung peer" in s["message"] and "out of step" in s["message"], (r, s["message"])
        assert "RuntimeError" in s["cause"], (r, s["cause"])  # chained to gloo's error
        assert s["delay"] <= timeout_s + BOUND_S, (r, s["delay"], s["message"])


def test_killed_rank_at_the_lower_level():
    """Rank 0 dies in the pair round {0, 1}: rank 1 raises at once; ranks 2 and 3 at their next round with it."""
    seen = _run_fault("kill", victim=0, count=1, timeout_s=5.0)
    _check_survivors(
        seen,
        {
            1: ("the averaging round at step 1 (period 1, group size 2)", [0, 1]),
            2: ("the averaging round at step 2 (period 2, group size 4)", [0, 1, 2, 3]),
            3: ("the averaging round at step 2 (period 2, group size 4)", [0, 1, 2, 3]),
        },
        timeout_s=5.0,
    )
    assert "Connection" in seen[1]["message"], seen[1]["message"]  # gloo's closed or reset connection
    assert seen[1]["delay"] < 5.0, seen[1]  # a dead peer is seen at once, not at the timeout


def test_killed_rank_at_the_top_level():
    seen = _run_fault("kill", victim=3, count=2, timeout_s=5.0)
    top = ("the averaging round at step 2 (period 2, group size 4)", [0, 1, 2, 3])
    _check_survivors(seen, {0: top, 1: top, 2: top}, timeout_s=5.0)


def test_stopped_rank_is_reported_at_the_collective_timeout():
    """A hung peer (SIGSTOP: alive, connections open) is seen only at collective_timeout_s, by every survivor."""
    timeout_s = 3.0
    seen = _run_fault("stop", victim=2, count=2, timeout_s=timeout_s)
    top = ("the averaging round at step 2 (period 2, group size 4)", [0, 1, 2, 3])
    _check_survivors(seen, {0: top, 1: top, 3: top}, timeout_s=timeout_s)
    first = min(s["delay"] for s in seen.values())
    assert first >= timeout_s - 1.0, seen  # not before the timeout (minus the time between agreement and stop)
    assert any("within the group's timeout of 3 s" in s["message"] for s in seen.values()), seen


def test_stopped_rank_of_a_sharded_replica_is_named_with_its_replica():
    """ranks_per_replica=2: rank 1 hangs before its replica's finiteness check (over {0, 1}), which runs before
    the round's agreement (over the shard groups {0, 2} and {1, 3}). Rank 0 names the replica's ranks [0, 1], where
    the hung peer is, not its shard group; ranks 2 and 3 name their shard groups."""
    timeout_s = 3.0
    seen = _run_fault("stop", victim=1, count=0, timeout_s=timeout_s, sharded=True)
    round_name = "the averaging round at step 0 (period 1, group size 4)"
    _check_survivors(seen, {0: (round_name, [0, 1]), 2: (round_name, [0, 2]), 3: (round_name, [1, 3])}, timeout_s)
    assert "the agreement of the replica's ranks on whether it is finite, before" in seen[0]["message"], seen[0]


# -- collective_timeout_s and nonfinite, in one world ----------------------------------------------
def _opt(rank: int, tensors: list[torch.Tensor], **kwargs):
    from hieravg_optim import HierarchicalAveragingOptimizer

    params = [nn.Parameter(t) for t in tensors]
    return HierarchicalAveragingOptimizer(torch.optim.SGD(params, lr=0.0), LEVELS, **kwargs), params


def _values(rank: int) -> list[torch.Tensor]:
    """A bucketed tensor, a transposed (non-contiguous) one and one of 4 MiB, averaged in place without a copy."""
    v = 2.0 * rank + 2.0  # 2, 4, 6, 8
    return [torch.full((5,), v), torch.full((3, 4), v).t(), torch.full((1 << 20,), v)]


def _scenario_timeouts(rank: int):
    from hieravg_optim.groups import process_group_timeout

    opt, _ = _opt(rank, _values(rank))
    pair, top = opt.averager.level_groups
    assert process_group_timeout(pair.group).total_seconds() == 60.0  # the process group's, not gloo's 30 min
    assert top.group is torch.distributed.group.WORLD
    opt, _ = _opt(rank, _values(rank), collective_timeout_s=7)
    pair, top = opt.averager.level_groups
    assert process_group_timeout(pair.group).total_seconds() == 7.0
    assert top.group is not torch.distributed.group.WORLD  # a group of its own, with the timeout
    assert process_group_timeout(top.group).total_seconds() == 7.0
    # The largest timeout accepted works with gloo (9.2e9 s hung its all-reduce, 9.3e9 s timed it out at once).
    opt, params = _opt(rank, _values(rank), collective_timeout_s=1e9)
    opt.step()  # count 0, top level: 5
    assert all(torch.equal(p, torch.full_like(p, 5.0)) for p in params)


def _scenario_bad_timeout_on_one_rank(rank: int):
    from hieravg_optim import HierarchicalAveragingOptimizer

    param = nn.Parameter(torch.zeros(3))
    try:
        HierarchicalAveragingOptimizer(
            torch.optim.SGD([param], lr=0.1), LEVELS, collective_timeout_s=0 if rank == 2 else 5.0
        )
    except ValueError as exc:
        assert rank == 2 and "collective_timeout_s" in str(exc) and "got 0 (int)" in str(exc), exc
    except RuntimeError as exc:
        assert rank != 2 and "Rank 2 failed" in str(exc) and "collective_timeout_s" in str(exc), exc
    else:
        raise AssertionError("no error for collective_timeout_s=0 on rank 2")


def _poison(rank: int, params, bad: dict[int, float]) -> None:
    if rank in bad:
        for p in params:
            p.data[(-1,) * p.dim()] = bad[rank]  # the last element


def _expect_nonfinite_error(opt, rank: int, raising: set[int], named: str) -> None:
    try:
        opt.step()
    except RuntimeError as exc:
        assert rank in raising, (rank, exc)
        assert "Non-finite values" in str(exc) and named in str(exc), exc
    else:
        assert rank not in raising, f"rank {rank}: no error"


def _scenario_raise(rank: int):
    opt, params = _opt(rank, _values(rank))
    opt.step()  # count 0: top level, all finite: mean 5
    _poison(rank, params, {1: float("nan")})
    # Count 1: the pair {0, 1} raises on both ranks, naming rank 1; the pair {2, 3} averages.
    _expect_nonfinite_error(opt, rank, {0, 1}, "rank [1] (replica [1])")
    if rank in (2, 3):
        assert all(torch.equal(p, torch.full_like(p, 5.0)) for p in params)
    elif rank == 0:
        assert all(torch.equal(p, torch.full_like(p, 5.0)) for p in params)  # untouched


def _scenario_skip_replica(rank: int):
    opt, params = _opt(rank, _values(rank), nonfinite="skip_replica")
    _poison(rank, params, {2: float("nan")})
    opt.step()  # count 0, top level: the mean of ranks 0, 1, 3, given to rank 2 too
    expected = torch.tensor(2.0 + 4.0 + 8.0) / 3
    for p in params:
        assert torch.equal(p, expected.expand_as(p)), (rank, p.view(-1)[:3], p.view(-1)[-1])
    for p in params:
        p.data.fill_(2.0 * rank + 2.0)
    _poison(rank, params, {1: float("inf"), 2: float("-inf"), 3: float("nan")})
    # Count 1, pairs: {0, 1} gives rank 1 rank 0's values; {2, 3} has no finite replica and raises.
    _expect_nonfinite_error(opt, rank, {2, 3}, "ranks [2, 3] (replicas [2, 3])")
    if rank in (0, 1):
        assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in params), rank
    opt, params = _opt(rank, _values(rank), nonfinite="skip_replica")  # ranks 2, 3 did not count the failed step
    _poison(rank, params, {0: float("nan"), 2: float("inf")})
    opt.averager.average(-1, params)  # top level: the mean of ranks 1 and 3
    assert all(torch.equal(p, torch.full_like(p, 6.0)) for p in params), rank


def _scenario_sharded_replica(rank: int):
    """ranks_per_replica=2: replicas {0, 1} and {2, 3}; shard 0 is averaged by ranks {0, 2}, shard 1 by
    {1, 3}. A NaN in one shard of a replica decides for the whole replica, in both shard subgroups."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    def make(nonfinite: str):
        param = nn.Parameter(torch.full((3,), 2.0 * rank + 2.0))  # 2, 4, 6, 8
        opt = HierarchicalAveragingOptimizer(
            torch.optim.SGD([param], lr=0.0), {1: WORLD}, ranks_per_replica=2, nonfinite=nonfinite
        )
        return opt, param

    opt, param = make("skip_replica")
    _poison(rank, [param], {0: float("nan")})  # replica 0, shard 0
    opt.step()
    # Replica 0 is skipped in both shard subgroups: every rank takes replica 1's shard (6 or 8),
    # not the mean 6 of shard 1 over both replicas on ranks 1 and 3.
    assert torch.equal(param, torch.full((3,), 6.0 if rank % 2 == 0 else 8.0)), (rank, param)
    opt, param = make("raise")
    _poison(rank, [param], {1: float("inf")})  # replica 0, shard 1
    # Every rank raises, those of shard 0 too: none averages while the others stop.
    _expect_nonfinite_error(opt, rank, {0, 1, 2, 3}, "(replica [0])")
    assert torch.equal(param[:2], torch.full((2,), 2.0 * rank + 2.0)), (rank, param)


def _scenario_ignore(rank: int):
    opt, params = _opt(rank, _values(rank), nonfinite="ignore")
    _poison(rank, params, {3: float("nan")})
    opt.step()  # count 0, top level: NaN everywhere, as without a check
    assert all(bool(p[(-1,) * p.dim()].isnan()) for p in params)
    assert torch.equal(params[0][:-1], torch.full((4,), 5.0))


def _scenario_out_of_step(rank: int):
    """Rank 0 skips count 1: it waits in the top round of count 2, rank 1 in the pair round of count 1; the
    ranks 2 and 3 finish their pair round and wait in the top round without rank 1. Everyone raises at the
    timeout, naming its round. Last scenario: the subgroups are unusable afterwards."""
    from hieravg_optim.faults import CollectiveError

    opt, _ = _opt(rank, _values(rank), collective_timeout_s=3)
    opt.step()  # count 0, top level: together
    if rank == 0:
        opt.averager.step += 1
    start = time.monotonic()
    try:
        opt.step()
        opt.step()
    except CollectiveError as exc:
        seconds = time.monotonic() - start
        expected = "step 1 (period 1, group size 2)" if rank == 1 else "step 2 (period 2, group size 4)"
        assert expected in str(exc) and "out of step" in str(exc), (rank, exc)
        assert 2.0 <= seconds <= 3 + BOUND_S, (rank, seconds)
    else:
        raise AssertionError(f"rank {rank}: no CollectiveError although rank 0 skipped a step")


def _run_all(rank: int, world_size: int) -> dict:
    return run_scenarios(
        {
            "timeouts": _scenario_timeouts,
            "bad_timeout_on_one_rank": _scenario_bad_timeout_on_one_rank,
            "raise": _scenario_raise,
            "skip_replica": _scenario_skip_replica,
            "ignore": _scenario_ignore,
            "sharded_replica": _scenario_sharded_replica,
            "out_of_step": _scenario_out_of_step,  # last: leaves its subgroups unusable
        },
        rank,
    )


def test_timeouts_and_nonfinite_policies():
    run_distributed(_run_all, WORLD, timeout=180, pg_timeout=60)



# -- what a skipped replica carries into the next round ---------------------------------------------
def _scenario_nan_anchor_is_skipped(rank: int):
    """A NaN taken into an anchor at the end of the warm-up (no synchronous warm-up), on rank 1, whose tensors the
    pair round then makes finite: the top level's first round averages the anchors and would spread the NaN to
    every rank. Rank 1 is skipped there instead: anchors and tensors are the means of ranks 0, 2 and 3."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    param = nn.Parameter(torch.full((3,), 3.0 * rank + 1.0))  # 1, 4, 7, 10
    opt = HierarchicalAveragingOptimizer(
        torch.optim.SGD([param], lr=0.0), {1: 2, 4: 4}, warmup_steps=3, nonfinite="skip_replica",
        outer_optimizers={4: lambda anchors: torch.optim.SGD(anchors, lr=0.5)},
    )  # fmt: skip
    opt.step()
    opt.step()  # counts 0, 1: warm-up, no round
    _poison(rank, [param], {1: float("nan")})
    opt.step()  # count 2: the anchors are taken: 1, [4, 4, NaN], 7, 10
    opt.step()  # count 3, pairs: rank 1 gets rank 0's 1; ranks 2 and 3 average to 8.5
    assert torch.equal(param, torch.full((3,), 1.0 if rank < 2 else 8.5)), (rank, param)
    param.data.fill_([2.0, 100.0, 8.0, 14.0][rank])  # finite everywhere; rank 1's must not count
    opt.step()  # count 4, top level with the outer optimizer
    # Anchors: the mean of 1, 7, 10 is 6; tensors: the mean of 2, 8, 14 is 8; SGD(lr=0.5): 6 - 0.5 (6 - 8) = 7.
    anchors = opt.state_dict()["hierarchical_averaging"]["outer"][4]["anchors"]
    assert torch.equal(param, torch.full((3,), 7.0)), (rank, param)
    assert torch.equal(anchors[0], torch.full((3,), 7.0)), (rank, anchors)
    assert opt.averager.replaced_at_step == (4 if rank == 1 else None)


def _scenario_skipped_replica_state_is_repaired(rank: int):
    """A NaN gradient on rank 3 reaches SGD's momentum buffer. The top round gives rank 3 the mean of ranks 0, 1
    and 2 and zeroes the NaN of its momentum buffer, so the next step (a pair round) averages rank 3 in, instead of
    the buffer making it non-finite, and skipped, at every round from then on."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    param = nn.Parameter(torch.full((4,), 2.0 * rank + 2.0))  # 2, 4, 6, 8
    inner = torch.optim.SGD([param], lr=0.5, momentum=0.5)
    opt = HierarchicalAveragingOptimizer(inner, LEVELS, nonfinite="skip_replica")
    param.grad = torch.ones(4)
    if rank == 3:
        param.grad[0] = float("nan")
    opt.step()  # count 0: 1.5, 3.5, 5.5 and [NaN, 7.5, ...]; top level: the mean of ranks 0-2, 3.5
    assert torch.equal(param, torch.full((4,), 3.5)), (rank, param)
    buffer = inner.state[param]["momentum_buffer"]
    assert torch.equal(buffer, torch.tensor([0.0 if rank == 3 else 1.0, 1.0, 1.0, 1.0])), (rank, buffer)
    param.grad = torch.ones(4)
    opt.step()  # count 1: buffer 1.5 (rank 3's first element: 1), param 2.75 (3.0); pairs average
    expected = torch.full((4,), 2.75)
    if rank >= 2:
        expected[0] = (2.75 + 3.0) / 2
    assert torch.equal(param, expected), (rank, param)
    assert opt.averager.replaced_at_step == (0 if rank == 3 else None)
    adam_param = nn.Parameter(torch.full((4,), float(rank)))
    adam = HierarchicalAveragingOptimizer(torch.optim.Adam([adam_param], lr=0.1), LEVELS, nonfinite="skip_replica")
    for count in range(4):
        adam_param.grad = torch.ones(4)
        if rank == 1 and count == 0:
            adam_param.grad[2] = float("inf")
        adam.step()
    state = adam.optimizer.state[adam_param]
    assert all(bool(torch.isfinite(state[name]).all()) for name in ("exp_avg", "exp_avg_sq")), (rank, state)
    assert adam.averager.replaced_at_step == (0 if rank == 1 else None)  # skipped once, not at every round


def _scenario_callback_raising_on_one_rank(rank: int):
    """``tensors_to_average`` raises on rank 2 only (a master weight missing from its optimizer state): at the
    pair round of count 1 ranks 2 and 3 raise at once (rank 2 its KeyError, rank 3 a RuntimeError naming it), not
    rank 3 at the timeout; ranks 0 and 1 average. At the end of a warm-up with an outer optimizer (anchors taken
    from the same callback), every rank raises."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    param = nn.Parameter(torch.full((2,), float(rank)))
    masters = {"w": param.detach()}
    fail = {"now": False}

    def tensors():
        return [masters["missing" if fail["now"] and rank == 2 else "w"]]

    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([param], lr=0.0), LEVELS, tensors_to_average=tensors)
    opt.step()  # count 0: all four, mean 1.5
    fail["now"] = True
    start = time.monotonic()
    try:
        opt.step()  # count 1: pairs
    except KeyError:
        assert rank == 2
    except RuntimeError as exc:
        assert rank == 3 and "Rank 2 failed" in str(exc) and "KeyError" in str(exc), (rank, exc)
    else:
        assert rank in (0, 1), f"rank {rank}: no error"
    assert time.monotonic() - start < 10.0, (rank, time.monotonic() - start)  # the process group's timeout is 60 s
    assert torch.equal(param, torch.full((2,), 1.5)), (rank, param)
    fail["now"] = False
    param2 = nn.Parameter(torch.full((2,), float(rank)))
    masters["w"] = param2.detach()
    outer = HierarchicalAveragingOptimizer(
        torch.optim.SGD([param2], lr=0.0), LEVELS, warmup_steps=2, tensors_to_average=tensors,
        outer_optimizers={2: lambda anchors: torch.optim.SGD(anchors, lr=1.0)},
    )  # fmt: skip
    outer.step()  # count 0: warm-up
    fail["now"] = True
    try:
        outer.step()  # count 1: the anchors are taken
    except KeyError:
        assert rank == 2
    except RuntimeError as exc:
        assert rank != 2 and "Rank 2 failed" in str(exc) and "taking the anchors" in str(exc), (rank, exc)
    else:
        raise AssertionError(f"rank {rank}: no error")


def _scenario_float8(rank: int):
    """float8 parameters average through a float32 wire (gloo cannot sum float8), and their NaN are checked."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    param = nn.Parameter(torch.full((3,), rank + 1.0).to(torch.float8_e4m3fn), requires_grad=False)
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([param], lr=0.0), LEVELS, average_frozen=True)
    opt.step()  # count 0: the mean of 1, 2, 3, 4
    assert torch.equal(param.float(), torch.full((3,), 2.5)), (rank, param)
    _poison(rank, [param], {3: float("nan")})
    _expect_nonfinite_error(opt, rank, {2, 3}, "rank [3] (replica [3])")  # count 1: the pair {2, 3}


def _scenario_reload_after_raise(rank: int):
    """The guard raises on the pair {0, 1} at count 1 (after their inner step, uncounted); the pair {2, 3} averages
    and counts. The state dicts saved then still load; every rank loads the checkpoint of count 1 and training
    continues in step, to exact values."""
    import copy

    from hieravg_optim import HierarchicalAveragingOptimizer

    param = nn.Parameter(torch.full((3,), 2.0 * rank + 2.0))  # 2, 4, 6, 8
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([param], lr=0.5), LEVELS)
    param.grad = torch.ones(3)
    opt.step()  # count 0: 1.5, 3.5, 5.5, 7.5; top level: 4.5
    checkpoint = (param.detach().clone(), copy.deepcopy(opt.state_dict()))
    if rank == 0:
        param.grad[1] = float("inf")
    _expect_nonfinite_error(opt, rank, {0, 1}, "rank [0] (replica [0])")  # count 1: 4.0, [4.0, -inf, 4.0] on rank 0
    after = opt.state_dict()
    assert after["step"] == (1 if rank < 2 else 2), (rank, after["step"])
    assert torch.equal(param, torch.tensor([4.0, -float("inf"), 4.0]) if rank == 0 else torch.full((3,), 4.0))
    HierarchicalAveragingOptimizer(torch.optim.SGD([param], lr=0.5), LEVELS).load_state_dict(after)  # it loads
    with torch.no_grad():
        param.copy_(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    for _ in range(3):  # counts 1, 2, 3: 4.0, 3.5, 3.0, averaged at each
        param.grad = torch.ones(3)
        opt.step()
    assert torch.equal(param, torch.full((3,), 3.0)) and opt.averaging_step == 4, (rank, param, opt.averaging_step)


def _run_skipped(rank: int, world_size: int) -> dict:
    return run_scenarios(
        {
            "nan_anchor": _scenario_nan_anchor_is_skipped,
            "inner_state": _scenario_skipped_replica_state_is_repaired,
            "float8": _scenario_float8,
            "reload_after_raise": _scenario_reload_after_raise,
            "callback_raising_on_one_rank": _scenario_callback_raising_on_one_rank,  # last: pairs out of step after
        },
        rank,
    )


def test_a_skipped_replica_carries_finite_anchors_and_optimizer_state_and_local_failures_raise_everywhere():
    run_distributed(_run_skipped, WORLD, timeout=120, pg_timeout=60)


# -- local checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "30", True, 1e9 + 1, 9.2e9, 1e300])
def test_bad_collective_timeout(value):
    from hieravg_optim import HierarchicalAveragingOptimizer

    with pytest.raises(ValueError, match=r"collective_timeout_s must be a positive, finite number of seconds") as info:
        HierarchicalAveragingOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), {1: 1},
                                       collective_timeout_s=value)  # fmt: skip
    assert f"got {value!r}" in str(info.value)


def test_bad_nonfinite():
    from hieravg_optim.deepspeed.section import parse_section

    from hieravg_optim import HierarchicalAveragingOptimizer

    with pytest.raises(ValueError, match=r"nonfinite must be one of \['raise', 'skip_replica', 'ignore'\], got 'skip'"):
        HierarchicalAveragingOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), {1: 1}, nonfinite="skip")
    with pytest.raises(ValueError, match=r'key "nonfinite" must be one of'):
        parse_section({"period_group_size": {"2": 4}, "nonfinite": None})
    with pytest.raises(ValueError, match=r'key "collective_timeout_s" must be a positive number of seconds'):
        parse_section({"period_group_size": {"2": 4}, "collective_timeout_s": -5})
    with pytest.raises(ValueError, match=r'key "collective_timeout_s" must be .* at most 1e\+09.*got 9200000000.0'):
        parse_section({"period_group_size": {"2": 4}, "collective_timeout_s": 9.2e9})  # hangs gloo's all-reduce
    settings = parse_section({"period_group_size": {"2": 4}, "collective_timeout_s": 20, "nonfinite": "skip_replica"})
    config = settings.averaging_config(ranks_per_replica=1)
    assert (config.collective_timeout_s, config.nonfinite) == (20.0, "skip_replica")


def test_backend_failures_are_told_from_the_agreement_errors():
    from hieravg_optim.faults import CollectiveError, is_backend_failure

    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer."
    assert is_backend_failure(RuntimeError(gloo))
    assert is_backend_failure(RuntimeError("[.../unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation"))
    assert not is_backend_failure(CollectiveError(gloo))  # wrapped once only
    assert not is_backend_failure(ValueError("Timed out"))
    # The agreement check's own error, quoting another rank's error that reads like the backend's:
    assert not is_backend_failure(RuntimeError(f"Rank 2 failed while checking the averaging config: {gloo}"))


def test_has_nonfinite():
    from hieravg_optim.agreement import has_nonfinite

    nan, inf = float("nan"), float("inf")
    big = torch.full((4,), 3e38)  # its sum and its squares overflow float32: finite all the same
    wide = torch.full((100,), 60000.0, dtype=torch.float16)  # its sum and 2-norm (6e6, 6e5) are beyond float16's range
    assert not has_nonfinite([big, wide, torch.zeros(0), torch.tensor([1e19, 3e19], dtype=torch.bfloat16)])
    assert not has_nonfinite([big.to(torch.bfloat16), big.double() ** 8])  # sums beyond bfloat16's and float64's range
    assert has_nonfinite([torch.tensor([float("inf"), -float("inf")])])  # opposite infinities: a NaN sum
    assert has_nonfinite([big, torch.tensor([1.0, nan])])
    assert has_nonfinite([torch.tensor([-inf], dtype=torch.bfloat16)])
    assert has_nonfinite([wide, torch.tensor([1.0, inf], dtype=torch.float16)])
    assert has_nonfinite([torch.tensor([1.0, nan], dtype=torch.float64)])
    assert has_nonfinite([torch.tensor([1 + 1j, complex(0, nan)])])
    assert not has_nonfinite([torch.tensor([1 + 1j, 2j])])
    assert has_nonfinite([torch.tensor([[1.0, nan], [1.0, 2.0]]).t()])  # not contiguous
    assert not has_nonfinite([torch.arange(20.0).view(4, 5).t()[1:]])
    assert has_nonfinite([torch.ones(8) for _ in range(50)] + [torch.tensor([inf])] + [torch.ones(8)])
    assert has_nonfinite([torch.nn.Parameter(torch.tensor([nan, 1.0]))])  # requires grad: no graph built
    assert not has_nonfinite([torch.arange(3)])  # integer tensors are never averaged
    assert not has_nonfinite([torch.full((3,), 448.0).to(torch.float8_e4m3fn), torch.ones(2, dtype=torch.float8_e5m2)])
    assert has_nonfinite([torch.tensor([1.0, nan]).to(torch.float8_e4m3fn)])
    assert has_nonfinite([torch.tensor([1.0, -inf]).to(torch.float8_e5m2)])


def test_zero_nonfinite_state():
    from hieravg_optim.inner import zero_nonfinite_state

    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    inner = torch.optim.Adam([a, b], lr=0.1)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    inner.step()
    assert zero_nonfinite_state(inner) == []
    inner.state[b]["exp_avg_sq"][1] = float("inf")
    inner.state[a]["exp_avg"][0] = float("nan")
    step = inner.state[a]["step"].clone()
    assert zero_nonfinite_state(inner) == ["state[0]['exp_avg']", "state[1]['exp_avg_sq']"]
    assert torch.equal(inner.state[a]["exp_avg"], torch.tensor([0.0, 0.1, 0.1]))
    assert torch.equal(inner.state[b]["exp_avg_sq"], torch.tensor([0.001, 0.0], dtype=torch.bfloat16))
    assert torch.equal(inner.state[a]["step"], step)


def test_deepspeed_initialize_keywords_are_checked_before_any_collective():
    """Without torch.distributed initialized, the keyword's error is raised as is, before DeepSpeed runs."""
    import hieravg_optim.deepspeed as hds

    model = nn.Linear(2, 2)
    section = {"period_group_size": {"2": 4}, "ranks_per_replica": 1, "nonfinite": "ignore"}
    config = {"train_micro_batch_size_per_gpu": 1, "hierarchical_averaging": section}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r'initialize\(nonfinite=\'raise\'\) differs from the "hierarchical_averaging"'):
        hds.initialize(model=model, optimizer=opt, config=config, nonfinite="raise")
    with pytest.raises(ValueError, match=r'key "collective_timeout_s" must be a positive number of seconds.*got 0'):
        hds.initialize(model=model, optimizer=opt, config=config, collective_timeout_s=0)
    with pytest.raises(ValueError, match=r"collective_timeout_s=5 given to initialize\(\), but the config has no enabled"):
        hds.initialize(model=model, optimizer=opt, config={"train_micro_batch_size_per_gpu": 1}, collective_timeout_s=5)

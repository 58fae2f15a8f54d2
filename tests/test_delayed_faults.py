"""Faults during a delayed round (4 gloo ranks, ``{4: 4}``, ``delay_steps`` 2): a peer killed (SIGKILL) or stopped
(SIGSTOP) while the round is in flight, and a non-finite replica at its start under each ``nonfinite`` policy.

The victim injects its fault as the round started at count 4 copies its tensors, after the round's agreement (its
peers then issue their background all-reduces and step on). Every survivor raises where the round is waited for, at count
6: a ``CollectiveError`` naming the round, its delay and the count it was waited for at, within
``collective_timeout_s`` (plus a bound) after the fault.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

import pytest
import torch

from tests.harness import default_timeout, mp_context, run_distributed, start_ranks, wait_for_survivors

WORLD = 4
BOUND_S = 10.0
pytestmark = pytest.mark.timeout(default_timeout(240))


def _until_fault(rank, world_size, victim, fault, timeout_s, out):
    from hieravg_optim import AveragingConfig, HierarchicalAverager, HierarchicalAveragingOptimizer
    from hieravg_optim import delayed as delayed_module
    from hieravg_optim.compression import delayed as compressed_module

    fault, _, where = fault.partition("-")
    at = 4
    if where == "node_aware":  # int8, 2 nodes of 2: the victim dies in the apply's all-gather inside its node (count 6)
        averager = HierarchicalAverager(AveragingConfig.create(
            {4: WORLD}, delay_steps=2, compress="int8", ranks_per_node=2, collective_timeout_s=timeout_s))  # fmt: skip
        tensors = [torch.full((1000,), float(rank))]
        averager.take_anchors(tensors)
        step = lambda: averager.step_and_average(lambda: tensors)  # noqa: E731
        module, name, at = compressed_module, "node_mean", 6
    elif where == "compressed_buffers":  # int8 and a buffer, averaged synchronously (uncompressed) at the start
        p = torch.nn.Parameter(torch.full((1000,), float(rank)))
        opt = HierarchicalAveragingOptimizer(torch.optim.SGD([p], lr=0.0), {4: WORLD}, delay_steps=2, compress="int8",
                                             buffers=[torch.full((5,), float(rank))], collective_timeout_s=timeout_s)  # fmt: skip
        averager, step = opt.averager, opt.step
        module, name = compressed_module, "average_tensors_"
    else:
        averager = HierarchicalAverager(
            AveragingConfig.create({4: WORLD}, delay_steps=2, collective_timeout_s=timeout_s)
        )
        tensors = [torch.full((1000,), float(rank))]
        step = lambda: averager.step_and_average(lambda: tensors)  # noqa: E731
        module, name = delayed_module, "pack_copies"
    if rank == victim:
        original = getattr(module, name)

        def faulty(*args, **kwargs):
            if averager.step == at:  # the round of count 4 has agreed: its peers issue their async all-reduces
                with open(os.path.join(out, "fault.json"), "w") as f:
                    json.dump({"t": time.monotonic()}, f)
                os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            return original(*args, **kwargs)

        setattr(module, name, faulty)
    try:
        for _ in range(12):
            step()
    except RuntimeError as exc:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"t": time.monotonic(), "message": str(exc), "type": type(exc).__name__, "step": averager.step}, f)
        raise
    raise AssertionError(f"rank {rank} finished 12 steps without noticing the fault")


def _run_fault(fault, victim, timeout_s):
    ctx = mp_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hieravg-delayed-faults-") as tmp:
        args = (victim, fault, timeout_s, tmp)
        procs = start_ranks(ctx, _until_fault, WORLD, os.path.join(tmp, "rendezvous"), args, results, 60.0)
        survivors = [r for r in range(WORLD) if r != victim]
        deadline = time.monotonic() + default_timeout(60.0) + timeout_s + BOUND_S
        try:
            hung = wait_for_survivors(procs, survivors, deadline)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
        assert not hung, f"ranks {hung} hang after the {fault}"
        with open(os.path.join(tmp, "fault.json")) as f:
            fault_t = json.load(f)["t"]
        seen = {}
        for r in survivors:
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                seen[r] = json.load(f)
            seen[r]["delay"] = seen[r]["t"] - fault_t
            seen[r]["exitcode"] = procs[r].exitcode
        return seen


@pytest.mark.parametrize(
    "fault, timeout_s", [("kill", 5.0), ("stop", 4.0), ("kill-compressed_buffers", 5.0), ("kill-node_aware", 5.0)]
)
def test_a_peer_lost_during_a_round_in_flight_is_named_where_it_is_waited_for(fault, timeout_s):
    """``kill-compressed_buffers``: the victim dies in the buffers' synchronous average at the start of a compressed
    delayed round (count 4), where the survivors raise, naming the round too. ``kill-node_aware``: a node-aware
    compressed round (2 nodes of 2), the victim (rank 2) dies in the all-gather inside its node that assembles the
    mean at count 6: its node's peer raises there, naming the round; the other node, whose apply needs no rank of
    the victim's node, at the next round's start (count 8)."""
    seen = _run_fault(fault, victim=2, timeout_s=timeout_s)
    print("delays after the fault, s:", {r: round(s["delay"], 2) for r, s in seen.items()})
    if fault.endswith("node_aware"):
        for r, s in seen.items():
            assert s["exitcode"] == 1 and s["type"] == "CollectiveError", (r, s)
            named = "the averaging round at step 4 (period 4, group size 4, delayed 2 steps) (applied at step 6)"
            if r != 3:
                named = "the averaging round at step 8 (period 4, group size 4, delayed 2 steps)"
            assert named in s["message"] and "dead or hung peer" in s["message"], (r, s["message"])
            assert s["step"] == (6 if r == 3 else 8) and s["delay"] <= timeout_s + BOUND_S, (r, s)
        return
    at_start = fault.endswith("compressed_buffers")
    where = "" if at_start else " (waited for at step 6)"
    for r, s in seen.items():
        assert s["exitcode"] == 1 and s["type"] == "CollectiveError", (r, s)
        assert f"the averaging round at step 4 (period 4, group size 4, delayed 2 steps){where}" in (
            s["message"]
        ), s["message"]
        assert "in the group of ranks [0, 1, 2, 3]" in s["message"] and "dead or hung peer" in s["message"]
        assert s["step"] == (4 if at_start else 6), s  # raised in that count's step, before the count advanced
        assert s["delay"] <= timeout_s + BOUND_S, s


def _nonfinite(rank, world_size):
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    out = {}
    for policy in ("raise", "skip_replica"):
        averager = HierarchicalAverager(AveragingConfig.create({4: world_size}, delay_steps=2, nonfinite=policy))
        tensors = [torch.full((6,), 3.0 * rank)]  # the finite replicas' mean (0 + 6 + 9) / 3 = 5 is exact
        if rank == 1:
            tensors[0][2] = float("nan")
        try:
            averager.step_and_average(lambda: tensors)  # count 0: the round's start checks and agrees
            out[policy] = "started"
        except RuntimeError as exc:
            out[policy] = str(exc)
            continue
        if rank == 1:
            tensors[0].fill_(100.0)  # the replaced replica's later progress is not kept
        for _ in range(2):
            with torch.no_grad():
                tensors[0] += 1.0
            averager.step_and_average(lambda: tensors)
        finite = [r for r in range(world_size) if r != 1]
        mean = sum(3.0 * r for r in finite) / len(finite)
        expected = torch.full((6,), mean) if rank == 1 else torch.full((6,), mean + 2.0)
        out[policy] = torch.equal(tensors[0], expected) and averager.replaced_at_step == (2 if rank == 1 else None)
    return out


def test_nonfinite_policies_at_the_start_of_a_delayed_round():
    results = run_distributed(_nonfinite, WORLD, timeout=120)
    for r in results:
        assert "Non-finite values" in r["raise"] and "rank [1] (replica [1])" in r["raise"], r
        assert r["skip_replica"] is True, r

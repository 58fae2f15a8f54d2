"""Every process group the package creates or communicates over has the user's timeout, on every layout.

The timeout is ``collective_timeout_s`` where it is set, else the process group's
(``init_process_group(timeout=...)``); ``torch.distributed.new_group`` and ``init_device_mesh`` alone
give torch's default for the backend (30 min on gloo). The first test reads the timeout of every group
the core, the DeepSpeed mpu and the FSDP mesh hold, exactly. The second stops one rank of a sharded
replica (SIGSTOP: alive, its connections open) before its forward pass, on the core, DeepSpeed ZeRO-1,
FSDP1 and FSDP2 (2 replicas of 2 shards, one level of 4 ranks): every other rank must raise within the
timeout plus ``BOUND_S``, those in the averaging round naming its level.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import warnings

import pytest
import torch
from torch import nn

from tests.harness import default_timeout, mp_context, run_distributed, start_ranks, wait_for_survivors

pytestmark = pytest.mark.timeout(default_timeout(400))

WORLD = 4
PG_TIMEOUT_S = 60.0
"""The process group's timeout in these tests (the harness's); gloo's default would be 1800 s."""
BOUND_S = 10.0
"""Survivors must raise within the timeout plus this, after the fault."""


def _seconds(group) -> float:
    from hieravg_optim.groups import process_group_timeout

    return process_group_timeout(group).total_seconds()


def _every_group(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from hieravg_optim import HierarchicalAveragingOptimizer
    from hieravg_optim.deepspeed.mpu import ReplicaParallelUnit
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh, shard_replica
    from hieravg_optim.fsdp.mesh import mesh_timeouts
    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {}
    for timeout_s in (None, 7.0):
        expected = PG_TIMEOUT_S if timeout_s is None else timeout_s
        # Sharded replicas (a level group and a replica group), and node-aware levels (node groups).
        for settings in (
            {"ranks_per_replica": 2, "nonfinite": "raise"},
            {"ranks_per_replica": 2, "nonfinite": "ignore"},
            {"ranks_per_node": 2},
        ):
            param = nn.Parameter(torch.zeros(4))
            levels = {1: 2, 2: 4} if "ranks_per_node" in settings else {2: 4}
            opt = HierarchicalAveragingOptimizer(
                torch.optim.SGD([param], lr=0.1), levels, collective_timeout_s=timeout_s, **settings
            )
            av = opt.averager
            groups = [lg.group for lg in av.level_groups if lg.group is not None]
            groups += [g for lg in av.level_groups if lg.node for g in (lg.node.local, lg.node.cross) if g]
            groups += [av.timed_process_group]
            if "ranks_per_replica" in settings:
                # Also with nonfinite="ignore": the adapters' checkpoints use it.
                groups.append(av.replica_group)
            else:
                assert av.level_groups[-1].node is not None
            assert all(_seconds(g) == expected for g in groups), [_seconds(g) for g in groups]
            assert len(groups) == (3 if "ranks_per_replica" in settings else 5), len(groups)
        mpu = ReplicaParallelUnit(2, timeout_s=timeout_s)
        assert _seconds(mpu.get_data_parallel_group()) == expected  # DeepSpeed reduces gradients over it
        assert _seconds(mpu.get_model_parallel_group()) == expected
        mesh = init_replicate_shard_mesh(2, "cpu", timeout_s=timeout_s)
        assert mesh_timeouts(mesh) == {"replicate": expected, "shard": expected}, mesh_timeouts(mesh)
        assert mesh["shard"].get_group().size() == 2 and mesh.get_local_rank("replicate") == rank // 2
        assert mesh["replicate"].get_group().size() == 2 and mesh.get_local_rank("shard") == rank % 2
        model = shard_replica(nn.Linear(4, 4), mesh, fsdp_version=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            FSDPHierarchicalAveragingOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model, mesh, {2: 4}, collective_timeout_s=timeout_s
            )
        assert not [w for w in caught if "timeout" in str(w.message)]  # the mesh's groups have the timeout
    # A mesh of init_device_mesh keeps torch's default (30 min on gloo): the adapter warns, naming the fix.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_replica(nn.Linear(4, 4), mesh, fsdp_version=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = FSDPHierarchicalAveragingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, mesh, {2: 4}, collective_timeout_s=5
        )
    messages = [str(w.message) for w in caught if "timeout" in str(w.message)]
    assert len(messages) == 2, messages  # one per mesh dimension
    assert all("1800 s, longer than the averaging's 5 s" in m for m in messages), messages
    assert all("init_replicate_shard_mesh(shards_per_replica, timeout_s=5)" in m for m in messages), messages
    # The averaging itself never waits on the mesh's groups: its own replica group has the timeout.
    assert _seconds(opt.averager.replica_group) == 5.0 and _seconds(opt.averager.timed_process_group) == 5.0
    dist.barrier()
    out["ok"] = True
    return out


def test_every_group_has_the_users_timeout():
    results = run_distributed(_every_group, WORLD, timeout=240.0, pg_timeout=PG_TIMEOUT_S)
    assert all(r["ok"] for r in results)


# -- a hung rank of a sharded replica, on every layout --------------------------------------------
def _build(layout: str, rank: int, timeout_s: float | None):
    """The model step of ``layout`` over 2 replicas of 2 shards, averaging every step over the 4 ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if layout == "core":
        from hieravg_optim import HierarchicalAveragingOptimizer

        opt = HierarchicalAveragingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), {1: WORLD}, ranks_per_replica=2,
            collective_timeout_s=timeout_s,
        )  # fmt: skip

        def step(x):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

        return step, opt.averager
    if layout == "deepspeed":
        import hieravg_optim.deepspeed as hds

        section = {"period_group_size": {"1": WORLD}, "ranks_per_replica": 2, "collective_timeout_s": timeout_s}
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": 1},
            "hierarchical_averaging": section,
        }
        engine, *_ = hds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config)

        def step(x):
            engine.backward(engine(x).pow(2).mean())
            engine.step()

        return step, hds.get_averaging(engine).averager
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh, shard_replica

    mesh = init_replicate_shard_mesh(2, "cpu", timeout_s=timeout_s)
    model = shard_replica(model, mesh, fsdp_version=1 if layout == "fsdp1" else 2)
    opt = FSDPHierarchicalAveragingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model, mesh, {1: WORLD}, collective_timeout_s=timeout_s
    )

    def step(x):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step, opt.averager


def _train_until_stopped(rank: int, world_size: int, layout: str, timeout_s: float | None, victim: int, out: str):
    step, averager = _build(layout, rank, timeout_s)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    try:
        for count in range(5):
            if rank == victim and count == 2:
                with open(os.path.join(out, "fault.json"), "w") as f:
                    json.dump({"t": time.monotonic()}, f)
                os.kill(os.getpid(), signal.SIGSTOP)  # before the forward: its replica peer waits inside the replica
            step(x)
    except RuntimeError as exc:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"t": time.monotonic(), "message": str(exc), "type": type(exc).__name__, "step": averager.step}, f)
        raise
    raise AssertionError(f"rank {rank} finished 5 steps without noticing the stopped rank {victim}")


def _run(layout: str, timeout_s: float | None, pg_timeout_s: float, victim: int = 1) -> dict[int, dict]:
    ctx = mp_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hieravg-timeouts-") as tmp:
        args = (layout, timeout_s, victim, tmp)
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = start_ranks(ctx, _train_until_stopped, WORLD, rendezvous, args, results, pg_timeout_s)
        survivors = [r for r in range(WORLD) if r != victim]
        limit = timeout_s if timeout_s is not None else pg_timeout_s
        deadline = time.monotonic() + default_timeout(90.0) + limit + BOUND_S
        hung = wait_for_survivors(procs, survivors, deadline)
        assert not hung, f"{layout}: ranks {hung} still running at the deadline: they wait longer than the timeout"
        if not os.path.exists(os.path.join(tmp, "fault.json")):
            reports = []
            while not results.empty():
                reports.append(results.get())
            raise AssertionError(f"{layout}: the stopped rank never reached its step: {reports[:1]}")
        with open(os.path.join(tmp, "fault.json")) as f:
            fault_t = json.load(f)["t"]
        seen = {}
        for r in survivors:
            path = os.path.join(tmp, f"rank{r}.json")
            assert os.path.exists(path), f"{layout}: rank {r} exited with code {procs[r].exitcode} without an error"
            with open(path) as f:
                seen[r] = json.load(f)
            seen[r]["delay"] = seen[r]["t"] - fault_t
            seen[r]["exitcode"] = procs[r].exitcode
        return seen


@pytest.mark.parametrize(
    "layout, timeout_s, pg_timeout_s",
    [
        ("core", 3.0, PG_TIMEOUT_S),
        # Without collective_timeout_s: the process group's timeout; the mpu's groups had gloo's 30 min.
        ("deepspeed", None, 20.0),
        ("deepspeed", 3.0, PG_TIMEOUT_S),
        # FSDP reduces gradients over the mesh's groups: init_replicate_shard_mesh gives them the timeout.
        ("fsdp1", 3.0, PG_TIMEOUT_S),
        ("fsdp2", 3.0, PG_TIMEOUT_S),
    ],
)
def test_a_hung_rank_of_a_replica_is_reported_within_the_timeout(layout, timeout_s, pg_timeout_s):
    seen = _run(layout, timeout_s, pg_timeout_s)
    limit = timeout_s if timeout_s is not None else pg_timeout_s
    print(layout, "delays after the stop, s:", {r: round(s["delay"], 2) for r, s in seen.items()})
    for r, s in seen.items():
        assert s["exitcode"] == 1, (layout, r, s)
        assert s["delay"] <= limit + BOUND_S, (layout, r, s["delay"], s["message"])
    # Rank 3 averages with the stopped rank 1 (the same shard of the other replica): it waits in the round.
    assert seen[3]["type"] == "CollectiveError", seen[3]
    assert "(period 1, group size 4)" in seen[3]["message"], seen[3]["message"]
    assert f"timeout of {limit:g} s" in seen[3]["message"], seen[3]["message"]

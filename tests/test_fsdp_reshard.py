"""FSDP2 resumes on another mesh shape through DCP's resharding, on 2 real gloo ranks.

Saved on 2 replicas x 1 shard (``replica_0``, ``replica_1``), loaded on 1 replica x 2 shards: the one replica
reads ``replica_0``, resharded over its 2 ranks, exactly: parameters, Adam's moments and the count. Loaded on
more replicas than were saved: a ``FileNotFoundError`` naming the missing replica, on every rank (a
``RuntimeError`` naming it on the others). And an LR scheduler is built before ``load_checkpoint``: built after
it with ``last_epoch`` set, it raises ``KeyError: 'initial_lr'``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import default_timeout, run_distributed

WORLD = 2
LEVELS = {3: 2}
STOP = 5  # saved at count 5: averaged at count 3 (warm-up 1), the replicas differ again after count 4
pytestmark = pytest.mark.timeout(default_timeout(300))


def _build(mesh):
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, shard_replica

    torch.manual_seed(0)
    model = shard_replica(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1)), mesh, fsdp_version=2)
    inner = torch.optim.Adam(model.parameters(), lr=0.05)
    with warnings.catch_warnings():  # one replica (1 x 2) never averages: warned, expected here
        warnings.filterwarnings("ignore", message="ranks_per_replica=2 is the size of the process group")
        return model, FSDPHierarchicalAveragingOptimizer(inner, model, mesh, LEVELS, warmup_steps=1)


def _train(model, opt, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + step)  # different data per replica
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _full_state(model, opt) -> list[list[float]]:
    """The replica's full parameters and Adam moments (collective over its shard group)."""
    out = []
    for p in model.parameters():
        out.append(p.full_tensor().flatten().tolist())
        for key in ("exp_avg", "exp_avg_sq"):
            out.append(opt.state[p][key].full_tensor().flatten().tolist())
    return out


def _reshard(rank: int, world_size: int, folder: str) -> dict:
    from hieravg_optim.fsdp import init_replicate_shard_mesh, load_checkpoint, save_checkpoint

    assert world_size == WORLD
    mesh_2x1 = init_replicate_shard_mesh(1, "cpu")
    mesh_1x2 = init_replicate_shard_mesh(2, "cpu")
    model, opt = _build(mesh_2x1)
    _train(model, opt, rank, 0, STOP)
    saved = _full_state(model, opt)
    save_checkpoint(folder, model, opt)
    all_saved = [None] * WORLD
    dist.all_gather_object(all_saved, saved)
    del model, opt

    model, opt = _build(mesh_1x2)
    load_checkpoint(folder, model, opt)
    loaded = _full_state(model, opt)
    count = opt.averaging_step
    _train(model, opt, rank, STOP, STOP + 1)  # the resumed run steps on (count 5 does not average)

    # Back to 2 replicas x 1 shard from a checkpoint of 1 replica: replica_1 is missing.
    model, opt = _build(mesh_1x2)
    other = os.path.join(folder, "one_replica")
    save_checkpoint(other, model, opt)
    model, opt = _build(mesh_2x1)
    try:
        load_checkpoint(other, model, opt)
        error = None
    except Exception as exc:  # noqa: BLE001 - returned to the parent, compared there
        error = (type(exc).__name__, str(exc))
    return {
        "replicas_differed": all_saved[0] != all_saved[1],
        "loaded_is_replica_0": loaded == all_saved[0],
        "count": count,
        "error": error,
    }


def _scheduler_order(folder: str) -> dict:
    """An LR scheduler built before ``load_checkpoint`` resumes; built after it with ``last_epoch``, it cannot:
    DCP restores the parameter groups without ``initial_lr`` (docs/fsdp.md, Checkpoints)."""
    from hieravg_optim.fsdp import init_replicate_shard_mesh, load_checkpoint, save_checkpoint

    mesh = init_replicate_shard_mesh(1, "cpu")
    model, opt = _build(mesh)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for step in range(2):
        _train(model, opt, dist.get_rank(), step, step + 1)
        scheduler.step()
    save_checkpoint(folder, model, opt)
    saved = scheduler.state_dict()

    model, opt = _build(mesh)
    before = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # built first, then loaded
    load_checkpoint(folder, model, opt)
    before.load_state_dict(saved)
    lrs = [before.get_last_lr()[0], opt.param_groups[0]["lr"]]

    model, opt = _build(mesh)
    load_checkpoint(folder, model, opt)
    try:
        torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5, last_epoch=saved["last_epoch"])
        after = None
    except KeyError as exc:
        after = str(exc)
    return {"lrs": lrs, "after": after}


def _run(rank: int, world_size: int, folder: str) -> dict:
    return {
        "reshard": _reshard(rank, world_size, os.path.join(folder, "reshard")),
        "scheduler": _scheduler_order(os.path.join(folder, "scheduler")),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_run, WORLD, str(tmp_path_factory.mktemp("ckpt")), timeout=240)


def test_scheduler_is_built_before_load_checkpoint(results):
    for r in results:
        assert r["scheduler"]["lrs"] == [0.0125, 0.0125]  # 0.05 halved twice, restored
        assert "initial_lr" in r["scheduler"]["after"]


def test_fsdp2_resumes_from_2x1_on_1x2_and_refuses_more_replicas(results):
    results = [r["reshard"] for r in results]
    for rank, r in enumerate(results):
        assert r["replicas_differed"], rank
        assert r["loaded_is_replica_0"], f"rank {rank}: the loaded state is not replica 0's"
        assert r["count"] == STOP
    kind, message = results[1]["error"]
    assert kind == "FileNotFoundError" and "No checkpoint for replica 1" in message, results[1]["error"]
    kind, message = results[0]["error"]
    assert kind == "RuntimeError" and "Rank 1 failed" in message, results[0]["error"]

"""The DeepSpeed adapter's ``load_checkpoint`` on every resume path, on real engines: 4 ranks as 2 replicas of 2.

* The averaging count equals ``engine.global_steps`` after every load, and stays so while training: a full
  load (both restored from the checkpoint), ``load_optimizer_states=False`` (the same), and
  ``load_module_only=True``, where DeepSpeed keeps the engine's ``global_steps`` and its optimizer, so the
  averaging state is not loaded either (the engine's step wins; with outer optimizers, anchors are taken
  again at the loaded weights), on a fresh engine (0) and on one that has trained (3).
* A load that fails on some ranks (one rank's outer optimizer state file missing, or DeepSpeed's own load
  raising in one replica: its model states file truncated) leaves every rank's averaging state as it was
  (the count, the anchors), and raises on every rank: those ranks their own error, the others a
  ``RuntimeError`` naming them. The next load of an intact checkpoint then resumes every rank.
"""

from __future__ import annotations

import os

import pytest

from tests.harness import run_distributed, run_scenarios

deepspeed = pytest.importorskip("deepspeed")

WORLD = 4
S = 2  # ranks per replica

pytestmark = pytest.mark.timeout(600)


def _engine(outer: bool = False):
    import torch

    import hieravg_optim.deepspeed as hds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    section = {"period_group_size": {"2": WORLD}, "ranks_per_replica": S}
    if outer:
        section["outer_optimizer"] = {"2": {"type": "SGD", "params": {"lr": 0.7, "momentum": 0.9}}}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "hierarchical_averaging": section,
    }
    engine, *_ = hds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config)
    return engine, hds.get_averaging(engine)


def _train(engine, rank: int, steps: int) -> None:
    import torch

    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + engine.global_steps + i))
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _weights(engine) -> list:
    return [p.detach().clone() for p in engine.module.parameters()]


def _folder(name: str) -> str:
    return os.path.join(os.environ["HIERAVG_TEST_TMP"], name)


def _resume_paths(rank: int) -> dict:
    import torch

    folder = _folder("paths")
    engine, averaging = _engine()
    _train(engine, rank, 3)
    engine.save_checkpoint(folder)
    saved = _weights(engine)
    out = {}
    for name, kwargs in {
        "full": {},
        "no_optimizer_states": {"load_optimizer_states": False},
        "module_only": {"load_module_only": True},
    }.items():
        fresh, state = _engine()
        fresh.load_checkpoint(folder, **kwargs)
        loaded = (fresh.global_steps, state.averager.step)
        assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), saved)), name
        _train(fresh, rank, 3)  # two rounds (count 3 and 5, or 0 and 2): the counts agree across ranks
        out[name] = {"loaded": loaded, "trained": (fresh.global_steps, state.averager.step)}
    # load_module_only on an engine that has trained: its global_steps (3) stays, and so does the count.
    engine.load_checkpoint(folder, load_module_only=True)
    out["module_only_running"] = {"loaded": (engine.global_steps, averaging.averager.step)}
    _train(engine, rank, 2)
    out["module_only_running"]["trained"] = (engine.global_steps, averaging.averager.step)
    # With outer optimizers: the anchors are taken again at the loaded weights, not kept from before the load.
    engine, averaging = _engine(outer=True)
    _train(engine, rank, 3)
    engine.save_checkpoint(folder + "_outer")
    fresh, state = _engine(outer=True)
    before = [a.clone() for a in state.averager._outer[0].anchors]
    fresh.load_checkpoint(folder + "_outer", load_module_only=True)
    after = state.averager._outer[0].anchors
    masters = state.tensors_to_average()
    out["module_only_outer"] = {
        "loaded": (fresh.global_steps, state.averager.step),
        "anchors_at_loaded_masters": all(torch.equal(a, m.float()) for a, m in zip(after, masters)),
        "anchors_changed": any(not torch.equal(a, b) for a, b in zip(after, before)),
    }
    _train(fresh, rank, 2)
    out["module_only_outer"]["trained"] = (fresh.global_steps, state.averager.step)
    return out


def _failed_load(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from hieravg_optim.deepspeed import outer_state_file

    folder = _folder("failing")
    engine, averaging = _engine(outer=True)
    _train(engine, rank, 2)
    engine.save_checkpoint(folder, tag="t2")
    _train(engine, rank, 1)  # count 3: a load that succeeded would bring the count back to 2
    engine.save_checkpoint(folder, tag="t3")
    out = {}
    tag_dir = os.path.join(folder, "t2", f"replica_{rank // S}")
    if rank == 3:
        os.remove(outer_state_file(tag_dir, rank % S))
    dist.barrier()
    anchors = [a.clone() for a in averaging.averager._outer[0].anchors]
    try:
        engine.load_checkpoint(folder, tag="t2")
    except (RuntimeError, FileNotFoundError) as exc:
        out["missing_file"] = f"{type(exc).__name__}: {exc}"
    out["missing_file_state"] = (
        averaging.averager.step,
        all(torch.equal(a, b) for a, b in zip(averaging.averager._outer[0].anchors, anchors)),
    )
    # DeepSpeed's own load failing in replica 1 (its model states file truncated), before the averaging's part.
    if rank == 2:
        path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    try:
        engine.load_checkpoint(folder, tag="t2")
    except Exception as exc:  # noqa: BLE001 - torch.load's error on replica 1, a RuntimeError elsewhere
        out["deepspeed_error"] = f"{type(exc).__name__}: {exc}"
    out["deepspeed_error_state"] = averaging.averager.step
    # The process group is still usable: an intact checkpoint loads on every rank, and training goes on.
    engine.load_checkpoint(folder, tag="t3")
    _train(engine, rank, 1)
    out["after"] = (engine.global_steps, averaging.averager.step)
    return out


def _all(rank: int, world_size: int) -> dict:
    return run_scenarios({"resume_paths": _resume_paths, "failed_load": _failed_load}, rank)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_load")
    return run_distributed(_all, WORLD, timeout=500.0, env={"HIERAVG_TEST_TMP": str(tmp)})


def test_the_count_follows_the_engines_step_on_every_resume_path(results):
    for r in results:
        paths = r["resume_paths"]
        assert paths["full"] == {"loaded": (3, 3), "trained": (6, 6)}, paths
        assert paths["no_optimizer_states"] == {"loaded": (3, 3), "trained": (6, 6)}, paths
        assert paths["module_only"] == {"loaded": (0, 0), "trained": (3, 3)}, paths
        assert paths["module_only_running"] == {"loaded": (3, 3), "trained": (5, 5)}, paths
        outer = paths["module_only_outer"]
        assert outer["loaded"] == (0, 0) and outer["trained"] == (2, 2), outer
        assert outer["anchors_at_loaded_masters"] and outer["anchors_changed"], outer


def test_a_load_that_fails_on_one_rank_changes_no_ranks_averaging_state(results):
    for rank, r in enumerate(results):
        failed = r["failed_load"]
        if rank == 3:
            assert failed["missing_file"].startswith("FileNotFoundError") and "is missing" in failed["missing_file"]
        else:
            assert failed["missing_file"].startswith("RuntimeError") and "Rank 3 failed" in failed["missing_file"]
        assert failed["missing_file_state"] == (3, True), failed  # not the checkpoint's 2, anchors as they were
        if rank // S == 1:
            assert "Rank" not in failed["deepspeed_error"], failed  # torch.load's own error
        else:
            assert failed["deepspeed_error"].startswith("RuntimeError: Rank 2 failed"), failed
            assert "(ranks [3] failed too)" in failed["deepspeed_error"], failed
        assert failed["deepspeed_error_state"] == 3, failed
        assert failed["after"] == (4, 4), failed

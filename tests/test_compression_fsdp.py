"""Compressed rounds on FSDP: real FSDP1 (``use_orig_params`` False and True) and FSDP2 replicas on a 2 x 2
(replicate x shard) gloo mesh, one spawn of 4 ranks.

* A lossless codec (top-k of density 1, float32 values) gives the plain average after every round (1e-6, against
  the same model averaged without compress), the replicas bitwise equal.
* Error-feedback residuals are shaped like the local shards (some uneven, some empty under FSDP2).
* A DCP resume of int8 with error feedback under Nesterov, saved while the replicas differ, equals the
  uninterrupted run (1e-6); the residuals are restored exactly, saved as DTensors with the shards' layouts.
* The same with ``delay_steps=2``, saved while a compressed round is in flight (its gathered payloads go into
  the replica's checkpoint with the round): the resumed run applies it at its count and equals the
  uninterrupted one (1e-6).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed, run_scenarios
from tests.test_fsdp import _flat, _full_params, _gather, _shard, _train_step

pytestmark = pytest.mark.timeout(900)

WORLD = 4
SHARDS = 2
CONFIGS = ["fsdp1", "fsdp1_orig", "fsdp2"]
PERIOD = 3
LOSSLESS = {"type": "topk", "density": 1.0, "chunk": 8, "values": "float32"}


def _build(config: str, mesh, **settings):
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer

    model = _shard(config, mesh)
    opt = FSDPHierarchicalAveragingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1), model, mesh, {PERIOD: WORLD}, **settings
    )
    return model, opt


def _lossless(rank: int) -> dict:
    from hieravg_optim.fsdp import init_replicate_shard_mesh

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    out = {}
    for config in CONFIGS:
        model, opt = _build(config, mesh, compress=LOSSLESS)
        plain, plain_opt = _build(config, mesh)
        rounds = []
        for step in range(7):  # rounds at counts 0, 3 and 6
            _train_step(model, opt, rank, step)
            _train_step(plain, plain_opt, rank, step)
            if step % PERIOD == 0:
                full, reference = _flat(_full_params(model)), _flat(_full_params(plain))
                everyone = _gather(full)
                rounds.append((float((full - reference).abs().max()), all(torch.equal(t, everyone[0]) for t in everyone)))
        residuals = opt.averager.state_dict()["outer"][PERIOD]["residuals"]
        out[config] = {
            "rounds": rounds,
            "residual_shapes": [tuple(r.shape) for r in residuals],
            "local_shapes": [tuple(t.shape) for t in opt.tensors_to_average()],
        }
    return out


def _resume(rank: int, folder: str, delay: int = 0) -> dict:
    from hieravg_optim import nesterov_outer
    from hieravg_optim.fsdp import init_replicate_shard_mesh, load_checkpoint, save_checkpoint

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    settings = dict(compress="int8", ef_decay=0.9, outer_optimizers={PERIOD: nesterov_outer()}, delay_steps=delay)
    # Rounds at counts 0, 3, 6 and 9. Synchronous: saved after count 4. Delayed by 2: saved after count 6, whose
    # round is in flight then (applied at 8).
    total, stop = 11, 7 if delay else 5
    out = {}
    for config in CONFIGS:
        model, opt = _build(config, mesh, **settings)
        for step in range(total):
            _train_step(model, opt, rank, step)
        straight = _flat(_full_params(model))
        model, opt = _build(config, mesh, **settings)
        for step in range(stop):
            _train_step(model, opt, rank, step)
        saved = [r.clone() for r in opt.averager.state_dict()["outer"][PERIOD]["residuals"]]
        saved_params = _gather(_flat(_full_params(model)))
        path = os.path.join(folder, f"{config}")
        save_checkpoint(path, model, opt)
        del model, opt
        model, opt = _build(config, mesh, **settings)
        load_checkpoint(path, model, opt)
        rounds = opt.averager._delayed  # None without a delay
        in_flight = {li: (r.started, r.apply_at) for li, r in (rounds.in_flight.items() if rounds else ())}
        # state_dict() holds the residuals themselves: compare before the next round changes them.
        loaded = opt.averager.state_dict()["outer"][PERIOD].get("residuals", [])
        restored = len(loaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(saved, loaded))
        for step in range(stop, total):
            _train_step(model, opt, rank, step)
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(os.path.join(path, "replica_0")).read_metadata().state_dict_metadata
        out[config] = {
            "residual_keys": sorted(k for k in metadata if "/residuals/" in k),
            "differed_at_save": not torch.equal(saved_params[0], saved_params[SHARDS]),
            "restored": restored,
            "nonzero": any(bool(r.abs().sum() > 0) for r in saved),
            "max_diff": float((_flat(_full_params(model)) - straight).abs().max()),
            "in_flight_at_load": in_flight,
        }
    return out


def _scenarios(rank: int, world_size: int, folder: str) -> dict:
    return run_scenarios(
        {"lossless": _lossless, "resume": lambda r: _resume(r, folder),
         "resume_in_flight": lambda r: _resume(r, os.path.join(folder, "delayed"), delay=2)},
        rank,
    )  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_scenarios, WORLD, str(tmp_path_factory.mktemp("compress_fsdp")), timeout=800)


@pytest.mark.parametrize("config", CONFIGS)
def test_lossless_compressed_rounds_are_plain_averaging(results, config):
    for rank, r in enumerate(results):
        c = r["lossless"][config]
        assert len(c["rounds"]) == 3, (rank, c)
        assert all(diff <= 1e-6 and same for diff, same in c["rounds"]), (rank, c["rounds"])
        assert c["residual_shapes"] == c["local_shapes"], (rank, c)


@pytest.mark.parametrize("delayed", [False, True], ids=["synchronous", "in_flight"])
@pytest.mark.parametrize("config", CONFIGS)
def test_dcp_resume_with_residuals_equals_uninterrupted(results, config, delayed):
    for rank, r in enumerate(results):
        c = r["resume_in_flight" if delayed else "resume"][config]
        # Delayed: the round of count 6 was in flight at the save, and is again after the load (lands at 8).
        assert c["in_flight_at_load"] == ({0: (6, 8)} if delayed else {}), (rank, c)
        assert c["differed_at_save"] and c["nonzero"], (rank, c)
        assert c["restored"], (rank, c)
        # Sharded like the anchors: one DTensor per averaged tensor, both shards of a replica in it.
        assert c["residual_keys"] and all(k.startswith(f"outer.dtensors.{PERIOD}/residuals/") for k in c["residual_keys"])
        assert c["max_diff"] <= 1e-6, (rank, c)

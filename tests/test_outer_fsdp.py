"""Outer optimizers on FSDP: real FSDP1 / FSDP2 replicas on a 2 x 2 (replicate x shard) gloo mesh.

One spawn of 4 ranks runs every case, on FSDP1 with ``use_orig_params`` False and True and on
FSDP2 (``fully_shard`` over ``mesh["shard"]`` of the 2-D ``(replicate, shard)`` mesh). The tiny
model of ``tests/test_fsdp.py`` has parameters of 12, 3, 3 and 1 elements, so over 2 shards
some FSDP2 local shards are uneven and some empty.

* Outer ``SGD(lr=1, momentum=0)`` gives the plain average after every round.
* Outer Nesterov (lr 0.7, momentum 0.9) over 3 rounds equals ``torch.optim.SGD`` run in the test
  on the replicas' full (gathered) parameters; the replicas are identical after every round.
* Each rank's anchors have the shapes of its local shards.
* A checkpoint whose anchors are not float32, or fewer than the tensors averaged (saved with a
  parameter frozen), is a ``ValueError`` at load time, found in DCP's metadata before its load, on
  every rank; nothing is changed.
* A DCP resume (outer momentum state included, saved while the replicas differ) equals the
  uninterrupted run; the anchors of the two shards of a replica are both in the checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed, run_scenarios
from tests.test_fsdp import _flat, _full_params, _gather, _shard, _train_step

pytestmark = pytest.mark.timeout(600)

WORLD = 4
SHARDS = 2
CONFIGS = ["fsdp1", "fsdp1_orig", "fsdp2"]
PERIOD = 3
LEVELS = {PERIOD: WORLD}  # both replicas average every 3 steps
ATOL = 1e-6


def _build(config: str, mesh, outer, warmup_steps: int = 0):
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer

    model = _shard(config, mesh)
    opt = FSDPHierarchicalAveragingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1),
        model,
        mesh,
        LEVELS,
        warmup_steps=warmup_steps,
        outer_optimizers=None if outer is None else {PERIOD: outer},
    )
    return model, opt


def _sgd_lr1(tensors):
    return torch.optim.SGD(tensors, lr=1.0, momentum=0.0)


def _replicas_identical(full: torch.Tensor) -> bool:
    everyone = _gather(full)
    return all(torch.equal(t, everyone[0]) for t in everyone)


# -- outer SGD(lr=1) is plain averaging; anchors are sharded like the parameters -------------------------------------
def _plain_equivalence(rank: int) -> dict:
    from hieravg_optim.fsdp import init_replicate_shard_mesh

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    out = {}
    for config in CONFIGS:
        model, opt = _build(config, mesh, _sgd_lr1)
        plain, plain_opt = _build(config, mesh, None)
        local_shapes = [tuple(t.shape) for t in opt.tensors_to_average()]
        anchors = opt.averager.state_dict()["outer"][PERIOD]["anchors"]
        rounds = []
        for step in range(7):  # rounds at counts 0, 3 and 6
            _train_step(model, opt, rank, step)
            _train_step(plain, plain_opt, rank, step)
            if step % PERIOD == 0:
                full, reference = _flat(_full_params(model)), _flat(_full_params(plain))
                anchors = opt.averager.state_dict()["outer"][PERIOD]["anchors"]
                rounds.append(
                    dict(
                        max_diff=float((full - reference).abs().max()),
                        identical=_replicas_identical(full),
                        # After a round the parameters are the new anchors.
                        anchors_are_params=all(
                            torch.equal(a, t.float()) for a, t in zip(anchors, opt.tensors_to_average())
                        ),
                    )
                )
        out[config] = dict(
            rounds=rounds,
            local_shapes=local_shapes,
            anchor_shapes=[tuple(a.shape) for a in anchors],
            anchor_dtypes=sorted({str(a.dtype) for a in anchors}),
            full_numel=sum(p.numel() for p in _full_params(model)),
            metrics=opt.metrics()[PERIOD],
        )
    return out


# -- Nesterov against torch.optim.SGD on the full parameters ---------------------------------------------------------
def _nesterov_reference(rank: int) -> dict:
    from hieravg_optim import nesterov_outer
    from hieravg_optim.fsdp import init_replicate_shard_mesh

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    out = {}
    for config in CONFIGS:
        model, opt = _build(config, mesh, nesterov_outer(lr=0.7, momentum=0.9))
        # The reference: one full fp32 anchor, taken at construction (after the broadcast from replica 0).
        ref_anchor = _flat(_full_params(model))
        ref_opt = torch.optim.SGD([ref_anchor], lr=0.7, momentum=0.9, nesterov=True)
        captured: dict[str, torch.Tensor] = {}
        handle = opt.optimizer.register_step_post_hook(
            lambda optimizer, args, kwargs: captured.__setitem__("before", _flat(_full_params(model)))
        )
        rounds = []
        for step in range(7):  # rounds at counts 0, 3 and 6
            _train_step(model, opt, rank, step)
            if step % PERIOD == 0:
                before = _gather(captured["before"])  # every replica's full parameters after the inner step
                mean = (before[0] + before[SHARDS]) / 2
                ref_anchor.grad = ref_anchor - mean
                ref_opt.step()
                full = _flat(_full_params(model))
                rounds.append(
                    dict(
                        max_diff=float((full - ref_anchor).abs().max()),
                        off_mean=float((full - mean).abs().max()),
                        identical=_replicas_identical(full),
                    )
                )
        handle.remove()
        out[config] = dict(rounds=rounds, pseudo_grad_norm=opt.metrics()[PERIOD]["pseudo_grad_norm"])
    return out


# -- resume through torch.distributed.checkpoint -------------------------------------------------------------------
def _resume(rank: int, folder: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    from hieravg_optim import nesterov_outer
    from hieravg_optim.fsdp import init_replicate_shard_mesh, load_checkpoint, save_checkpoint

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    # Synchronous warm-up of 2 steps; anchors taken after count 1; rounds at counts 3, 6 and 9.
    total, warmup = 11, 2
    out = {}
    cases = [(config, 8) for config in CONFIGS] + [("fsdp2", 1)]  # 8: two outer rounds done; 1: no anchors yet
    for config, stop in cases:
        model, opt = _build(config, mesh, nesterov_outer(lr=0.7, momentum=0.9), warmup)
        for step in range(total):
            _train_step(model, opt, rank, step)
        straight = _flat(_full_params(model))

        model, opt = _build(config, mesh, nesterov_outer(lr=0.7, momentum=0.9), warmup)
        for step in range(stop):
            _train_step(model, opt, rank, step)
        saved_outer = opt.averager.state_dict().get("outer", {})
        saved_anchors = [a.clone() for a in saved_outer.get(PERIOD, {}).get("anchors", [])]
        saved_momentum = [
            s["momentum_buffer"].clone()
            for _, s in sorted(saved_outer.get(PERIOD, {}).get("optimizer", {}).get("state", {}).items())
        ]
        saved_params = _gather(_flat(_full_params(model)))
        path = os.path.join(folder, f"{config}_{stop}")
        save_checkpoint(path, model, opt)
        del model, opt

        model, opt = _build(config, mesh, nesterov_outer(lr=0.7, momentum=0.9), warmup)
        load_checkpoint(path, model, opt)
        # state_dict() holds the anchors themselves: compare before the next round changes them.
        loaded_outer = opt.averager.state_dict().get("outer", {})
        loaded_anchors = loaded_outer.get(PERIOD, {}).get("anchors", [])
        loaded_momentum = [
            s["momentum_buffer"]
            for _, s in sorted(loaded_outer.get(PERIOD, {}).get("optimizer", {}).get("state", {}).items())
        ]
        anchors_loaded = len(saved_anchors) == len(loaded_anchors) and all(
            torch.equal(a, b) for a, b in zip(saved_anchors, loaded_anchors)
        )
        momentum_loaded = len(saved_momentum) == len(loaded_momentum) and all(
            torch.equal(a, b) for a, b in zip(saved_momentum, loaded_momentum)
        )
        for step in range(stop, total):
            _train_step(model, opt, rank, step)
        resumed = _flat(_full_params(model))
        metadata = FileSystemReader(os.path.join(path, "replica_0")).read_metadata().state_dict_metadata
        anchor_md = metadata.get(f"outer.dtensors.{PERIOD}/anchor/0")
        out[f"{config}_{stop}"] = dict(
            replicas_differed_at_save=not torch.equal(saved_params[0], saved_params[SHARDS]),
            # Local shards of one replica differ: stored as plain tensors under one key, DCP keeps one of them.
            anchors=[a.flatten().tolist() for a in saved_anchors],
            momentum_saved=len(saved_momentum),
            anchors_loaded=anchors_loaded,
            momentum_loaded=momentum_loaded,
            max_diff=float((resumed - straight).abs().max()),
            outer_keys=sorted(k for k in metadata if k.startswith("outer.")),
            anchor_chunks=None if anchor_md is None else len(anchor_md.chunks),
        )
    return out


def _load_mismatch(rank: int, folder: str) -> dict:
    """FSDP2 checkpoints whose outer state does not fit the loading optimizer's shards, loaded during a warm-up (no
    anchors held yet): a ValueError at load time, from DCP's metadata before its load, on every rank."""
    from hieravg_optim import nesterov_outer
    from hieravg_optim.fsdp import init_replicate_shard_mesh, load_checkpoint, save_checkpoint

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    out = {}
    for case in ("dtype", "count"):
        model = _shard("fsdp2", mesh)
        if case == "count":  # saved with the last bias frozen: one anchor fewer than the loading run averages
            list(model.parameters())[-1].requires_grad_(False)
        model, opt = _build_with(model, mesh, nesterov_outer(lr=0.7, momentum=0.9))
        for step in range(4):  # rounds at counts 0 and 3
            _train_step(model, opt, rank, step)
        if case == "dtype":  # a foreign checkpoint: the anchors in bfloat16
            outer = opt.averager._outer[-1]
            outer.anchors[:] = [a.to(torch.bfloat16) for a in outer.anchors]
        path = os.path.join(folder, f"mismatch_{case}")
        save_checkpoint(path, model, opt)
        model, opt = _build("fsdp2", mesh, nesterov_outer(lr=0.7, momentum=0.9), warmup_steps=6)
        before = _flat(_full_params(model))
        try:
            load_checkpoint(path, model, opt)
            out[case] = "no error"
        except Exception as err:  # noqa: BLE001
            out[case] = f"{type(err).__name__}: {err}"
        out[f"{case} unchanged"] = (
            opt.averager.step == 0 and not opt.averager.has_anchors and torch.equal(before, _flat(_full_params(model)))
        )
        out[f"{case} tensors"] = len(opt.tensors_to_average())
    return out


def _build_with(model, mesh, outer):
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer

    opt = FSDPHierarchicalAveragingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1), model, mesh, LEVELS,
        outer_optimizers={PERIOD: outer},
    )  # fmt: skip
    return model, opt


def _scenarios(rank: int, world_size: int, folder: str) -> dict:
    return run_scenarios(
        {
            "plain": _plain_equivalence,
            "nesterov": _nesterov_reference,
            "resume": lambda r: _resume(r, folder),
            "load mismatch": lambda r: _load_mismatch(r, folder),
        },
        rank,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_scenarios, WORLD, str(tmp_path_factory.mktemp("outer_fsdp")), timeout=300)


def test_outer_sgd_lr1_is_plain_averaging(results):
    for rank, r in enumerate(results):
        for config, c in r["plain"].items():
            where = f"rank {rank}, {config}"
            assert len(c["rounds"]) == 3 and c["metrics"]["rounds"] == 3, (where, c)
            for i, rnd in enumerate(c["rounds"]):
                assert rnd["max_diff"] <= ATOL, f"{where}, round {i}: outer SGD(lr=1) differs from averaging {rnd}"
                assert rnd["identical"], f"{where}, round {i}: replicas differ after the round"
                assert rnd["anchors_are_params"], f"{where}, round {i}: the anchors are not the new parameters"
            assert c["metrics"]["outer_bytes"] > 0 and c["metrics"]["pseudo_grad_norm"] is not None, (where, c)


def test_anchors_are_sharded_like_the_parameters(results):
    for rank, r in enumerate(results):
        for config, c in r["plain"].items():
            assert c["anchor_shapes"] == c["local_shapes"], (rank, config, c)
            assert c["anchor_dtypes"] == ["torch.float32"], (rank, config, c)
            # A local shard, not the full parameters (19 elements).
            assert sum(torch.Size(s).numel() for s in c["anchor_shapes"]) < c["full_numel"], (rank, config, c)
    # FSDP2: the shards of torch.chunk (uneven, some empty); FSDP1: one padded flat shard per unit.
    assert results[0]["plain"]["fsdp2"]["anchor_shapes"] == [(2, 4), (2,), (1, 3), (1,)]
    assert results[1]["plain"]["fsdp2"]["anchor_shapes"] == [(1, 4), (1,), (0, 3), (0,)]
    for config in ["fsdp1", "fsdp1_orig"]:  # one unit: one flat shard, padded to the same size on both ranks
        shapes = [results[rank]["plain"][config]["anchor_shapes"] for rank in range(WORLD)]
        assert len(shapes[0]) == 1 and all(s == shapes[0] for s in shapes), (config, shapes)


def test_nesterov_matches_torch_sgd_on_the_full_parameters(results):
    for rank, r in enumerate(results):
        for config, c in r["nesterov"].items():
            where = f"rank {rank}, {config}"
            assert len(c["rounds"]) == 3, (where, c)
            for i, rnd in enumerate(c["rounds"]):
                assert rnd["max_diff"] <= ATOL, f"{where}, round {i}: differs from torch.optim.SGD(nesterov) {rnd}"
                assert rnd["off_mean"] > 1e-3, f"{where}, round {i}: Nesterov gave the plain mean {rnd}"
                assert rnd["identical"], f"{where}, round {i}: replicas differ after the round"
            assert c["pseudo_grad_norm"] > 0, (where, c)


def test_dcp_resume_with_outer_state_equals_uninterrupted_run(results):
    for rank, r in enumerate(results):
        for case, c in r["resume"].items():
            where = f"rank {rank}, {case}"
            assert c["max_diff"] <= ATOL, f"{where}: the resumed run differs from the uninterrupted one {c['max_diff']}"
            if case.endswith("_1"):  # saved in the (synchronous) warm-up, before the anchors: no outer state
                assert c["anchors"] == [] and c["outer_keys"] == [], (where, c)
                continue
            assert c["replicas_differed_at_save"], where
            assert c["momentum_saved"] == len(c["anchors"]) > 0, (where, c)
            assert c["anchors_loaded"] and c["momentum_loaded"], f"{where}: the outer state was not restored: {c}"
            assert f"outer.dtensors.{PERIOD}/anchor/0" in c["outer_keys"], (where, c["outer_keys"])
            assert {"outer.shard_0", "outer.shard_1"} <= set(c["outer_keys"]), (where, c["outer_keys"])
            assert c["anchor_chunks"] == SHARDS, (where, c)  # both ranks' shards of the first anchor
    # What the checkpoint must keep: the two ranks of a replica hold different anchors.
    for case in results[0]["resume"]:
        if not case.endswith("_1"):
            assert results[0]["resume"][case]["anchors"] != results[1]["resume"][case]["anchors"], case


def test_outer_state_not_fitting_the_shards_raises_at_load_before_dcp_loads(results):
    for rank, r in enumerate(results):
        c = r["load mismatch"]
        # Every rank's own check failed (the whole checkpoint is foreign): each raises its own ValueError.
        assert c["dtype"].startswith("ValueError: The checkpoint at ") and "/mismatch_dtype/replica_" in c["dtype"], c
        assert f"holds the anchor '{PERIOD}/anchor/0' in torch.bfloat16, but anchors are float32" in c["dtype"], c
        assert c["count"].startswith("ValueError: The checkpoint at ") and "/mismatch_count/replica_" in c["count"], c
        assert f"holds 3 anchors for the outer optimizer of period {PERIOD}, but this rank averages 4 tensors" in c[
            "count"
        ], c
        assert c["count tensors"] == 4, c
        assert c["dtype"].endswith("load a checkpoint save_checkpoint wrote, unchanged."), c
        assert c["count"].endswith("with the same parameters trainable."), c
        for case in ("dtype", "count"):
            # Found in the metadata, before DCP's load: nothing changed, parameters included.
            assert c[f"{case} unchanged"], (rank, case, c)

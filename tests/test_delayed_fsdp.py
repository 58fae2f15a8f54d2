"""Delayed rounds on real FSDP1 / FSDP2 replicas (2 x 2 replicate x shard gloo mesh): exact applied shards.

Levels ``{4: 4}`` with ``delay_steps`` 2 after a local warm-up of 1 step: the round starts at count 4 and lands at 6.
The replica's full parameters are gathered right before the round starts (``theta_4``) and right before it is
applied (``theta_6``); after the step at count 6 they equal exactly ``(theta_4[replica 0] + theta_4[replica 1]) /
2 + (theta_6 - theta_4)`` of the replica (float32, in that order): every local shard took the formula, uneven and
empty shards included. ``save_checkpoint`` with the round in flight raises ``NotImplementedError`` on every rank.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import default_timeout, run_distributed
from tests.test_fsdp import SHARDS, WORLD, _flat, _full_params, _gather, _shard, _train_step

pytestmark = pytest.mark.timeout(default_timeout(400))

CONFIGS = ["fsdp1", "fsdp1_orig", "fsdp1_orig_wrap_bf16", "fsdp2", "fsdp2_wrap_bf16"]


def _scenarios(rank, world_size, folder):
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh, save_checkpoint

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    report = {}
    for config in CONFIGS:
        model = _shard(config, mesh)
        opt = FSDPHierarchicalAveragingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05), model, mesh, {4: WORLD}, warmup_steps=1,
            synchronous_warmup=False, delay_steps=2,
        )  # fmt: skip
        delayed = opt.averager._delayed
        captured = {}
        original_start, original_apply = delayed.start, delayed.apply

        def start(*args, **kwargs):
            captured["start"] = _flat(_full_params(model))
            return original_start(*args, **kwargs)

        def apply(*args, **kwargs):
            captured["apply"] = _flat(_full_params(model))
            return original_apply(*args, **kwargs)

        delayed.start, delayed.apply = start, apply
        checkpoint_error = None
        for step in range(7):
            _train_step(model, opt, rank, step)
            if step == 4:
                try:
                    save_checkpoint(f"{folder}/{config}", model, opt)
                except NotImplementedError as exc:
                    checkpoint_error = str(exc)
        snap, live = _gather(captured["start"]), _gather(captured["apply"])
        k = rank // SHARDS * SHARDS
        expected = (snap[0] + snap[SHARDS]) / 2 + (live[k] - snap[k])
        after = _flat(_full_params(model))
        report[config] = {
            "exact": torch.equal(after, expected),
            "replicas_differed": not torch.equal(snap[0], snap[SHARDS]),
            "progress_kept": not torch.equal(live[k], snap[k]),
            "checkpoint_refused": checkpoint_error is not None and "rounds in flight (periods [4])" in checkpoint_error,
            "rounds": opt.metrics()[4]["rounds_applied"],
        }
    return report


def test_fsdp_delayed_round_applies_the_eager_formula_to_every_shard(tmp_path):
    results = run_distributed(_scenarios, WORLD, str(tmp_path), timeout=360)
    for r in results:
        for config in CONFIGS:
            assert r[config] == {
                "exact": True, "replicas_differed": True, "progress_kept": True, "checkpoint_refused": True, "rounds": 1
            }, (config, r[config])  # fmt: skip

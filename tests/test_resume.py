"""Restart and resume of the digits examples: atomic checkpoints, a rank killed mid-save, torn checkpoints.

The examples save ``step_<N>/`` folders under ``--checkpoint-dir`` (``examples/checkpointing.py``),
each published only after every rank has written its part. Runs here are real launcher subprocesses
(``torchrun --standalone``, free port picked at run time) with a wall-clock timeout:

* an uninterrupted 2-rank run that checkpoints every 8 of its 30 steps (the reference);
* the same run under ``torchrun --max-restarts 1`` whose last rank SIGKILLs itself in the middle
  of the save at step 16 on the first attempt: torchrun restarts both ranks, ``--resume`` skips
  the unfinished ``step_16`` and continues from ``step_8``, and the run ends with the reference's
  parameters, optimizer state, averaging count and loss curve;
* torn checkpoints (no manifest, a truncated file, a changed byte, an unfinished save) are
  skipped, with the reason, for the newest intact one (no launch: the finder reads files only);
* the DeepSpeed example resumed from its step-8 checkpoint ends as its uninterrupted run.

Runtime budget of this file: about 75 s on 2 idle cores (four launches of 2 ranks, one of them
restarted: 14 s per torchrun launch, 16 s per DeepSpeed launch, measured); the DeepSpeed test is
about 32 s of it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest
import torch

from tests.launch import ROOT, check_ok, torchrun

EXAMPLE = ROOT / "examples" / "train_digits.py"
DS_EXAMPLE = ROOT / "examples" / "train_digits_deepspeed.py"
# 2 ranks, 1,347 training images: 673 per rank // 64 = 10 steps per epoch, 30 steps; averaging every 3.
ARGS = ("--period-group-size", "3:2", "--epochs", "3", "--batch-size", "64", "--checkpoint-every", "8")
SAVED_STEPS = [8, 16, 24, 30]  # every 8 steps, and after the last
# torch >= 2.4's torchrun shares its rendezvous store with the workers; without this a restarted gloo
# group can read the dead attempt's addresses (pytorch/pytorch#135712). Documented in docs/faults.md.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

pytestmark = pytest.mark.timeout(900)


def _checkpointing():
    spec = importlib.util.spec_from_file_location("digits_checkpointing", ROOT / "examples" / "checkpointing.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _load(folder, rank: int) -> dict:
    return torch.load(folder / f"rank_{rank}.pt", weights_only=True)


def assert_same_state(a, b, where: str) -> None:
    """Tensors allclose (1e-6), everything else equal, recursively."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype, where
        assert torch.allclose(a.double(), b.double(), rtol=0, atol=1e-6), f"{where}: max diff {(a - b).abs().max()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its checkpoint folder and metrics."""
    tmp = tmp_path_factory.mktemp("reference")
    result = torchrun(2, EXAMPLE, *ARGS, "--checkpoint-dir", str(tmp / "ckpt"), "--metrics-out", str(tmp / "m.json"))
    check_ok(result)
    return tmp / "ckpt", json.loads((tmp / "m.json").read_text())


def test_rank_killed_mid_save_restarts_from_the_last_complete_checkpoint(tmp_path, reference):
    ref_dir, ref = reference
    assert sorted(p.name for p in ref_dir.iterdir()) == [f"step_{s:08d}" for s in SAVED_STEPS]
    assert ref["rounds_per_level"] == ref["expected_rounds_per_level"] == {"3": 10}  # counts 0, 3, ..., 27
    assert ref["averaging_step"] == 30 and ref["resumed_from_step"] is None

    ckpt = tmp_path / "ckpt"
    result = torchrun(
        2, EXAMPLE, *ARGS, "--checkpoint-dir", str(ckpt), "--resume", "--kill-at-step", "16",
        "--metrics-out", str(tmp_path / "m.json"), launcher_args=("--max-restarts", "1"), extra_env=FRESH_STORE,
    )  # fmt: skip
    check_ok(result)
    err = result.stderr
    assert "fault drill: rank 1 kills itself (SIGKILL) after step 16, in the middle of the checkpoint save" in err
    assert f"resume: no complete checkpoint under {ckpt}; starting at step 0" in err  # the first attempt
    assert f"resume: skipping {ckpt}/step_00000016.partial: a save that did not finish" in err, err[-4000:]
    assert f"resume: continuing from {ckpt}/step_00000008 (step 8)" in err, err[-4000:]
    assert err.count("resume: continuing") == 1  # one restart

    # The restarted run rewrote step_16 and went on: the same folders as the reference, none left unfinished.
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step_{s:08d}" for s in SAVED_STEPS]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["resumed_from_step"] == 8
    for key in ["loss_curve", "final_loss", "test_loss", "test_accuracy", "rounds_per_level", "bytes_sent_per_level",
                "averaging_step", "replicas_identical"]:  # fmt: skip
        assert metrics[key] == ref[key], f"{key}: {metrics[key]} after the restart, {ref[key]} uninterrupted"
    for rank in range(2):  # the last checkpoint: parameters, AdamW state, averaging count, data position
        final, expected = _load(ckpt / "step_00000030", rank), _load(ref_dir / "step_00000030", rank)
        assert final["optimizer"]["hierarchical_averaging"]["step"] == 30
        for metrics_of_level in [*final["averaging_metrics"].values(), *expected["averaging_metrics"].values()]:
            metrics_of_level.pop("seconds")  # wall-clock time
        assert_same_state(final, expected, f"rank {rank}")


def test_torn_checkpoints_are_skipped_for_the_newest_intact_one(tmp_path, reference):
    ckpt = _checkpointing()
    folder = tmp_path / "ckpt"
    shutil.copytree(reference[0], folder)
    (folder / "step_00000030" / "rank_1.pt").write_bytes((folder / "step_00000030" / "rank_1.pt").read_bytes()[:999])
    (folder / "step_00000024" / "manifest.json").unlink()  # the completion marker never written
    changed = bytearray((folder / "step_00000016" / "rank_0.pt").read_bytes())
    changed[-100] ^= 0xFF  # same size, one byte different
    (folder / "step_00000016" / "rank_0.pt").write_bytes(bytes(changed))
    shutil.copytree(folder / "step_00000008", folder / "step_00000028.partial")

    found = ckpt.find_latest_complete(folder, world_size=2)
    assert (found.path, found.step) == (str(folder / "step_00000008"), 8)
    assert found.skipped == [
        (str(folder / "step_00000030"), "rank_1.pt has 999 bytes, manifest.json says "
         f"{(reference[0] / 'step_00000030' / 'rank_1.pt').stat().st_size} (truncated or overwritten)"),
        (str(folder / "step_00000028.partial"), "a save that did not finish (not published)"),
        (str(folder / "step_00000024"), "no manifest.json: the save did not complete"),
        (str(folder / "step_00000016"),
         "rank_0.pt does not match the sha256 in manifest.json (changed after the save)"),
    ]  # fmt: skip

    (folder / "step_00000008" / "manifest.json").write_text("{not json")
    found = ckpt.find_latest_complete(folder, world_size=2)
    assert found.path is None and found.step == 0 and len(found.skipped) == 5
    assert found.skipped[-1][1].startswith("manifest.json is unreadable (JSONDecodeError")

    with pytest.raises(ValueError, match=r"step_00000030 was saved by 2 ranks; this job has 4\. Resume with 2 ranks"):
        ckpt.find_latest_complete(reference[0], world_size=4)


DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 64,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.002, "warmup_num_steps": 20}},
    "zero_optimization": {"stage": 2},
    "hierarchical_averaging": {"period_group_size": {"3": 2}, "warmup_steps": 0, "ranks_per_replica": 1},
}


def test_deepspeed_example_resumed_equals_the_uninterrupted_run(tmp_path):
    """ZeRO-2, a WarmupLR schedule, 2 replicas averaging every 3 steps: resumed at step 8 (a torn step_16 skipped)."""
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(DS_CONFIG))
    args = ("--deepspeed_config", str(config), "--epochs", "3", "--checkpoint-every", "8")
    ref_dir, resumed_dir = tmp_path / "a", tmp_path / "b"
    metrics_a, metrics_b = tmp_path / "a.json", tmp_path / "b.json"
    check_ok(torchrun(2, DS_EXAMPLE, *args, "--checkpoint-dir", str(ref_dir), "--metrics-out", str(metrics_a)))
    resumed_dir.mkdir()
    shutil.copytree(ref_dir / "step_00000008", resumed_dir / "step_00000008")
    shutil.copytree(ref_dir / "step_00000016", resumed_dir / "step_00000016")
    (resumed_dir / "step_00000016" / "manifest.json").unlink()
    result = torchrun(2, DS_EXAMPLE, *args, "--checkpoint-dir", str(resumed_dir), "--resume",
                      "--metrics-out", str(metrics_b))  # fmt: skip
    check_ok(result)
    assert f"resume: skipping {resumed_dir}/step_00000016: no manifest.json" in result.stderr
    assert f"resume: continuing from {resumed_dir}/step_00000008 (step 8)" in result.stderr

    ref, metrics = (json.loads(path.read_text()) for path in (metrics_a, metrics_b))
    assert (ref["resumed_from_step"], metrics["resumed_from_step"]) == (None, 8)
    for key in ["loss_curve", "final_loss", "final_lr", "test_loss", "test_accuracy", "rounds_per_level",
                "bytes_sent_per_level", "averaging_steps", "replicas_identical"]:  # fmt: skip
        assert metrics[key] == ref[key], f"{key}: {metrics[key]} resumed, {ref[key]} uninterrupted"
    assert ref["rounds_per_level"] == {"3": 10} and ref["averaging_steps"] == 30
    for replica in range(2):  # the last checkpoint: each replica's module and averaging count
        path = f"step_00000030/engine/replica_{replica}/mp_rank_00_model_states.pt"
        a, b = (torch.load(d / path, weights_only=False) for d in (ref_dir, resumed_dir))
        assert a["hierarchical_averaging"]["step"] == b["hierarchical_averaging"]["step"] == 30
        assert a["global_steps"] == b["global_steps"] == 30
        assert_same_state(b["module"], a["module"], f"replica {replica} module")


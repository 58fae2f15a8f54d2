"""The torchrun digits example and the documented quickstarts (README.md, docs/), run as real launcher subprocesses.

Each test launches ``torchrun --standalone``: its rendezvous is a c10d TCP store on a
port the OS picks at run time (``localhost:0``), so there is no fixed port and no
race between tests. A launch has a wall-clock timeout (scaled by
``HIERAVG_TEST_TIMEOUT_SCALE``); on a timeout the whole process group of the
launcher is killed and its output shown.

The 4-rank digits run is compared with a golden trajectory in
``tests/golden/train_digits_w4.json``. With fixed seeds and one thread per rank
the run is deterministic on CPU, so the tolerance is tight; regenerate the file
after an intended change with ``HIERAVG_REGEN_GOLDEN=1 python -m pytest -q tests/test_examples.py``.

Runtime budget of this file: about 2 minutes on 2 idle cores (each launch of 2-4 ranks
costs 10-20 s, mostly importing torch and scikit-learn).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.harness import default_timeout
from tests.launch import RANK_LINE, ROOT, check_ok, doc_block, torchrun

EXAMPLE = ROOT / "examples" / "train_digits.py"
GOLDEN = ROOT / "tests" / "golden" / "train_digits_w4.json"
REGEN = os.environ.get("HIERAVG_REGEN_GOLDEN") == "1"

# Tolerances for the golden comparison. The run is bitwise reproducible with the same torch build; the
# slack only absorbs a different CPU kernel path (e.g. another SIMD width), not a behaviour change.
LOSS_RTOL = 1e-4
ACCURACY_ATOL = 1.5 / 450  # at most one of the 450 test images classified differently

pytestmark = pytest.mark.timeout(600)


def hand_rounds(steps: int, levels: dict[int, int], warmup: int) -> dict[str, int]:
    """Averaging rounds per period over counts 0..steps-1, straight from the rule (not the library's schedule)."""
    rounds = {str(p): 0 for p in levels}
    for count in range(warmup, steps):
        divisors = [p for p in levels if count % p == 0]
        if divisors:
            rounds[str(max(divisors))] += 1
    return rounds


def compare_golden(metrics: dict) -> None:
    keys = ["world_size", "period_group_size", "warmup_steps", "epochs", "lr", "batch_size", "seed", "steps",
            "rounds_per_level", "loss_curve", "final_loss", "test_loss", "test_accuracy"]  # fmt: skip
    current = {k: metrics[k] for k in keys}
    if REGEN:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(dict(current, torch_version=metrics["torch_version"]), indent=2) + "\n")
    assert GOLDEN.exists(), f"{GOLDEN} is missing: create it with HIERAVG_REGEN_GOLDEN=1"
    golden = json.loads(GOLDEN.read_text())
    hint = (
        f"(golden made with torch {golden.get('torch_version')}, this run {metrics['torch_version']}); "
        "after an intended change regenerate with HIERAVG_REGEN_GOLDEN=1"
    )
    for k in ["world_size", "period_group_size", "warmup_steps", "epochs", "lr", "batch_size", "seed", "steps",
              "rounds_per_level"]:  # fmt: skip
        assert current[k] == golden[k], f"{k}: {current[k]!r} != golden {golden[k]!r} {hint}"
    assert len(current["loss_curve"]) == len(golden["loss_curve"])
    for epoch, (a, b) in enumerate(zip(current["loss_curve"], golden["loss_curve"])):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"epoch {epoch} training loss {a} != golden {b} {hint}"
    for k in ["final_loss", "test_loss"]:
        assert math.isclose(current[k], golden[k], rel_tol=LOSS_RTOL), f"{k} {current[k]} != golden {golden[k]} {hint}"
    assert abs(current["test_accuracy"] - golden["test_accuracy"]) <= ACCURACY_ATOL, (
        f"test_accuracy {current['test_accuracy']} != golden {golden['test_accuracy']} {hint}"
    )


def test_train_digits_4_ranks_two_levels(tmp_path):
    """The torchrun digits example: 4 ranks, default hierarchy 4:2,16:4, accuracy target, exact rounds, golden run."""
    out = tmp_path / "digits.json"
    result = torchrun(4, EXAMPLE, "--metrics-out", str(out), progress_bar=True)
    check_ok(result)
    metrics = json.loads(out.read_text())
    assert metrics["world_size"] == 4
    assert metrics["period_group_size"] == {"4": 2, "16": 4}
    assert metrics["steps"] == 200  # 20 epochs x (336 samples // 32) steps
    assert metrics["test_accuracy"] >= 0.93, metrics
    assert metrics["rounds_per_level"] == hand_rounds(200, {4: 2, 16: 4}, 0) == {"4": 37, "16": 13}
    assert metrics["rounds_per_level"] == metrics["expected_rounds_per_level"]
    assert metrics["replicas_identical"] is True
    assert 0 < metrics["final_loss"] < metrics["loss_curve"][0]
    assert result.stdout.count("test accuracy") == 1, result.stdout  # printed by rank 0 only
    assert "digits: 100%" in result.stderr and "200/200" in result.stderr  # rank 0's progress bar
    compare_golden(metrics)


def test_train_digits_warmup_single_level_non_iid(tmp_path):
    """2 ranks, one level with warm-up, non-IID shares: rounds start at the warm-up, replicas end identical."""
    out = tmp_path / "digits2.json"
    args = ["--period-group-size", "3:2", "--warmup-steps", "25", "--epochs", "4", "--non-iid", "--lr", "3e-3"]
    check_ok(torchrun(2, EXAMPLE, *args, "--metrics-out", str(out)))
    metrics = json.loads(out.read_text())
    steps = 4 * (673 // 32)  # 1347 training images dealt to 2 ranks: the smaller share has 673
    assert metrics["steps"] == steps == 84
    assert metrics["rounds_per_level"] == hand_rounds(steps, {3: 2}, 25) == {"3": 19}  # counts 27, 30, ..., 81
    assert metrics["rounds_per_level"] == metrics["expected_rounds_per_level"]
    assert metrics["replicas_identical"] is True
    assert metrics["non_iid"] is True


def test_train_digits_bad_arguments_fail_clearly():
    """A hierarchy that does not fit the world size: exit code 2, one message naming the value, no hang."""
    result = torchrun(2, EXAMPLE, "--period-group-size", "4:2,16:4", timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("usage:") == 1, result.stderr
    assert "--period-group-size 4:2,16:4 with 2 ranks" in result.stderr
    assert "must divide the size of the process group (2)" in result.stderr


def test_train_digits_without_torchrun_says_how_to_launch():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=default_timeout(120),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "launch with torchrun --nproc_per_node N examples/train_digits.py" in result.stderr


@pytest.mark.parametrize("name", ["quickstart", "quickstart_ddp", "quickstart_slow_link"])
def test_documented_quickstart_runs(tmp_path, name):
    """The documented quickstarts, pasted into a file and launched on 4 ranks, run and average as documented.

    The slow-link quickstart (delayed and int8-compressed top level) also prints its byte ratio as shown.
    """
    script = tmp_path / f"{name}.py"
    script.write_text(doc_block(name))
    result = torchrun(4, script)
    check_ok(result)
    shown, *more = doc_block(f"{name}_output").strip().splitlines()  # rank 0's lines, as shown in the docs
    for line in more:  # lines after the first: printed as shown (deterministic values, e.g. a byte ratio)
        assert line in result.stdout, f"the documented line {line!r} is not in the output:\n{result.stdout}"
    shown_match = re.fullmatch(RANK_LINE, shown)
    assert shown_match, f"the documented output {shown!r} does not match {RANK_LINE!r}"
    printed = {m[0]: m[3] for m in re.findall(RANK_LINE, result.stdout)}
    assert sorted(printed) == ["0", "1", "2", "3"], result.stdout
    for rank, rounds in printed.items():
        assert rounds == shown_match.group(4), f"rank {rank} printed rounds {rounds}, the docs show {shown!r}"


CHARS_EXAMPLE = ROOT / "examples" / "train_chars_diloco.py"


def test_train_chars_diloco_4_ranks_outer_on_both_levels(tmp_path):
    """The char-LM DiLoCo example, shrunk: 4 ranks, {2: 2, 8: 4} with Nesterov on both levels, 17 steps.

    Counts 0..16: the top level (all 4 ranks) averages at 0, 8, 16, so the run ends on a top-level
    round; the pairs at the 6 other even counts. The validation loss is measured after each
    top-level round and must fall; the replicas must be bitwise identical after every one of them.
    """
    out, png = tmp_path / "chars.json", tmp_path / "chars.png"
    args = ["--period-group-size", "2:2,8:4", "--outer", "both", "--steps", "17", "--batch-size", "8",
            "--context", "32", "--d-model", "32", "--val-windows", "32", "--lr", "3e-3"]  # fmt: skip
    result = torchrun(4, CHARS_EXAMPLE, *args, "--metrics-out", str(out), "--plot", str(png), progress_bar=True)
    check_ok(result)
    metrics = json.loads(out.read_text())
    assert metrics["world_size"] == 4 and metrics["outer_periods"] == [2, 8]
    assert metrics["rounds_per_level"] == hand_rounds(17, {2: 2, 8: 4}, 0) == {"2": 6, "8": 3}
    assert metrics["rounds_per_level"] == metrics["expected_rounds_per_level"]
    assert metrics["final_extra_top_round"] is False
    assert metrics["replicas_identical"] is True
    assert [step for step, _ in metrics["val_curve"]] == [0, 1, 9, 17]
    losses = [loss for _, loss in metrics["val_curve"]]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses  # from ~ln(256) = 5.5 nats per byte, clearly learning
    for period in ("2", "8"):  # both levels took outer steps on a non-zero pseudo-gradient and hold state
        assert metrics["pseudo_grad_norm_per_level"][period] > 0, metrics["pseudo_grad_norm_per_level"]
        assert metrics["outer_bytes_per_level"][period] > 0, metrics["outer_bytes_per_level"]
    assert metrics["corpus"]["files"] > 100 and metrics["corpus"]["bytes"] > 10**6
    assert png.stat().st_size > 10_000
    assert result.stdout.count("validation loss") == 1, result.stdout  # printed by rank 0 only
    assert "chars: 100%" in result.stderr and "17/17" in result.stderr  # rank 0's progress bar

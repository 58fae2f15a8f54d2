"""``step_was_skipped``: how a training loop sees that ``GradScaler`` skipped the inner step, on 2 real gloo ranks.

accelerate and Lightning decide it by patching ``optimizer.step`` and seeing whether ``scaler.step`` called it;
the wrapper is always called (``_step_supports_amp_scaling``: the count advances on every rank), so that check
never sees the skip. Here: the wrapper's signal, exact weights, an LR scheduler gated on it; accelerate's own
check reproduced as its code does it (``accelerate/optimizer.py``: ``patch_optimizer_step`` and
``AcceleratedOptimizer.step``), and run with accelerate itself where it is installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from tests.harness import default_timeout, run_distributed, run_scenarios

WORLD = 2
LEVELS = {2: 2}
STEPS = 3
SKIP = (1, 1)  # (rank, count): this rank's gradients are infinite at this count
pytestmark = pytest.mark.timeout(default_timeout(240))


def _setup(rank: int):
    from hieravg_optim import HierarchicalAveragingOptimizer

    model = nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), LEVELS)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=4.0)


def _backward(model, scaler, rank: int, count: int) -> None:
    value = float("inf") if (rank, count) == SKIP else 1.0  # gradient 1 for every element, or inf
    scaler.scale(model(torch.full((1, 3), value)).sum()).backward()


def _weights(model) -> list[float]:
    return sorted({v for p in model.parameters() for v in p.detach().flatten().tolist()})


def _scenario_signal(rank: int) -> dict:
    """The wrapper's flag, with the recipe of the docs: the LR scheduler advances only after a step that ran."""
    model, opt, scaler = _setup(rank)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    assert opt.step_was_skipped is False  # before the first step
    skipped = []
    for count in range(STEPS):
        opt.zero_grad()
        _backward(model, scaler, rank, count)
        scaler.step(opt)
        scaler.update()
        skipped.append(opt.step_was_skipped)
        if not opt.step_was_skipped:
            scheduler.step()
    # Without a scaler the flag is False again.
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "skipped": skipped,
        "after_plain_step": opt.step_was_skipped,
        "count": opt.averaging_step,
        "weights": _weights(model),
        "scheduler_epoch": scheduler.last_epoch,
    }


def _scenario_patched_step_check(rank: int) -> dict:
    """accelerate's check, as ``accelerate/optimizer.py`` does it: ``patch_optimizer_step`` sets a flag, then
    calls the optimizer's ``step``; ``AcceleratedOptimizer.step`` puts it on the optimizer for ``scaler.step``
    and reads the flag after. It never sees the skip: the flag to read is ``step_was_skipped``."""
    model, opt, scaler = _setup(rank)
    called = {"flag": False}
    original = opt.step

    def patched_step(*args, **kwargs):
        called["flag"] = True
        return original(*args, **kwargs)

    seen, signal = [], []
    for count in range(STEPS):
        opt.zero_grad()
        _backward(model, scaler, rank, count)
        opt.step = patched_step
        scaler.step(opt)
        scaler.update()
        seen.append(not called["flag"])  # accelerate's _is_overflow
        opt.step = original
        called["flag"] = False
        signal.append(opt.step_was_skipped)
    return {"patched_check": seen, "skipped": signal, "weights": _weights(model)}


def _scenario_accelerate(rank: int) -> dict | None:
    """accelerate itself: ``AcceleratedOptimizer`` with a ``GradScaler`` (``Accelerator(cpu=True)`` on gloo)."""
    if importlib.util.find_spec("accelerate") is None:
        return None
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # joins the process group the harness made
    model, opt, scaler = _setup(rank)
    wrapped = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)
    seen, signal = [], []
    for count in range(STEPS):
        wrapped.zero_grad()
        _backward(model, scaler, rank, count)
        wrapped.step()  # scaler.step(opt) through accelerate's patched step, then scaler.update()
        seen.append(wrapped.step_was_skipped)
        signal.append(wrapped.optimizer.step_was_skipped)
    return {"accelerate_check": seen, "skipped": signal, "weights": _weights(model)}


SCENARIOS = {
    "signal": _scenario_signal,
    "patched_step_check": _scenario_patched_step_check,
    "accelerate": _scenario_accelerate,  # last: it sets accelerate's process-wide state
}


def _run(rank: int, world_size: int) -> dict:
    assert world_size == WORLD
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run, WORLD, timeout=180, pg_timeout=60)


# Params start at the rank; lr 0.5, gradient 1. Count 0: both step (-0.5, 0.5), round: 0. Count 1: rank 0
# steps (-0.5), rank 1 skips (0). Count 2: -1 and -0.5, round: -0.75 on both.
EXPECTED_SKIPPED = [[False, False, False], [False, True, False]]


def test_step_was_skipped_names_the_skipped_step(results):
    assert [r["signal"]["skipped"] for r in results] == EXPECTED_SKIPPED
    assert [r["signal"]["count"] for r in results] == [STEPS + 1] * WORLD  # a skipped step counts
    assert all(r["signal"]["after_plain_step"] is False for r in results)


def test_weights_are_exact(results):
    for r in results:
        for name in ("patched_step_check", "accelerate"):
            if r[name] is not None:
                assert r[name]["weights"] == [-0.75], name


def test_scheduler_gated_on_the_signal(results):
    assert [r["signal"]["scheduler_epoch"] for r in results] == [3, 2]


def test_patched_step_check_never_sees_the_skip(results):
    for rank, r in enumerate(results):
        assert r["patched_step_check"]["patched_check"] == [False] * STEPS
        assert r["patched_step_check"]["skipped"] == EXPECTED_SKIPPED[rank]


def test_accelerate(results):
    if results[0]["accelerate"] is None:
        pytest.skip("accelerate is not installed")
    for rank, r in enumerate(results):
        assert r["accelerate"]["accelerate_check"] == [False] * STEPS  # AcceleratedOptimizer.step_was_skipped
        assert r["accelerate"]["skipped"] == EXPECTED_SKIPPED[rank]  # what to read instead

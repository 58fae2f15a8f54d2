"""A checkpoint saved with a delayed round in flight resumes to the uninterrupted run (core wrapper, gloo ranks).

The run: a small MLP, SGD with momentum, levels ``{2: 2, 8: W}``, the top level delayed by 3 steps in 2 fragments
(rounds at counts 0, 4, 8, ... applied 3 counts later) with outer Nesterov SGD. Saved after 10 steps, while the
round started at count 8 is in flight (applied at 11), loaded into a new model and wrapper, run to 20 steps: the
parameters equal those of 20 uninterrupted steps (allclose 1e-6; they are equal in practice).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tests.harness import default_timeout, run_distributed

pytestmark = pytest.mark.timeout(default_timeout(240))

STEPS, SAVE_AT = 20, 10


def _build(world, **settings):
    from hieravg_optim import HierarchicalAveragingOptimizer, nesterov_outer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings = {"delay_steps": {8: 3}, "fragments": {8: 2}, "outer_optimizers": {8: nesterov_outer()}, **settings}
    return model, HierarchicalAveragingOptimizer(inner, {2: 2, 8: world}, **settings)


def _train(model, opt, rank, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(16, 6, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _resume(rank, world):
    model, opt = _build(world)
    _train(model, opt, rank, 0, STEPS)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, opt = _build(world)
    _train(model, opt, rank, 0, SAVE_AT)
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    in_flight = state["hierarchical_averaging"]["in_flight"]
    assert list(in_flight) == [8] and in_flight[8]["started"] == 8 and in_flight[8]["apply_at"] == 11
    assert in_flight[8]["fragment"] == 0 and in_flight[8]["snapshot"] is not None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # saving changes no tensor
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": state}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    # A run without the delay (the same fragments) refuses the round in flight instead of dropping it.
    plain_model, plain = _build(world, delay_steps=0)
    with pytest.raises(ValueError, match=r"round in flight of period 8 .*cannot be resumed: this averager has no delay_steps"):
        plain.load_state_dict(saved["opt"])
    # Nor does one whose outer optimizer steps other pieces: its momentum is per piece of the saved split.
    whole_model, whole = _build(world, fragments=1)
    with pytest.raises(ValueError, match=r"saved with its outer optimizer over fragments=2: tensor 0 \[0:42\).*here it steps whole tensors \(fragments=1\)"):
        whole.load_state_dict(saved["opt"])
    # Nor one that would give it another meaning: another correction, another split into fragments.
    _, other = _build(world, delay_correction="none")
    with pytest.raises(ValueError, match=r"started with delay_correction='eager', but this averager has delay_correction='none': resume with the saved run's delay_correction"):
        other.load_state_dict(saved["opt"])
    _, other = _build(world, fragments={8: 1}, outer_optimizers=None)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"started with fragments=2, but this averager has fragments=1"):
        other.load_state_dict(saved["opt"])

    # A round saved without "meaning" (by the versions before it) is applied with this run's delay_correction:
    # "none" drops the snapshot; "eager" refuses a round saved without one; a group of another size is refused.
    legacy = copy.deepcopy(saved["opt"])
    del legacy["hierarchical_averaging"]["in_flight"][8]["meaning"]
    none_model, none = _build(world, delay_correction="none")
    none.load_state_dict(legacy)
    assert none.averager._delayed.in_flight[1].snapshot is None
    for change, message in (
        ({"snapshot": None}, r"saved with delay_correction='none' .* applies it with delay_correction='eager'"),
        ({"group_size": 2}, rf"mean over a group of 2 ranks, but this level's group has {world}"),
    ):
        changed = copy.deepcopy(legacy)
        changed["hierarchical_averaging"]["in_flight"][8].update(change)
        other_model, other = _build(world)
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(changed)

    model, opt = _build(world)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert opt.averager.step == SAVE_AT and list(opt.averager._delayed.in_flight) == [1]
    _train(model, opt, rank, SAVE_AT, STEPS)
    resumed = [p.detach() for p in model.parameters()]
    worst = max(float((a - b).abs().max()) for a, b in zip(uninterrupted, resumed))
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(uninterrupted, resumed)), worst
    return worst


def test_resume_with_a_round_in_flight_equals_the_uninterrupted_run():
    worst = run_distributed(_resume, 4, timeout=200)
    assert max(worst) <= 1e-6

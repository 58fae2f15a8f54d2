"""The wrapper as a torch optimizer, on 4 real gloo ranks: checkpoints, LR schedulers, closures,
param groups, hooks. One spawn runs every scenario; each asserts inside the ranks."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from tests.harness import default_timeout, run_distributed, run_scenarios

WORLD = 4
LEVELS = {2: 2, 4: 4}
WARMUP = 2
pytestmark = pytest.mark.timeout(default_timeout(300))  # scaled like the harness's deadline


def _net() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _train(model, opt, rank: int, start: int, stop: int) -> None:
    for count in range(start, stop):
        gen = torch.Generator().manual_seed(1000 * rank + count)  # different data per rank and step
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _wrap(model, **kwargs):
    from hieravg_optim import HierarchicalAveragingOptimizer

    inner = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.02}], lr=0.01
    )
    return HierarchicalAveragingOptimizer(inner, LEVELS, warmup_steps=WARMUP, **kwargs)


def _roundtrip(obj):
    """Through torch.save / torch.load, as a real checkpoint."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------------------
def _scenario_state_dict_roundtrip(rank: int) -> dict:
    """Run 12 steps; separately run 5, save, rebuild, load, run 7 more: bit-identical, count included."""
    n, k = 12, 5
    model_a = _net()
    opt_a = _wrap(model_a)
    _train(model_a, opt_a, rank, 0, n)

    model_b = _net()
    opt_b = _wrap(model_b)
    _train(model_b, opt_b, rank, 0, k)
    checkpoint = _roundtrip({"model": model_b.state_dict(), "optim": opt_b.state_dict()})
    assert checkpoint["optim"]["step"] == k and checkpoint["optim"]["hierarchical_averaging"]["step"] == k
    _train(model_b, opt_b, rank, k, k + 1)  # keeps going: the checkpoint must not alias live state

    model_c = _net()
    with torch.no_grad():
        for p in model_c.parameters():
            p.add_(100.0)  # nothing of the fresh model survives the load
    opt_c = _wrap(model_c)
    model_c.load_state_dict(checkpoint["model"])
    opt_c.load_state_dict(checkpoint["optim"])
    assert opt_c.averaging_step == k
    _train(model_c, opt_c, rank, k, n)
    assert opt_c.averaging_step == opt_a.averaging_step == n
    for a, c in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(a, c), (a - c).abs().max()
    sa, sc = opt_a.optimizer.state_dict()["state"], opt_c.optimizer.state_dict()["state"]
    for i in sa:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[i][key], sc[i][key]), (i, key)
    return {"count": opt_c.averaging_step}


def _scenario_torch_checkpoints(rank: int) -> dict:
    """Load a state dict saved by torch's PostLocalSGDOptimizer (top-level "step"), continue side by
    side with it; torch's wrapper loads ours too."""
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    k, n = 5, 12
    ref_model = _net()
    ref = PostLocalSGDOptimizer(
        optim=torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9),
        averager=HierarchicalModelAverager(OrderedDict(LEVELS), warmup_steps=WARMUP),
    )
    _train(ref_model, ref, rank, 0, k)
    saved = _roundtrip({"model": ref_model.state_dict(), "optim": ref.state_dict()})
    assert saved["optim"]["step"] == k and "hierarchical_averaging" not in saved["optim"]

    from hieravg_optim import HierarchicalAveragingOptimizer

    model = _net()
    ours = HierarchicalAveragingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), LEVELS, warmup_steps=WARMUP
    )
    model.load_state_dict(saved["model"])
    ours.load_state_dict(saved["optim"])
    assert ours.averaging_step == k
    _train(model, ours, rank, k, n)
    _train(ref_model, ref, rank, k, n)
    assert ours.averaging_step == ref.averager.step == n
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()

    # The other way round: torch's wrapper reads our top-level "step".
    ref2 = PostLocalSGDOptimizer(
        optim=torch.optim.SGD(_net().parameters(), lr=0.05, momentum=0.9),
        averager=HierarchicalModelAverager(OrderedDict(LEVELS), warmup_steps=WARMUP),
    )
    ref2.load_state_dict(_roundtrip(ours.state_dict()))
    assert ref2.averager.step == n

    # No count at all: a ValueError naming the keys and the fix, and nothing changes; averaging_step= sets it.
    with pytest.raises(ValueError, match="no averaging step count.*averaging_step=N"):
        ours.load_state_dict(ours.optimizer.state_dict())
    assert ours.averaging_step == n
    ours.load_state_dict(ours.optimizer.state_dict(), averaging_step=0)
    assert ours.averaging_step == 0
    _train(model, ours, rank, 0, 1)  # count 0 >= warmup? no: warmup 2, so no averaging, but the check runs
    assert ours.averaging_step == 1
    return {"resumed_at": k}


def _scenario_asymmetric_resume(rank: int) -> dict:
    """Ranks resumed at different counts: RuntimeError at the next step on every rank, not a hang."""
    model = _net()
    opt = _wrap(model)
    _train(model, opt, rank, 0, 3)
    state = opt.state_dict()
    state["hierarchical_averaging"]["step"] = 7 if rank == 0 else 6
    opt.load_state_dict(state)
    try:
        _train(model, opt, rank, 7, 8)
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError("no RuntimeError")
    assert "averaging step count after load_state_dict" in message
    assert "rank 0 has 7, rank 1 has 6" in message, message
    # The check ran before the inner step: parameters were not touched by the failed step.
    return {"message": message}


# --------------------------------------------------------------------------------------------------
def _scenario_lr_schedulers(rank: int) -> dict:
    """LR schedulers drive the wrapper: their lr reaches the inner optimizer, as for a plain one."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    out = {}
    for make in (
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=8),
    ):
        model = _net()
        plain_model = _net()
        opt = HierarchicalAveragingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), LEVELS, warmup_steps=WARMUP
        )
        plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
        sched, plain_sched = make(opt), make(plain)
        lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
            for count in range(8):
                _train(model, opt, rank, count, count + 1)
                _train(plain_model, plain, rank, count, count + 1)
                sched.step()
                plain_sched.step()
                assert opt.optimizer.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
                assert opt.optimizer.param_groups[0]["momentum"] == plain.param_groups[0]["momentum"]
                lrs.append(opt.optimizer.param_groups[0]["lr"])
        assert sched.get_last_lr() == plain_sched.get_last_lr()
        out[type(sched).__name__] = lrs
    assert out["StepLR"] == [0.1, 0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125, 0.00625]
    return out


def _scenario_closures(rank: int) -> dict:
    """step(closure) returns the closure's loss, for SGD and for LBFGS (which calls it many times)."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    out = {}
    for make in (
        lambda ps: torch.optim.SGD(ps, lr=0.05),
        lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=4),
    ):
        model = _net()
        opt = HierarchicalAveragingOptimizer(make(model.parameters()), {1: 2, 2: 4})
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        calls = []

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            calls.append(float(loss))
            return loss

        losses = []
        for _ in range(3):
            n_before = len(calls)
            loss = opt.step(closure)
            assert isinstance(loss, torch.Tensor) and float(loss) == calls[n_before], (float(loss), calls)
            losses.append(float(loss))
        assert opt.averaging_step == 3
        out[type(opt.optimizer).__name__] = len(calls)
    assert out["SGD"] == 3 and out["LBFGS"] > 3
    return out


def _scenario_param_groups(rank: int) -> dict:
    """add_param_group reaches the inner optimizer and its params are averaged; assigning (and
    narrowing) param_groups, as DeepSpeed does, reaches the inner optimizer too."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    a = nn.Parameter(torch.full((2,), float(rank)))
    b = nn.Parameter(torch.full((3,), 10.0 * rank))
    c = nn.Parameter(torch.full((2, 2), -float(rank)))
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD([a], lr=0.0), {1: WORLD})  # averages every step
    opt.add_param_group({"params": [b], "lr": 0.0})
    assert len(opt.optimizer.param_groups) == 2 and opt.optimizer.param_groups[1]["params"][0] is b
    opt.step()
    mean_rank = (WORLD - 1) / 2
    assert torch.equal(a.detach(), torch.full((2,), mean_rank))
    assert torch.equal(b.detach(), torch.full((3,), 10.0 * mean_rank))

    # DeepSpeed-style: narrow param_groups for a step, then restore.
    opt.add_param_group({"params": [c], "lr": 0.0})
    with torch.no_grad():
        a.fill_(float(rank))
        c.fill_(-float(rank))
    full = opt.param_groups
    opt.param_groups = [full[2]]
    assert opt.optimizer.param_groups is opt.param_groups and len(opt.optimizer.param_groups) == 1
    opt.step()
    assert torch.equal(c.detach(), torch.full((2, 2), -mean_rank))
    assert torch.equal(a.detach(), torch.full((2,), float(rank))), "a was not in the narrowed groups"
    opt.param_groups = full
    assert opt.optimizer.param_groups is full

    # zero_grad reaches the inner optimizer.
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in (a, b, c))
    opt.zero_grad()
    assert all(p.grad is None for p in (a, b, c))
    return {}


def _scenario_optimizer_protocol(rank: int) -> dict:
    """What reasonable users call on a torch optimizer: hooks, repr, state/defaults, pickling."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    model = _net()
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), LEVELS)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults is opt.optimizer.defaults and opt.state is opt.optimizer.state
    events = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: events.append(("pre", o.averaging_step)))
    post = opt.register_step_post_hook(lambda o, args, kwargs: events.append(("post", o.averaging_step)))
    sd_post = opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    load_pre = opt.register_load_state_dict_pre_hook(
        lambda o, sd: events.append("load_pre") or {k: v for k, v in sd.items() if k != "extra"}
    )
    _train(model, opt, rank, 0, 2)
    assert events == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)], events
    pre.remove()
    post.remove()
    _train(model, opt, rank, 2, 3)
    assert len(events) == 4
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert events[-1] == "load_pre"
    sd_post.remove()
    load_pre.remove()
    assert opt.averaging_step == 3
    _train(model, opt, rank, 3, 4)  # the post-load check

    # A checkpoint saved with other levels: a warning at the caller, and the count continues.
    other = HierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), {4: WORLD})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(opt.state_dict())
    mine = [w for w in caught if "was saved with levels [(2, 2), (4, 4)]" in str(w.message)]
    assert len(mine) == 1 and mine[0].filename == __file__, [(str(w.message), w.filename) for w in caught]
    assert other.averaging_step == 4
    _train(model, other, rank, 4, 5)
    assert other.averaging_step == 5
    text = repr(opt)
    assert "HierarchicalAveragingOptimizer" in text and "SGD" in text and "{2: 2, 4: 4}" in text, text
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="single Tensor"):
        HierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), LEVELS, buffers=torch.ones(2))
    with pytest.raises(TypeError, match="already a HierarchicalAveragingOptimizer"):
        HierarchicalAveragingOptimizer(opt, LEVELS)
    return {"repr": text}


# --------------------------------------------------------------------------------------------------
def _scenario_state_shapes(rank: int) -> dict:
    """A state dict saved for other-shaped parameters (no outer optimizer): a ValueError at load naming the
    mismatch, nothing changed; Adafactor's factored state (shapes that broadcast) still loads."""
    from hieravg_optim import HierarchicalAveragingOptimizer

    model = _net()
    opt = _wrap(model)
    _train(model, opt, rank, 0, 3)
    saved = _roundtrip(opt.state_dict())

    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))  # a hidden layer resized: 6 -> 5
    other_opt = _wrap(other)
    with pytest.raises(ValueError) as caught:
        other_opt.load_state_dict(saved)
    assert other_opt.averaging_step == 0 and not other_opt.optimizer.state  # nothing changed
    _train(other, other_opt, rank, 0, 1)  # and it steps on, fresh

    fmodel = _net()
    factored = HierarchicalAveragingOptimizer(torch.optim.Adafactor(fmodel.parameters(), lr=0.01), LEVELS)
    _train(fmodel, factored, rank, 0, 1)
    state = _roundtrip(factored.state_dict())
    assert any(v.shape != p.shape for p in fmodel.parameters() for v in factored.state[p].values() if v.dim())
    factored.load_state_dict(state)
    return {"message": str(caught.value)}


# --------------------------------------------------------------------------------------------------
SCENARIOS = {
    "state_dict_roundtrip": _scenario_state_dict_roundtrip,
    "torch_checkpoints": _scenario_torch_checkpoints,
    "lr_schedulers": _scenario_lr_schedulers,
    "closures": _scenario_closures,
    "param_groups": _scenario_param_groups,
    "optimizer_protocol": _scenario_optimizer_protocol,
    "state_shapes": _scenario_state_shapes,
    "asymmetric_resume": _scenario_asymmetric_resume,  # last: leaves its optimizer unusable
}


def _run_all(rank: int, world_size: int) -> dict:
    assert world_size == WORLD
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run_all, WORLD, timeout=240, pg_timeout=60)


def test_state_dict_round_trip_is_exact(results):
    assert [r["state_dict_roundtrip"]["count"] for r in results] == [12] * WORLD


def test_torch_post_local_sgd_checkpoints(results):
    assert all(r["torch_checkpoints"]["resumed_at"] == 5 for r in results)


def test_asymmetric_resume_raises_on_every_rank(results):
    for r in results:
        assert "rank 0 has 7, rank 1 has 6" in r["asymmetric_resume"]["message"]


def test_lr_schedulers_drive_the_wrapper(results):
    lrs = results[0]["lr_schedulers"]["OneCycleLR"]
    assert max(lrs) > 0.1 and lrs[-1] < lrs[2]  # it went up, then down
    assert all(r["lr_schedulers"] == results[0]["lr_schedulers"] for r in results)


def test_closures(results):
    assert all(r["closures"]["SGD"] == 3 for r in results)


def test_param_groups_reach_the_inner_optimizer(results):
    assert all(r["param_groups"] == {} for r in results)


def test_state_dict_of_other_shapes_is_refused_at_load(results):
    for r in results:
        assert r["state_shapes"]["message"] == (
            "The optimizer state dict was saved for parameters of other shapes: state 'exp_avg' of parameter 0 of "
            "param_groups[0] (key 0) has shape (6, 4), the parameter (5, 4). Load the state dict of the same model "
            "(same layer sizes), or leave the optimizer state out to start it afresh."
        )


def test_optimizer_protocol(results):
    assert all("inner=SGD" in r["optimizer_protocol"]["repr"] for r in results)

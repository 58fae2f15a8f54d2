"""Outer optimizers under misuse, on 4 real gloo ranks: every fault is an error on every rank, never a hang,
never silently wrong outer steps, never a half-loaded state.

One spawn runs every scenario (levels ``{2: 2, 4: 4}``); each scenario returns what every rank saw, and the
checks below assert it per rank.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from hieravg_optim.schedule import AveragingLevel
from tests.harness import default_timeout, run_distributed, run_scenarios

WORLD = 4
LEVELS = {2: 2, 4: 4}
STATE_KEY = "hierarchical_averaging"
pytestmark = pytest.mark.timeout(default_timeout(180))


def _model(rank: int) -> list[nn.Parameter]:
    base = torch.tensor([1.0, 2.0, -1.0, 0.5, -0.5, 1.5, 0.0]) + 0.25 * rank
    return [nn.Parameter(base[:3].clone()), nn.Parameter(base[3:].view(2, 2).clone())]


def _train(params, opt, rank: int, start: int, stop: int) -> None:
    for count in range(start, stop):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, -0.125 * (rank + 1) * (count % 3 + 1) * (i + 1))
        opt.step()


def _wrap(params, **kwargs):
    from hieravg_optim import HierarchicalAveragingOptimizer

    kwargs.setdefault("collective_timeout_s", 30)
    return HierarchicalAveragingOptimizer(torch.optim.SGD(params, lr=1.0, momentum=0.5), LEVELS, **kwargs)


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def _scenario_factories(rank: int) -> dict:
    """Factories that do not build the outer optimizer over exactly the tensors they are given."""
    from hieravg_optim import nesterov_outer

    params = _model(rank)
    cache: dict[str, torch.optim.Optimizer] = {}

    def cached(tensors):  # one optimizer for every level: the second level would step the first one's anchors
        return cache.setdefault("opt", torch.optim.SGD(tensors, lr=0.7, momentum=0.9))

    cases = {
        # A factory closing over the model: the outer step would step the parameters with their inner gradients.
        "over the model": lambda: _wrap(params, outer_optimizers={4: lambda ts: torch.optim.SGD(params, lr=0.7)}),
        "first tensor only": lambda: _wrap(
            _model(rank), outer_optimizers={4: lambda ts: torch.optim.SGD(ts[:1], lr=1)}
        ),
        "copies": lambda: _wrap(
            _model(rank), outer_optimizers={4: lambda ts: torch.optim.SGD([t.clone() for t in ts], lr=1)}
        ),
        "one optimizer for two levels": lambda: _wrap(_model(rank), outer_optimizers={2: cached, 4: cached}),
        "lr nan": lambda: _wrap(_model(rank), outer_optimizers={4: lambda ts: torch.optim.SGD(ts, lr=float("nan"))}),
        "eps inf": lambda: _wrap(_model(rank), outer_optimizers={2: lambda ts: torch.optim.Adam(ts, eps=float("inf"))}),
        "maximize": lambda: _wrap(_model(rank), outer_optimizers={4: lambda ts: torch.optim.SGD(ts, maximize=True)}),
        # Each value valid, but the ranks' outer optimizers differ: the replicas would drift apart silently.
        "lr per rank": lambda: _wrap(_model(rank), outer_optimizers={4: nesterov_outer(lr=0.5 if rank == 3 else 0.7)}),
        "class per rank": lambda: _wrap(
            _model(rank),
            outer_optimizers={
                4: (lambda ts: torch.optim.Adam(ts, lr=0.1)) if rank == 1 else (lambda ts: torch.optim.SGD(ts, lr=0.1))
            },
        ),
    }
    return {name: _outcome(fn) for name, fn in cases.items()}


def _scenario_anchors_on_some_ranks(rank: int) -> dict:
    """``take_anchors`` called on ranks 0 and 2 only (one per group of the lower level), between rounds."""
    from hieravg_optim import nesterov_outer

    params = _model(rank)
    opt = _wrap(params, outer_optimizers={2: nesterov_outer(), 4: nesterov_outer()})
    _train(params, opt, rank, 0, 4)  # both levels have had a round: the anchors are equal across ranks
    if rank in (0, 2):
        opt.averager.take_anchors(opt.tensors_to_average())
    return {"outcome": _outcome(lambda: _train(params, opt, rank, 4, 6))}


def _scenario_take_fails_on_one_rank(rank: int) -> dict:
    """Taking the anchors fails on rank 2 only (as when its accelerator has no memory left for them)."""

    def factory(tensors):
        if rank == 2 and len(tensors) > 1:  # passes the one-tensor probe at construction
            raise RuntimeError("out of memory allocating the outer state")
        return torch.optim.SGD(tensors, lr=0.7, momentum=0.9, nesterov=True)

    out = {"at construction": _outcome(lambda: _wrap(_model(rank), outer_optimizers={4: factory}))}
    params = _model(rank)
    opt = _wrap(params, warmup_steps=2, outer_optimizers={4: factory})
    out["after the warm-up"] = _outcome(lambda: _train(params, opt, rank, 0, 2))
    out["anchors"] = opt.averager.has_anchors
    return out


def _scenario_factory_fails_on_real_tensors(rank: int) -> dict:
    """Factories that pass the one-element probe at construction but fail on the level's real anchors."""

    class _LargeTensors(ValueError):
        pass

    def small_only(tensors):  # raises inside its constructor for anything larger than the probe
        if any(t.numel() > 1 for t in tensors):
            raise _LargeTensors(f"tensor of {max(t.numel() for t in tensors)} elements")
        return torch.optim.SGD(tensors, lr=0.7)

    def copies_of_large(tensors):  # over the probe itself, but over copies of the real anchors
        return torch.optim.SGD(tensors if tensors[0].numel() == 1 else [t.clone() for t in tensors], lr=0.7)

    out = {
        "raises at construction": _outcome(lambda: _wrap(_model(rank), outer_optimizers={4: small_only})),
        "raises at level 2": _outcome(lambda: _wrap(_model(rank), outer_optimizers={2: small_only})),
        "other tensors at construction": _outcome(lambda: _wrap(_model(rank), outer_optimizers={4: copies_of_large})),
    }
    params = _model(rank)
    opt = _wrap(params, warmup_steps=2, outer_optimizers={4: small_only})
    out["raises after the warm-up"] = _outcome(lambda: _train(params, opt, rank, 0, 2))
    out["step after the warm-up"] = opt.averager.step
    # A checkpoint without anchors, past the warm-up: the anchors are taken at the next step, where the
    # factory fails on rank 1 only. Every rank raises there, not a hang at the next round.
    plain_params = _model(rank)
    plain = _wrap(plain_params)
    _train(plain_params, plain, rank, 0, 3)
    failing = {"on": False}

    def fails_later_on_rank_1(tensors):
        if failing["on"] and rank == 1:
            raise RuntimeError("out of memory allocating the outer state")
        return torch.optim.SGD(tensors, lr=0.7, momentum=0.9, nesterov=True)

    params = _model(rank)
    resumed = _wrap(params, outer_optimizers={4: fails_later_on_rank_1})
    resumed.load_state_dict(copy.deepcopy(plain.state_dict()))
    failing["on"] = True
    out["raises at the step after a load"] = _outcome(lambda: _train(params, resumed, rank, 3, 5))
    out["anchors after the load"] = resumed.averager.has_anchors
    return out


def _scenario_load_halfway(rank: int) -> dict:
    """A state dict whose outer state the outer optimizer rejects: an error, and nothing changed."""
    from hieravg_optim import nesterov_outer

    def build():
        params = _model(rank)
        return params, _wrap(params, outer_optimizers={2: nesterov_outer(), 4: nesterov_outer()})

    params, opt = build()
    _train(params, opt, rank, 0, 4)
    saved = copy.deepcopy(opt.state_dict())
    other_params, other = build()
    _train(other_params, other, rank, 0, 6)
    before = copy.deepcopy(other.state_dict())

    def unchanged() -> bool:
        now = other.state_dict()
        same = now["step"] == before["step"] and all(
            torch.equal(now["state"][k]["momentum_buffer"], before["state"][k]["momentum_buffer"]) for k in now["state"]
        )
        for period in (2, 4):
            a, b = now[STATE_KEY]["outer"][period], before[STATE_KEY]["outer"][period]
            same &= all(torch.equal(x, y) for x, y in zip(a["anchors"], b["anchors"]))
            same &= all(
                torch.equal(x["momentum_buffer"], b["optimizer"]["state"][k]["momentum_buffer"])
                for k, x in a["optimizer"]["state"].items()
            )
        return bool(same)

    out = {}
    # The top level's outer state split into two parameter groups: torch.optim rejects it, after the lower
    # level, the count and the inner optimizer would have been loaded.
    split = copy.deepcopy(saved)
    groups = split[STATE_KEY]["outer"][4]["optimizer"]["param_groups"]
    groups[:] = [{**groups[0], "params": [0]}, {**groups[0], "params": [1]}]
    out["split groups"] = _outcome(lambda: other.load_state_dict(split))
    out["split groups unchanged"] = unchanged()
    # The top level's outer state of another optimizer class (Adam), loaded into Nesterov SGD.
    adam = copy.deepcopy(saved)
    anchors = [torch.zeros_like(a) for a in adam[STATE_KEY]["outer"][4]["anchors"]]
    adam[STATE_KEY]["outer"][4]["optimizer"] = torch.optim.Adam(anchors).state_dict()
    out["other class"] = _outcome(lambda: other.load_state_dict(adam))
    out["other class unchanged"] = unchanged()
    # A momentum buffer of another shape.
    shape = copy.deepcopy(saved)
    state = shape[STATE_KEY]["outer"][4]["optimizer"]["state"]
    state[0]["momentum_buffer"] = torch.zeros(5)
    out["buffer shape"] = _outcome(lambda: other.load_state_dict(shape))
    out["buffer shape unchanged"] = unchanged()
    # Anchors of another model, loaded during a warm-up (before this rank has anchors of its own): rejected
    # at the load, against the parameters, not at the first round after the warm-up.
    warm_params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))]
    warm = _wrap(warm_params, warmup_steps=8, outer_optimizers={2: nesterov_outer(), 4: nesterov_outer()})
    out["warm-up other model"] = _outcome(lambda: warm.load_state_dict(saved))
    out["warm-up other model unchanged"] = warm.averaging_step == 0 and not warm.averager.has_anchors
    # The untouched state dict still loads, into the same outer optimizer objects, and the run continues as
    # the saved one did.
    in_use = {p: other.averager.outer_optimizer(p) for p in (2, 4)}
    other.load_state_dict(saved)
    out["same objects"] = all(other.averager.outer_optimizer(p) is in_use[p] for p in (2, 4))
    loaded = other.averager.outer_optimizer(4).state_dict()["state"]
    out["momentum loaded"] = all(
        torch.equal(loaded[k]["momentum_buffer"], s["momentum_buffer"])
        for k, s in saved[STATE_KEY]["outer"][4]["optimizer"]["state"].items()
    )
    out["no such period"] = _outcome(lambda: other.averager.outer_optimizer(3))
    with torch.no_grad():
        for p, q in zip(other_params, params):
            p.copy_(q)
    _train(params, opt, rank, 4, 8)
    _train(other_params, other, rank, 4, 8)
    out["resumed equal"] = all(torch.equal(p, q) for p, q in zip(params, other_params))
    return out


class _FailingSGD(torch.optim.SGD):
    """Nesterov SGD whose first step raises (at the same count on every rank)."""

    def __init__(self, tensors):
        super().__init__(tensors, lr=0.7, momentum=0.9, nesterov=True)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("outer step failed")
        return super().step(closure)


def _scenario_memory(rank: int) -> dict:
    """What ``outer_bytes`` reports against what the outer state holds; no pseudo-gradient kept between rounds."""
    from hieravg_optim import nesterov_outer

    params = _model(rank)
    opt = _wrap(params, outer_optimizers={2: nesterov_outer(), 4: _FailingSGD})
    numel = sum(p.numel() for p in params)
    out = {"numel": numel, "rounds": []}
    for count in range(6):
        outcome = _outcome(lambda: _train(params, opt, rank, count, count + 1))
        held = {}
        for o in opt.averager._outer:
            tensors = list(o.anchors) + [a.grad for a in o.anchors if a.grad is not None]
            for s in o.optimizer.state.values():
                tensors += [v for v in s.values() if torch.is_tensor(v)]
            held[o.period] = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
        grads = sum(a.grad is not None for o in opt.averager._outer for a in o.anchors)
        reported = {p: m["outer_bytes"] for p, m in opt.metrics().items()}
        out["rounds"].append({"outcome": outcome, "held": held, "reported": reported, "grads": grads})
    return out


def _scenario_held(rank: int) -> dict:
    """Misuse that the library already answers with an error on every rank (kept as regression checks)."""
    from hieravg_optim import nesterov_outer

    out = {}
    # A parameter group added after the anchors were taken: the next round raises on every rank of its group.
    params = _model(rank)
    opt = _wrap(params, outer_optimizers={2: nesterov_outer()})
    extra = nn.Parameter(torch.full((2,), float(rank)))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.zeros(2)
    out["add_param_group"] = _outcome(lambda: _train(params, opt, rank, 0, 3))
    # The fix the message names: anchors taken again on every rank; the rounds then run, replicas equal.
    opt.averager.take_anchors(opt.tensors_to_average())
    retaken = []
    for count in (2, 3, 4, 5):
        _train(params, opt, rank, count, count + 1)
        extra.grad = torch.zeros(2)
        if count % 2 == 0:
            mine = torch.cat([t.reshape(-1) for t in opt.tensors_to_average()])
            group = [torch.zeros_like(mine) for _ in range(WORLD)]
            torch.distributed.all_gather(group, mine)
            pair = (rank // 2) * 2
            retaken.append(torch.equal(group[pair], group[pair + 1]))
    out["add_param_group retaken"] = retaken
    # Non-finite parameters on ranks 1 and 3 when an outer level is due, nonfinite="raise": every rank of the group
    # raises before averaging, and the anchors and outer momentum are those of the last good round.
    params = _model(rank)
    opt = _wrap(params, outer_optimizers={2: nesterov_outer(), 4: nesterov_outer()})
    _train(params, opt, rank, 0, 4)
    before = copy.deepcopy(opt.averager.state_dict()["outer"])
    if rank in (1, 3):
        with torch.no_grad():
            params[0][0] = float("nan")
    out["nan raise"] = _outcome(lambda: _train(params, opt, rank, 4, 6))
    after = opt.averager.state_dict()["outer"]
    out["nan raise kept"] = all(
        torch.equal(x, y) for p in (2, 4) for x, y in zip(before[p]["anchors"], after[p]["anchors"])
    )
    return out


def _scenario_everything_at_once(rank: int) -> dict:
    """Synchronous warm-up, bf16 on the wire, outer state in host memory, AdamW with weight decay at the lower
    level and Nesterov at the top, and rank 3 non-finite before a top-level round (``skip_replica``): after
    every round the replicas of its group hold the same parameters, anchors and outer optimizer state."""
    from hieravg_optim import nesterov_outer

    params = _model(rank)
    opt = _wrap(
        params,
        warmup_steps=3,
        synchronous_warmup=True,
        comm_dtype="bfloat16",
        nonfinite="skip_replica",
        outer_state_device="cpu",
        outer_optimizers={2: lambda ts: torch.optim.AdamW(ts, lr=0.05, weight_decay=0.1), 4: nesterov_outer()},
    )
    rows = []
    for count in range(10):
        _train(params, opt, rank, count, count + 1)
        if rank == 3 and count == 3:
            with torch.no_grad():
                params[1][0, 0] = float("inf")  # averaged away at the top-level round of count 4
        state = opt.averager.state_dict().get("outer", {})
        # Equal over everyone after a top-level round: the parameters, every anchor, the top level's outer
        # state. The lower level's outer state (AdamW moments) is kept through it and stays per group.
        flat = [torch.cat([p.detach().reshape(-1) for p in params])]
        lower = []
        for period in sorted(state):
            flat.append(torch.cat([a.reshape(-1) for a in state[period]["anchors"]]))
            for s in state[period]["optimizer"]["state"].values():
                (flat if period == 4 else lower).extend(v.reshape(-1).float() for v in s.values() if torch.is_tensor(v))
        shared = torch.cat(flat)
        mine = torch.cat([shared, *lower])
        everyone = [torch.zeros_like(mine) for _ in range(WORLD)]
        torch.distributed.all_gather(everyone, mine)
        n = shared.numel()
        rows.append([torch.equal(everyone[r], everyone[r ^ 1]) for r in range(WORLD)] + [
            all(torch.equal(everyone[r][:n], everyone[0][:n]) for r in range(WORLD)), bool(torch.isfinite(mine).all())
        ])
    return {"rows": rows}


def _scenario_buffers(rank: int) -> dict:
    """Buffers (``buffers=``) are averaged plainly at a level with an outer optimizer; parameters get the outer step."""
    from hieravg_optim import nesterov_outer

    params = _model(rank)
    running_var = torch.full((3,), 1.0 + rank)  # a BatchNorm-like statistic, positive on every rank
    opt = _wrap(params, buffers=[running_var], outer_optimizers={4: nesterov_outer(lr=0.7, momentum=0.9)})
    out = []
    for count in range(9):  # the top level's rounds at counts 0, 4 and 8
        running_var.fill_(float(count) + 2.0 * rank)
        _train(params, opt, rank, count, count + 1)
        if count % 4 == 0:
            out.append({"count": count, "running_var": running_var.tolist(), "anchors": len(opt.averager.state_dict()["outer"][4]["anchors"])})
    return {"rounds": out, "params": [p.detach().flatten().tolist() for p in params]}


def _scenarios(rank: int, world_size: int) -> dict:
    assert world_size == WORLD
    warnings.simplefilter("ignore")
    return run_scenarios(
        {
            "factories": _scenario_factories,
            "some ranks": _scenario_anchors_on_some_ranks,
            "take fails": _scenario_take_fails_on_one_rank,
            "factory fails": _scenario_factory_fails_on_real_tensors,
            "load": _scenario_load_halfway,
            "memory": _scenario_memory,
            "held": _scenario_held,
            "everything": _scenario_everything_at_once,
            "buffers": _scenario_buffers,
        },
        rank,
    )


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_scenarios, WORLD, timeout=150)


def test_factory_must_build_over_exactly_the_given_tensors(results):
    pattern = r"outer_optimizers\[4\] .*must build the optimizer over exactly the \d+ tensor\(s\) it is given"
    for rank, res in enumerate(results):
        for name in ("over the model", "first tensor only", "copies"):
            kind, message = res["factories"][name]
            assert kind == "TypeError" and re.search(pattern, message), (rank, name, message)
        kind, message = res["factories"]["one optimizer for two levels"]
        assert kind == "TypeError" and "outer_optimizers[4]" in message, (rank, message)


def test_non_finite_or_maximizing_outer_hyperparameters_raise_on_every_rank(results):
    for rank, res in enumerate(results):
        for name, pattern in {
            "lr nan": r"outer_optimizers\[4\] .* builds SGD with lr=nan: every hyperparameter .* must be finite",
            "eps inf": r"outer_optimizers\[2\] .* builds Adam with eps=inf",
            "maximize": r"outer_optimizers\[4\] .* builds SGD with maximize=True: .* Leave maximize=False",
        }.items():
            kind, message = res["factories"][name]
            assert kind == "ValueError" and re.search(pattern, message), (rank, name, message)


def test_outer_optimizers_differing_across_ranks_raise_on_every_rank(results):
    for rank, res in enumerate(results):
        for name in ("lr per rank", "class per rank"):
            kind, message = res["factories"][name]
            assert kind == "RuntimeError" and "outer optimizer" in message, (rank, name, message)


def test_anchors_taken_on_some_ranks_only_raise_on_every_rank(results):
    for rank, res in enumerate(results):
        kind, message = res["some ranks"]["outcome"]
        assert kind == "RuntimeError" and "anchors" in message, (rank, message)
        assert "timed out" not in message and "Timeout" not in message, (rank, message)


_LEVEL_4 = re.escape("outer_optimizers[4] (the level of period 4, group size 4): the factory ")
_FIX = re.escape("The factory must accept any number of tensors of any shape")


def test_anchors_failing_on_one_rank_raise_on_every_rank(results):
    for rank, res in enumerate(results):
        for when in ("at construction", "after the warm-up"):
            kind, message = res["take fails"][when]
            if rank == 2:
                assert kind == "RuntimeError" and re.match(
                    _LEVEL_4 + r".* raised RuntimeError: out of memory allocating the outer state when building the "
                    r"outer optimizer over the level's 2 fp32 anchor tensor\(s\) of shapes \[\(3,\), \(2, 2\)\]",
                    message,
                ), (when, message)
                assert 'outer_state_device="cpu"' in message, message
            else:
                assert kind == "RuntimeError" and re.search(
                    r"Rank 2 failed while checking taking the anchors of the outer optimizers: RuntimeError: "
                    + _LEVEL_4
                    + r".* raised RuntimeError: out of memory allocating the outer state",
                    message,
                ), (rank, when, message)
        assert res["take fails"]["anchors"] is (rank != 2), rank


def test_factory_failing_on_the_real_anchors_names_the_level_on_every_rank(results):
    for rank, res in enumerate(results):
        r = res["factory fails"]
        for when in ("raises at construction", "raises after the warm-up"):
            kind, message = r[when]
            # The factory raised on every rank: each raises its own error, of the factory's kind, naming the level.
            assert kind == "ValueError" and re.match(
                _LEVEL_4 + r".* raised _LargeTensors: tensor of 4 elements when building the outer optimizer over the "
                r"level's 2 fp32 anchor tensor\(s\) of shapes \[\(3,\), \(2, 2\)\] on \['cpu'\]\. " + _FIX,
                message,
            ), (rank, when, message)
        assert r["step after the warm-up"] == 1, (rank, r)  # the count did not pass the failed end of the warm-up
        kind, message = r["raises at level 2"]
        assert kind == "ValueError" and message.startswith(
            "outer_optimizers[2] (the level of period 2, group size 2): the factory "
        ), (rank, message)
        kind, message = r["other tensors at construction"]
        assert kind == "TypeError" and re.match(
            _LEVEL_4 + r".* built an optimizer over 2 tensor\(s\) \(2 of them not among those it was given\), but "
            r"the factory must build the optimizer over exactly the 2 tensor\(s\) it is given",
            message,
        ), (rank, message)
        kind, message = r["raises at the step after a load"]
        if rank == 1:
            assert kind == "RuntimeError" and re.match(_LEVEL_4 + r".* raised RuntimeError: out of memory", message), (
                rank,
                message,
            )
        else:
            assert kind == "RuntimeError" and re.match(
                r"Rank 1 failed while checking taking the anchors of the outer optimizers: RuntimeError: " + _LEVEL_4,
                message,
            ), (rank, message)
        assert "Timeout" not in message and "timed out" not in message, (rank, message)
        assert r["anchors after the load"] is (rank != 1), (rank, r)


def test_rejected_outer_state_changes_nothing_and_a_load_keeps_the_outer_optimizers(results):
    for rank, res in enumerate(results):
        load = res["load"]
        for name in ("split groups", "other class", "buffer shape"):
            kind, message = load[name]
            assert kind == "ValueError" and "period 4" in message, (rank, name, message)
            assert load[f"{name} unchanged"], (rank, name)
        assert load["resumed equal"], rank
        assert load["same objects"] and load["momentum loaded"], rank
        assert load["warm-up other model"] == (
            "ValueError",
            "The outer state of period 2 in the averaging state dict: anchor 1 has shape (2, 2), but this rank's "
            "tensor 1 has shape (4,): load the checkpoint of the same model and sharding.",
        ), (rank, load["warm-up other model"])
        assert load["warm-up other model unchanged"], rank
        assert load["no such period"] == (
            "ValueError",
            "outer_optimizer(3): no level of period 3 has an outer optimizer; those with one: [2, 4].",
        )


def test_outer_bytes_is_what_is_held_and_no_pseudo_gradient_stays(results):
    for rank, res in enumerate(results):
        mem = res["memory"]
        numel = mem["numel"]
        for count, row in enumerate(mem["rounds"]):
            assert row["grads"] == 0, (rank, count, row)
            assert row["reported"][2] == row["held"][2] and row["reported"][4] == row["held"][4], (rank, count, row)
        # Count 0 is a top-level round: its first outer step raised on every rank, left no pseudo-gradient
        # behind, and the count did not advance; the next call ran that round again.
        assert [r["outcome"][0] for r in mem["rounds"]] == ["RuntimeError", "", "", "", "", ""], (rank, mem)
        assert mem["rounds"][0]["reported"] == {2: 4 * numel, 4: 4 * numel}
        # After a round of each level: fp32 anchors plus one fp32 momentum buffer per level, nothing else.
        assert mem["rounds"][-1]["reported"] == {2: 2 * 4 * numel, 4: 2 * 4 * numel}


def test_misuse_already_raising_on_every_rank(results):
    for rank, res in enumerate(results):
        held = res["held"]
        kind, message = held["add_param_group"]
        assert kind == "RuntimeError" and "differ from the level's anchors" in message, (rank, message)
        assert "opt.averager.take_anchors(opt.tensors_to_average())" in message, (rank, message)
        assert held["add_param_group retaken"] == [True] * 2, (rank, held)
        kind, message = held["nan raise"]
        assert kind == "RuntimeError" and "Non-finite" in message, (rank, message)
        assert held["nan raise kept"], rank


def test_replicas_stay_identical_with_every_option_at_once(results):
    from hieravg_optim.schedule import level_at

    for rank, res in enumerate(results):
        assert res["everything"]["rows"][3][-1] is (rank != 3), rank  # rank 3 went non-finite at count 3
        for count, row in enumerate(res["everything"]["rows"]):
            *pairs, everyone, finite = row
            if count < 3:  # synchronous warm-up: every count averages over everyone
                expected = "all"
            else:
                level = level_at(count, tuple(AveragingLevel(p, g) for p, g in LEVELS.items()), 3)
                expected = {None: None, 0: "pairs", 1: "all"}[level]
            if expected == "all":
                assert everyone and finite, (rank, count, row)
            if expected in ("all", "pairs"):
                assert all(pairs), (rank, count, row)


def test_buffers_are_averaged_plainly_at_an_outer_level(results):
    for rank, per_rank in enumerate(results):
        rounds = per_rank["buffers"]["rounds"]
        assert [r["count"] for r in rounds] == [0, 4, 8], rank
        for r in rounds:
            # count + 2 * rank on ranks 0-3: the plain mean is count + 3, which an outer step would overshoot.
            assert r["running_var"] == [r["count"] + 3.0] * 3, (rank, r)
            assert r["anchors"] == 2, (rank, r)  # the two parameters, not the buffer
    assert all(per_rank["buffers"]["params"] == results[0]["buffers"]["params"] for per_rank in results)

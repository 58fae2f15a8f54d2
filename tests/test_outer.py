"""Outer optimizers per level (DiLoCo, HALoS) on 4 real gloo ranks, against a reference computed here.

One spawn runs every scenario. The ranks start from different parameters (set from the rank) and move by
known, rank-dependent displacements (inner SGD with lr 1 and ``grad = -displacement``), so every group mean
is known. :func:`_reference` replays the documented semantics for all 4 replicas in one process with
``torch.optim.SGD`` on copies: anchors taken at construction (``warmup_steps=0``) or after count
``warmup_steps - 1``, averaged over the group at the level's first round, ``g = anchor - mean``, one outer
step, the anchor copied into the parameters, lower anchors reset to the result.
"""

from __future__ import annotations

import io
import math
import re
import warnings

import pytest
import torch
from torch import nn

from hieravg_optim.schedule import level_at
from tests.harness import default_timeout, run_distributed, run_scenarios
from tests.launch import ROOT

WORLD = 4
LEVELS = {2: 2, 4: 4}
NESTEROV = (0.7, 0.9)  # lr, momentum
STATE_KEY = "hierarchical_averaging"
pytestmark = pytest.mark.timeout(default_timeout(240))


# -- the model and its moves, shared by the ranks and the reference -----------------------------------
def _init(rank: int) -> torch.Tensor:
    """Rank ``rank``'s starting parameters, flattened: 3 elements of a vector, then a 2 x 2 matrix."""
    return torch.tensor([1.0, 2.0, -1.0, 0.5, -0.5, 1.5, 0.0]) + 0.25 * rank


def _move(rank: int, count: int) -> torch.Tensor:
    """What rank ``rank``'s inner step adds to its parameters at count ``count`` (multiples of 1/32)."""
    return torch.tensor([0.5, -0.25, 1.0, 0.125, -1.0, 0.75, 0.25]) * (rank + 1) * ((count % 3) + 1) / 8


def _model(rank: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    flat = _init(rank).to(dtype)
    return [nn.Parameter(flat[:3].clone()), nn.Parameter(flat[3:].view(2, 2).clone())]


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def _train(params, opt, rank: int, start: int, stop: int, on_step=None) -> None:
    for count in range(start, stop):
        move = _move(rank, count)
        params[0].grad = (-move[:3]).to(params[0].dtype)
        params[1].grad = (-move[3:]).view(2, 2).to(params[1].dtype)
        opt.step()
        if on_step is not None:
            on_step(count)


def _wrap(params, **kwargs):
    from hieravg_optim import HierarchicalAveragingOptimizer

    return HierarchicalAveragingOptimizer(torch.optim.SGD(params, lr=1.0), LEVELS, **kwargs)


def _anchors(opt) -> dict[int, torch.Tensor]:
    """This rank's anchors per period, flattened, read through the public state dict."""
    outer = opt.state_dict()[STATE_KEY].get("outer", {})
    return {int(p): torch.cat([a.reshape(-1) for a in s["anchors"]]).clone() for p, s in outer.items()}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _sgd(lr: float = 1.0, momentum: float = 0.0):
    return lambda tensors: torch.optim.SGD(tensors, lr=lr, momentum=momentum)


# -- the reference --------------------------------------------------------------------------------------
def _reference(outer: dict[int, tuple[float, float]], steps: int, warmup: int = 0, sync: bool = False) -> list[dict]:
    """Every replica's parameters and anchors after each count, by the documented semantics.

    ``outer``: ``{period: (lr, momentum)}`` of Nesterov SGD. Returns one dict per count:
    ``{"params": [per rank], "anchors": {period: [per rank]}, "level": index or None}``.
    """
    levels = list(LEVELS.items())
    params = [_init(r) for r in range(WORLD)]
    anchors: dict[int, list] = {p: [None] * WORLD for p in outer}
    opts: dict[int, list] = {p: [None] * WORLD for p in outer}
    synced: dict[int, bool] = {p: False for p in outer}

    def take() -> None:
        for period, (lr, momentum) in outer.items():
            anchors[period] = [params[r].clone() for r in range(WORLD)]
            opts[period] = [
                torch.optim.SGD([a], lr=lr, momentum=momentum, nesterov=momentum > 0) for a in anchors[period]
            ]
            synced[period] = False

    if warmup == 0:
        take()
    trajectory = []
    for count in range(steps):
        params = [params[r] + _move(r, count) for r in range(WORLD)]
        index = len(levels) - 1 if sync and count < warmup else level_at(count, LEVELS, warmup)
        if index is not None:
            period, size = levels[index]
            active = period in outer and anchors[period][0] is not None
            for start in range(0, WORLD, size):
                group = range(start, start + size)
                mean = sum(params[r] for r in group) / size
                if active:
                    if not synced[period]:
                        anchor_mean = sum(anchors[period][r] for r in group) / size
                        for r in group:
                            anchors[period][r].copy_(anchor_mean)
                    for r in group:
                        a = anchors[period][r]
                        a.grad = a - mean
                        opts[period][r].step()
                        a.grad = None
                        params[r] = a.detach().clone()
                else:
                    for r in group:
                        params[r] = mean.clone()
                for lower, _ in levels[:index]:
                    if lower in outer and anchors[lower][0] is not None:
                        for r in group:
                            anchors[lower][r].copy_(params[r])
            if active:
                synced[period] = True
            for lower, _ in levels[:index]:
                if lower in outer and anchors[lower][0] is not None:
                    synced[lower] = True
        if count == warmup - 1:
            take()
        trajectory.append(
            {
                "params": [p.clone() for p in params],
                "anchors": {p: [None if a is None else a.detach().clone() for a in anchors[p]] for p in outer},
                "level": index,
            }
        )
    return trajectory


def _doc_example() -> list[dict[str, float]]:
    """The worked example of docs/outer.md (2 replicas, one level, outer Nesterov SGD lr 0.7 momentum 0.9)."""
    text = (ROOT / "docs" / "outer.md").read_text()
    number = r" (-?[0-9.]+) \|"
    rows = re.findall(r"^\| (\d) \|" + number * 8 + "$", text, re.M)
    assert len(rows) == 2, "docs/outer.md has no worked example table of two rounds"
    keys = ("round", "replica0", "replica1", "anchor", "mean", "g", "buffer", "update", "new")
    return [dict(zip(keys, map(float, row))) for row in rows]


# -- the scenarios, in the ranks ------------------------------------------------------------------------
def _scenario_sgd_lr1_is_plain_averaging(rank: int) -> dict:
    """(a) Outer SGD(lr=1, momentum=0) at both levels equals plain averaging, fp32 and bf16, and with a
    non-finite replica skipped (``nonfinite="skip_replica"``)."""
    out = {}
    for name, dtype, skip in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False), ("skip", torch.float32, True)):
        results = []
        for outer in (None, {2: _sgd(), "4": _sgd()}):
            params = _model(rank, dtype)
            kwargs = {"nonfinite": "skip_replica"} if skip else {}
            opt = _wrap(params, outer_optimizers=outer, **kwargs)
            trajectory = []
            for count in range(11):
                if skip and rank == 3 and count == 8:  # count 8 averages at the top level: rank 3 is skipped
                    with torch.no_grad():
                        params[0][1] = float("nan")
                _train(params, opt, rank, count, count + 1)
                trajectory.append(_flat(params))
            results.append(torch.stack(trajectory))
        plain, outer_run = results
        assert torch.isfinite(outer_run).all()
        diff = (plain - outer_run).abs().max().item()
        assert torch.allclose(plain, outer_run, rtol=1e-6, atol=1e-6), (name, diff)
        out[name] = diff
    return out


def _scenario_nesterov_two_levels(rank: int) -> dict:
    """(b, c, e) Nesterov at both levels over 3 rounds each; every rank's params after each count, its
    anchors, and whether the ranks of each group hold the same params after each round."""
    import torch.distributed as dist

    from hieravg_optim import nesterov_outer

    params = _model(rank)
    opt = _wrap(params, outer_optimizers={2: nesterov_outer(*NESTEROV), 4: nesterov_outer(*NESTEROV)})
    assert opt.averager.has_anchors
    record: list = []

    def on_step(count):
        flat = _flat(params)
        everyone = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(everyone, flat)
        record.append({"params": flat, "anchors": _anchors(opt), "everyone": everyone})

    _train(params, opt, rank, 0, 12, on_step)
    return {"record": record, "metrics": opt.metrics()}


def _scenario_warmup_anchors(rank: int) -> dict:
    """(d) warmup_steps=3: the anchors are the params right after count 2, with and without a synchronous
    warm-up; then the trajectory, for the reference."""
    from hieravg_optim import nesterov_outer

    out = {}
    for sync in (True, False):
        params = _model(rank)
        opt = _wrap(
            params, warmup_steps=3, synchronous_warmup=sync, outer_optimizers={2: nesterov_outer(*NESTEROV), 4: nesterov_outer(*NESTEROV)}
        )
        record: list = []
        has = []

        def on_step(count, params=params, opt=opt, record=record, has=has):
            has.append(opt.averager.has_anchors)
            record.append({"params": _flat(params), "anchors": _anchors(opt)})

        _train(params, opt, rank, 0, 10, on_step)
        out[sync] = {"record": record, "has_anchors": has}
    return out


def _scenario_resume(rank: int) -> dict:
    """(f) state_dict -> new wrapper -> load_state_dict continues as the uninterrupted run, with outer
    momentum; a checkpoint with anchors of another shape is a ValueError naming it; one without anchors
    warns and takes fresh ones."""
    from hieravg_optim import HierarchicalAveragingOptimizer, nesterov_outer

    outer = {2: nesterov_outer(*NESTEROV), 4: nesterov_outer(0.5, 0.8)}

    def build(warmup: int):
        params = _model(rank)
        inner = torch.optim.SGD(params, lr=1.0, momentum=0.5)
        return params, HierarchicalAveragingOptimizer(inner, LEVELS, warmup_steps=warmup, outer_optimizers=outer)

    out = {}
    for warmup, stop in ((0, 7), (0, 9), (3, 2), (3, 6)):
        params, opt = build(warmup)
        _train(params, opt, rank, 0, 14)
        uninterrupted = _flat(params)
        params, opt = build(warmup)
        _train(params, opt, rank, 0, stop)
        saved = _roundtrip({"params": [p.detach() for p in params], "opt": opt.state_dict()})
        params, opt = build(warmup)
        with torch.no_grad():
            for p, s in zip(params, saved["params"]):
                p.copy_(s)
        opt.load_state_dict(saved["opt"])
        momentum_loaded = {
            period: [t.clone() for t in (s["optimizer"]["state"][i]["momentum_buffer"] for i in s["optimizer"]["state"])]
            for period, s in opt.state_dict()[STATE_KEY].get("outer", {}).items()
        }
        _train(params, opt, rank, stop, 14)
        resumed = _flat(params)
        assert torch.allclose(uninterrupted, resumed, rtol=1e-6, atol=1e-6), (warmup, stop, uninterrupted, resumed)
        out[(warmup, stop)] = {"diff": (uninterrupted - resumed).abs().max().item(), "momentum": momentum_loaded}

    # A wrong shape: ValueError naming the period and the shapes, nothing changed.
    params, opt = build(0)
    _train(params, opt, rank, 0, 3)
    state = opt.state_dict()
    bad = _roundtrip(state)
    bad[STATE_KEY]["outer"][4]["anchors"][1] = torch.zeros(3, 3)
    before = _anchors(opt)
    with pytest.raises(ValueError, match=r"period 4.*anchor 1 has shape \(3, 3\).*\(2, 2\)"):
        opt.load_state_dict(bad)
    assert all(torch.equal(before[p], a) for p, a in _anchors(opt).items()) and opt.averaging_step == 3
    bad = _roundtrip(state)
    del bad[STATE_KEY]["outer"][4]["anchors"][0]
    with pytest.raises(ValueError, match=r"period 4"):
        opt.load_state_dict(bad)
    # No anchors in the checkpoint (a plain run's): a warning, then fresh anchors from the parameters.
    plain = _roundtrip(state)
    del plain[STATE_KEY]["outer"]
    with pytest.warns(UserWarning, match=r"no anchors or outer optimizer state for periods \[2, 4\]"):
        opt.load_state_dict(plain)
    assert not opt.averager.has_anchors and opt.averager.needs_anchors
    at_load = _flat(params)
    _train(params, opt, rank, 3, 4)  # count 3 does not average: the anchors are the params before its step
    anchors = _anchors(opt)
    assert torch.equal(anchors[2], at_load) and torch.equal(anchors[4], at_load)
    return out


def _scenario_cpu_state_and_metrics(rank: int) -> dict:
    """(g) outer_state_device="cpu"; outer_bytes from the shapes, pseudo_grad_norm at each level's last round."""
    from hieravg_optim import nesterov_outer

    # bf16 parameters: fp32 anchors, 4 bytes per element.
    low = _wrap(_model(rank, torch.bfloat16), outer_optimizers={2: nesterov_outer(*NESTEROV)}, outer_state_device="cpu")
    out = {"bf16": low.metrics()}
    params = _model(rank)
    opt = _wrap(params, outer_optimizers={4: nesterov_outer(*NESTEROV)}, outer_state_device="cpu")
    assert opt.averager.outer_state_device == torch.device("cpu")
    out["construction"] = opt.metrics()
    anchor0 = _anchors(opt)[4]
    assert anchor0.dtype == torch.float32 and anchor0.device == torch.device("cpu")
    _train(params, opt, rank, 0, 1)  # count 0: the top level's first round
    out["after_first"] = opt.metrics()
    out["anchor0"] = anchor0
    out["params_after_first"] = _flat(params)
    _train(params, opt, rank, 1, 5)  # counts 2 (period 2) and 4 (period 4)
    out["after_second"] = opt.metrics()
    return out


def _scenario_doc_example(rank: int) -> dict:
    """The worked example of docs/outer.md, run by the wrapper on ranks 0 and 1 (one level of 2 replicas)."""
    import torch.distributed as dist

    from hieravg_optim import HierarchicalAveragingOptimizer, nesterov_outer

    group = dist.new_group([0, 1])  # every rank takes part in creating it
    if rank > 1:
        return {}
    rows = _doc_example()
    p = nn.Parameter(torch.tensor([rows[0]["anchor"]]))
    opt = HierarchicalAveragingOptimizer(
        torch.optim.SGD([p], lr=1.0), {1: 2}, process_group=group, outer_optimizers={1: nesterov_outer(0.7, 0.9)}
    )
    seen = []
    for row in rows:
        p.grad = p.detach() - row[f"replica{rank}"]  # the inner step lands on the table's local value
        opt.step()
        buffer = next(iter(opt.averager.state_dict()["outer"][1]["optimizer"]["state"].values()))["momentum_buffer"]
        seen.append({"new": p.item(), "buffer": buffer.item(), "g_norm": opt.metrics()[1]["pseudo_grad_norm"]})
    return {"seen": seen, "rows": rows}


def _scenario_bad_configs(rank: int) -> dict:
    """(h) bad values raise on every rank, before any collective, naming the value and the fix."""
    from hieravg_optim import HierarchicalAverager, nesterov_outer
    from hieravg_optim.config import AveragingConfig

    def message(fn) -> tuple[str, str]:
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as exc:
            return type(exc).__name__, str(exc)
        return "", ""

    def outer_returning_int(tensors):
        return 1

    config = AveragingConfig.create(LEVELS)
    cases = {
        "unknown period": lambda: _wrap(_model(rank), outer_optimizers={3: nesterov_outer()}),
        "duplicate period": lambda: _wrap(_model(rank), outer_optimizers={4: nesterov_outer(), "4": nesterov_outer()}),
        "not a mapping": lambda: _wrap(_model(rank), outer_optimizers=[nesterov_outer()]),
        "not callable": lambda: _wrap(_model(rank), outer_optimizers={4: "SGD"}),
        "not an optimizer": lambda: _wrap(_model(rank), warmup_steps=5, outer_optimizers={4: outer_returning_int}),
        "device type": lambda: _wrap(_model(rank), outer_optimizers={4: nesterov_outer()}, outer_state_device=1),
        "device name": lambda: _wrap(_model(rank), outer_optimizers={4: nesterov_outer()}, outer_state_device="gpu0"),
        "averager period": lambda: HierarchicalAverager(config, outer_optimizers={"8": nesterov_outer()}),
        # One rank's value only: that rank raises it, the others a RuntimeError naming it, no hang.
        "one rank": lambda: _wrap(_model(rank), outer_optimizers={(3 if rank == 1 else 4): nesterov_outer()}),
        # Every value valid, but the ranks disagree on which levels have an outer optimizer.
        "disagree": lambda: _wrap(_model(rank), outer_optimizers={4: nesterov_outer()} if rank == 0 else None),
        "disagree device": lambda: _wrap(
            _model(rank), outer_optimizers={4: nesterov_outer()}, outer_state_device="cpu" if rank == 2 else None
        ),
    }
    out = {name: message(fn) for name, fn in cases.items()}
    out["nesterov lr"] = message(lambda: nesterov_outer(lr=0.0))
    out["nesterov momentum"] = message(lambda: nesterov_outer(momentum=0.0))

    # The averaged tensors change after the anchors were taken (a parameter frozen): RuntimeError on every rank.
    params = _model(rank)
    opt = _wrap(params, outer_optimizers={4: nesterov_outer()})
    params[1].requires_grad_(False)
    out["frozen later"] = message(lambda: _train(params, opt, rank, 0, 1))
    return out


def _convert(obj, fn):
    """``obj`` with every leaf replaced by ``fn(leaf)``, through dicts, lists and tuples."""
    if isinstance(obj, dict) and "__tensor__" not in obj:
        return {k: _convert(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_convert(v, fn) for v in obj)
    return fn(obj)


def _scenarios(rank: int, world_size: int) -> dict:
    assert world_size == WORLD
    warnings.simplefilter("ignore")  # pytest.warns still sees the warnings it expects
    # Tensors travel to the parent as lists: a tensor on the result queue is passed through shared memory,
    # which the rank's fast exit can tear down before the parent has read it.
    return _convert(_run(rank), _to_list)


def _to_list(x):
    return {"__tensor__": x.tolist(), "dtype": str(x.dtype).removeprefix("torch.")} if torch.is_tensor(x) else x


def _to_tensor(x):
    return torch.tensor(x["__tensor__"], dtype=getattr(torch, x["dtype"])) if isinstance(x, dict) else x


def _run(rank: int) -> dict:
    return run_scenarios(
        {
            "plain": _scenario_sgd_lr1_is_plain_averaging,
            "nesterov": _scenario_nesterov_two_levels,
            "warmup": _scenario_warmup_anchors,
            "resume": _scenario_resume,
            "metrics": _scenario_cpu_state_and_metrics,
            "doc": _scenario_doc_example,
            "bad": _scenario_bad_configs,
        },
        rank,
    )


@pytest.fixture(scope="module")
def results() -> list[dict]:
    out = run_distributed(_scenarios, WORLD, timeout=180)
    return _convert(out, _to_tensor)


# -- the checks -----------------------------------------------------------------------------------------
def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_outer_sgd_lr1_equals_plain_averaging(results):
    for rank, res in enumerate(results):
        assert set(res["plain"]) == {"fp32", "bf16", "skip"}, rank
        assert all(diff <= 1e-6 for diff in res["plain"].values()), (rank, res["plain"])


def test_nesterov_two_levels_matches_torch_sgd_reference(results):
    reference = _reference({2: NESTEROV, 4: NESTEROV}, 12)
    rounds = [step["level"] for step in reference]
    assert rounds.count(0) == 3 and rounds.count(1) == 3  # 3 rounds per level
    for rank, res in enumerate(results):
        for count, (mine, ref) in enumerate(zip(res["nesterov"]["record"], reference)):
            assert _close(mine["params"], ref["params"][rank]), (rank, count, mine["params"], ref["params"][rank])
            for period in (2, 4):
                assert _close(mine["anchors"][period], ref["anchors"][period][rank]), (rank, count, period)
        metrics = res["nesterov"]["metrics"]
        assert metrics[2]["rounds"] == 3 and metrics[4]["rounds"] == 3
    # The outer step is not plain averaging: the params after count 0 are not the mean.
    mean0 = sum(_init(r) + _move(r, 0) for r in range(WORLD)) / WORLD
    assert not _close(results[0]["nesterov"]["record"][0]["params"], mean0)


def test_lower_anchors_reset_after_a_higher_round(results):
    for rank, res in enumerate(results):
        record = res["nesterov"]["record"]
        for count in (0, 4, 8):  # the top level's rounds
            assert torch.equal(record[count]["anchors"][2], record[count]["params"]), (rank, count)
            assert torch.equal(record[count]["anchors"][4], record[count]["params"]), (rank, count)
        for count in (2, 6, 10):  # the lower level's rounds: the top anchor is kept
            assert torch.equal(record[count]["anchors"][2], record[count]["params"]), (rank, count)
            assert torch.equal(record[count]["anchors"][4], record[count - 1]["anchors"][4]), (rank, count)
            assert not torch.equal(record[count]["anchors"][4], record[count]["params"]), (rank, count)


def test_replicas_identical_after_each_outer_round(results):
    for rank, res in enumerate(results):
        for count, step in enumerate(res["nesterov"]["record"]):
            index = level_at(count, LEVELS, 0)
            if index is None:
                continue
            size = list(LEVELS.values())[index]
            group = range(rank - rank % size, rank - rank % size + size)
            for other in group:
                assert torch.equal(step["everyone"][other], step["params"]), (rank, count, other)
            if size < WORLD:  # the two groups of the lower level differ
                outside = (rank + size) % WORLD
                assert not torch.equal(step["everyone"][outside], step["params"])


@pytest.mark.parametrize("sync", [True, False])
def test_warmup_anchors_are_the_params_after_count_warmup_minus_1(results, sync):
    reference = _reference({2: NESTEROV, 4: NESTEROV}, 10, warmup=3, sync=sync)
    for rank, res in enumerate(results):
        run = res["warmup"][sync]
        assert run["has_anchors"] == [False, False] + [True] * 8
        assert run["record"][1]["anchors"] == {}
        after = run["record"][2]
        assert torch.equal(after["anchors"][2], after["params"]) and torch.equal(after["anchors"][4], after["params"])
        for count, (mine, ref) in enumerate(zip(run["record"], reference)):
            assert _close(mine["params"], ref["params"][rank]), (sync, rank, count)
    params_after_warmup = [res["warmup"][sync]["record"][2]["params"] for res in results]
    # A synchronous warm-up leaves the replicas equal; without it they differ, and the first round (count 4,
    # top level) makes them equal again.
    assert all(torch.equal(p, params_after_warmup[0]) for p in params_after_warmup) == sync
    after_round = [res["warmup"][sync]["record"][4]["params"] for res in results]
    assert all(torch.equal(p, after_round[0]) for p in after_round)


def test_resume_continues_identically(results):
    for rank, res in enumerate(results):
        runs = res["resume"]
        assert set(runs) == {(0, 7), (0, 9), (3, 2), (3, 6)}
        assert all(run["diff"] <= 1e-6 for run in runs.values()), (rank, runs)
        # Outer momentum was restored: after 7 counts both levels have stepped (rounds at 0, 2, 4, 6).
        momentum = runs[(0, 7)]["momentum"]
        assert set(momentum) == {2, 4} and all(any(t.abs().sum() > 0 for t in m) for m in momentum.values())
        assert runs[(3, 2)]["momentum"] == {}  # saved during the warm-up: no anchors yet


def test_cpu_outer_state_and_metrics_exact(results):
    elements = 7
    for rank, res in enumerate(results):
        m = res["metrics"]
        assert m["bf16"][2]["outer_bytes"] == elements * 4 and m["bf16"][4]["outer_bytes"] == 0  # fp32 anchors
        assert m["construction"][4]["outer_bytes"] == elements * 4
        assert m["construction"][2]["outer_bytes"] == 0 and m["construction"][4]["pseudo_grad_norm"] is None
        first = m["after_first"][4]
        assert first["outer_bytes"] == 2 * elements * 4  # anchors + the Nesterov momentum buffer
        # Count 0: the anchors (the mean of the initial params, after the first round's anchor average) minus
        # the mean of the moved params; computed here from the ranks' known values.
        anchor = sum(_init(r) for r in range(WORLD)) / WORLD
        mean = sum(_init(r) + _move(r, 0) for r in range(WORLD)) / WORLD
        expected = torch.linalg.vector_norm(anchor - mean).item()
        assert math.isclose(first["pseudo_grad_norm"], expected, rel_tol=1e-6), (first["pseudo_grad_norm"], expected)
        assert m["after_second"][2]["pseudo_grad_norm"] is None and m["after_second"][2]["outer_bytes"] == 0
        assert m["after_second"][4]["rounds"] == 2 and m["after_second"][4]["pseudo_grad_norm"] > 0
        assert m["after_first"][4]["payload_bytes"] == 2 * elements * 4  # the params, and the fp32 anchors once


def test_documented_worked_example_is_what_the_wrapper_does(results):
    for rank in (0, 1):
        doc = results[rank]["doc"]
        for row, seen in zip(doc["rows"], doc["seen"]):
            assert math.isclose(seen["new"], row["new"], abs_tol=1e-6), (rank, row, seen)
            assert math.isclose(seen["buffer"], row["buffer"], abs_tol=1e-6), (rank, row, seen)
            assert math.isclose(seen["g_norm"], abs(row["g"]), abs_tol=1e-6), (rank, row, seen)


def test_documented_worked_example_matches_torch_sgd():
    """The table's own arithmetic, with torch.optim.SGD(nesterov=True) on one anchor."""
    rows = _doc_example()
    anchor = torch.tensor([rows[0]["anchor"]], dtype=torch.float64)
    opt = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
    for row in rows:
        assert math.isclose(anchor.item(), row["anchor"], abs_tol=1e-9)
        mean = (row["replica0"] + row["replica1"]) / 2
        assert math.isclose(mean, row["mean"], abs_tol=1e-9)
        anchor.grad = anchor.detach() - mean
        assert math.isclose(anchor.grad.item(), row["g"], abs_tol=1e-9)
        before = anchor.item()
        opt.step()
        assert math.isclose(opt.state[anchor]["momentum_buffer"].item(), row["buffer"], abs_tol=1e-9)
        assert math.isclose((before - anchor.item()) / 0.7, row["update"], abs_tol=1e-9)
        assert math.isclose(anchor.item(), row["new"], abs_tol=1e-9)


def test_bad_configs_raise_on_every_rank(results):
    expected = {
        "unknown period": ("ValueError", r"outer_optimizers key 3 must be the period of a level \(one of \[2, 4\]\)"),
        "duplicate period": ("ValueError", r"keys 4 and '4' both name period 4"),
        "not a mapping": ("TypeError", r"outer_optimizers must be a mapping \{period: factory\}, got list"),
        "not callable": ("TypeError", r"outer_optimizers\[4\] must be a factory.*got 'SGD'"),
        "not an optimizer": ("TypeError", r"outer_optimizers\[4\] .* returned int, not a torch.optim.Optimizer"),
        "device type": ("TypeError", r"outer_state_device must be None, a device name or a torch.device, got 1"),
        "device name": ("ValueError", r"outer_state_device 'gpu0' is not a device"),
        "averager period": ("ValueError", r"outer_optimizers key '8' must be the period"),
        "nesterov lr": ("ValueError", r"lr must be a positive finite number, got 0.0"),
        "nesterov momentum": ("ValueError", r"momentum must be in \(0, 1\).*got 0.0"),
        "frozen later": ("RuntimeError", r"differ from the level's anchors: 1 tensors to average, but 2 anchors"),
    }
    for rank, res in enumerate(results):
        bad = res["bad"]
        for name, (kind, pattern) in expected.items():
            assert bad[name][0] == kind and re.search(pattern, bad[name][1]), (rank, name, bad[name])
        if rank == 1:
            assert bad["one rank"][0] == "ValueError" and "key 3" in bad["one rank"][1]
        else:
            assert bad["one rank"][0] == "RuntimeError" and "Rank 1 failed" in bad["one rank"][1], bad["one rank"]
        assert bad["disagree"][0] == "RuntimeError" and "periods with an outer optimizer" in bad["disagree"][1]
        assert bad["disagree device"][0] == "RuntimeError" and "outer_state_device" in bad["disagree device"][1]

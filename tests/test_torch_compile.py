"""The wrapper under ``torch.compile``, on 2 real gloo ranks: the averaging runs eagerly (Dynamo graph-breaks
at it) and the result equals the eager run's: count, rounds, weights.

Dynamo's ``"eager"`` backend: it traces as every backend does (the averaging is skipped by Dynamo itself,
before any backend), and on 2 CPU cores inductor's code generation would take minutes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import default_timeout, run_distributed

WORLD = 2
LEVELS = {2: 2}
STEPS = 6
pytestmark = pytest.mark.timeout(default_timeout(240))


def _setup(rank: int):
    from hieravg_optim import HierarchicalAveragingOptimizer

    model = nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank))  # a round gives the exact mean, 0.5
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), LEVELS)
    return model, opt


def _batch(rank: int, count: int) -> torch.Tensor:
    return torch.full((4, 3), float(rank + count))  # different data per rank and step


def _result(model, opt) -> dict:
    return {
        "count": opt.averaging_step,
        "rounds": {period: m["rounds"] for period, m in opt.metrics().items()},
        "weights": [p.detach().tolist() for p in model.parameters()],  # plain lists cross the queue
    }


def _eager(rank: int) -> dict:
    model, opt = _setup(rank)
    for count in range(STEPS):
        opt.zero_grad()
        model(_batch(rank, count)).sum().backward()
        opt.step()
    return _result(model, opt)


def _compiled_step(rank: int) -> dict:
    """``torch.compile(opt.step)``."""
    model, opt = _setup(rank)
    step = torch.compile(opt.step, backend="eager")
    for count in range(STEPS):
        opt.zero_grad()
        model(_batch(rank, count)).sum().backward()
        step()
    return _result(model, opt)


def _compiled_train_step(rank: int) -> dict:
    """A compiled function that calls ``optimizer.step()`` (torchtune's form): forward, backward, step."""
    model, opt = _setup(rank)

    @torch.compile(backend="eager")
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for count in range(STEPS):
        train_step(_batch(rank, count))
    return _result(model, opt)


def _run(rank: int, world_size: int) -> dict:
    assert world_size == WORLD
    torch.manual_seed(0)
    out = {}
    forms = {"eager": _eager, "compiled_step": _compiled_step, "compiled_train_step": _compiled_train_step}
    for name, fn in forms.items():
        torch._dynamo.reset()
        out[name] = fn(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run, WORLD, timeout=180, pg_timeout=60)


def test_eager_reference_averages(results):
    eager = [r["eager"] for r in results]
    assert [r["count"] for r in eager] == [STEPS] * WORLD
    assert all(r["rounds"] == {2: 3} for r in eager)  # counts 0, 2 and 4
    # The last round (count 4) made the replicas equal; one more local step (count 5) made them differ.
    assert eager[0]["weights"] != eager[1]["weights"]


@pytest.mark.parametrize("form", ["compiled_step", "compiled_train_step"])
def test_compiled_equals_eager(results, form):
    for r in results:
        assert r[form]["count"] == r["eager"]["count"]
        assert r[form]["rounds"] == r["eager"]["rounds"]
        assert r[form]["weights"] == r["eager"]["weights"], form  # exact: the same float values

"""Delayed rounds and fragments on real gloo ranks: exact applied values, composition, outer steps, metrics.

Each rank runs a HierarchicalAverager over a few float32 tensors, adding a known increment (affine in the rank
and the count, multiples of 1/4) before every step, and checks its tensors after every step against a
simulation of every rank written here from the documented semantics (docs/semantics.md), not from the
library's code: the fragments' counts ``round(j * period / F)``, the per-tensor winner, the snapshot at ``t``,
``R + (theta - snapshot)`` (eager) or ``R`` (none), the mixing ``(1 - alpha) * A + alpha * theta``, and the
outer SGD step on ``anchor - R``. Values are dyadic, so the comparisons are exact (``torch.equal``), except
with an outer optimizer or a mixing weight, whose values soon need more bits than float32 holds (allclose 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import default_timeout, run_distributed, run_scenarios

pytestmark = pytest.mark.timeout(default_timeout(300))

N_TENSORS = 4
SHAPE = (3,)


def _increment(rank: int, count: int, position: int) -> float:
    return 0.25 * (rank + 1) * (count % 3 + 1) + 0.5 * position


class _Simulation:
    """Every rank's tensors (float64) under the documented semantics."""

    def __init__(self, world, levels, delay, fragments, correction, alpha, outer=None, steps=24):
        self.world, self.levels = world, list(levels.items())
        n = len(self.levels)
        self.delay = [delay.get(p, 0) for p, _ in self.levels]
        self.frags = [fragments.get(p, 1) for p, _ in self.levels]
        self.correction = [correction.get(p, "eager") for p, _ in self.levels]
        self.alpha = [alpha.get(p, 0.0) for p, _ in self.levels]
        self.outer = outer or {}  # {level index: (lr, momentum)}: torch SGD with nesterov=True
        self.theta = [[torch.full(SHAPE, float(p), dtype=torch.float64) for p in range(N_TENSORS)] for _ in range(world)]
        self.anchors = {li: [[t.clone() for t in self.theta[r]] for r in range(world)] for li in self.outer}
        self.synced = {li: False for li in self.outer}
        self.momentum = {li: [[None] * N_TENSORS for _ in range(world)] for li in self.outer}
        self.flight = {}
        self.started = [0] * n
        self.applied = [0] * n
        assert len(self.delay) == n

    def group(self, r, li):
        size = self.levels[li][1]
        return list(range(r // size * size, r // size * size + size))

    def winner(self, count, position):
        for li in range(len(self.levels) - 1, -1, -1):
            period, f = self.levels[li][0], self.frags[li]
            if f == 1:
                if count % period == 0:
                    return li, None
                continue
            offsets = [(2 * j * period + f) // (2 * f) for j in range(f)]
            if count % period in offsets:
                j = offsets.index(count % period)
                if j * N_TENSORS // f <= position < (j + 1) * N_TENSORS // f:
                    return li, j
        return None, None

    def outer_step(self, li, r, p, mean):
        lr, mom = self.outer[li]
        a = self.anchors[li][r][p]
        g = a - mean
        buf = self.momentum[li][r][p]
        buf = g.clone() if buf is None else buf * mom + g
        self.momentum[li][r][p] = buf
        a -= lr * (g + mom * buf)
        return a.clone()

    def apply(self, li, entry):
        positions, snap = entry["positions"], entry["snapshot"]
        for r in range(self.world):
            members = self.group(r, li)
            for p in positions:
                mean = sum(snap[m][p] for m in members) / len(members)
                result = self.outer_step(li, r, p, mean) if li in self.outer else mean
                live = self.theta[r][p]
                value = result + (live - snap[r][p]) if self.correction[li] == "eager" else result.clone()
                a = self.alpha[li]
                self.theta[r][p] = (1 - a) * value + a * live if a else value
        self.applied[li] += 1

    def step(self, count):
        for r in range(self.world):
            for p in range(N_TENSORS):
                self.theta[r][p] = self.theta[r][p] + _increment(r, count, p)
        for li in sorted(self.flight):
            if self.flight[li]["apply_at"] == count:
                self.apply(li, self.flight.pop(li))
        by_level = {}
        for p in range(N_TENSORS):
            li, _ = self.winner(count, p)
            if li is not None:
                by_level.setdefault(li, []).append(p)
        for li, positions in sorted(by_level.items()):
            if li in self.outer and not self.synced[li]:
                for r in range(self.world):
                    members = self.group(r, li)
                    self.anchors[li][r] = [
                        sum(self.anchors[li][m][p] for m in members) / len(members) for p in range(N_TENSORS)
                    ]
                # (computed from the pre-round anchors of every rank: all equal here, as they start equal)
                self.synced[li] = True
            entry = {"positions": positions, "snapshot": [[t.clone() for t in th] for th in self.theta],
                     "apply_at": count + self.delay[li]}  # fmt: skip
            if self.delay[li] or self.frags[li] > 1:
                self.started[li] += 1
            if self.delay[li] == 0:
                self.apply(li, entry)
            else:
                self.flight[li] = entry


def _run(rank, world, levels, *, delay=None, fragments=None, correction=None, alpha=None, outer=None, steps=24):
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    delay, fragments, correction, alpha = delay or {}, fragments or {}, correction or {}, alpha or {}
    factories = {
        p: (lambda ts, lr=lr, m=m: torch.optim.SGD(ts, lr=lr, momentum=m, nesterov=True))
        for p, (lr, m) in (outer or {}).items()
    }
    config = AveragingConfig.create(
        levels, delay_steps=delay, fragments=fragments, delay_correction=correction or "eager", delay_mixing=alpha or 0.0,
        outer_optimizers=factories,
    )  # fmt: skip
    averager = HierarchicalAverager(config)
    periods = list(levels)
    sim = _Simulation(
        world, levels, delay, fragments, correction, alpha,
        outer={periods.index(p): v for p, v in (outer or {}).items()},
    )  # fmt: skip
    tensors = [torch.full(SHAPE, float(p)) for p in range(N_TENSORS)]
    held = []
    for count in range(steps):
        averager.begin_step(lambda: tensors)
        with torch.no_grad():
            for p, t in enumerate(tensors):
                t += _increment(rank, count, p)
        averager.step_and_average(lambda: tensors)
        sim.step(count)
        for p, t in enumerate(tensors):
            expected = sim.theta[rank][p]
            if outer or alpha:  # more bits than float32 holds after a few rounds: rounding, not semantics
                ok = torch.allclose(t.double(), expected, rtol=1e-6, atol=1e-6)
            else:
                ok = torch.equal(t.double(), expected)
            assert ok, f"step {count}, tensor {p}: {t.tolist()} != {expected.tolist()}"
        held.append({p: m["bytes_in_flight"] for p, m in averager.metrics().items()})
    metrics = averager.metrics()
    for li, p in enumerate(periods):
        assert metrics[p]["rounds_started"] == sim.started[li], (p, metrics[p], sim.started)
        assert metrics[p]["rounds_applied"] == sim.applied[li] if (delay.get(p) or fragments.get(p, 1) > 1) else True
    return {"held": held, "started": sim.started, "applied": sim.applied}


def _scenarios(rank, world):
    levels = {2: 2, 8: world}
    return run_scenarios(
        {
            "eager": lambda r: _run(r, world, levels, delay={8: 3}),
            "none_mixed": lambda r: _run(r, world, levels, delay={8: 3}, correction={8: "none"}, alpha={8: 0.5}),
            "both_delayed": lambda r: _run(r, world, levels, delay={2: 1, 8: 5}, alpha={2: 0.25}),
            "fragments_delayed": lambda r: _run(r, world, levels, delay={2: 1, 8: 1}, fragments={8: 4}),
            "fragments_sync": lambda r: _run(r, world, levels, fragments={8: 2}),
            "outer_eager": lambda r: _run(r, world, levels, delay={8: 3}, outer={8: (0.5, 0.5)}),
            "outer_fragments": lambda r: _run(
                r, world, levels, delay={8: 1}, fragments={8: 2}, correction={8: "none"}, outer={8: (0.5, 0.5)}
            ),
        },
        rank,
    )


@pytest.mark.parametrize("world", [2, 4])
def test_applied_values_follow_the_documented_formulas(world):
    out = run_distributed(_scenarios, world, timeout=240)
    eager = out[0]["eager"]
    # Top rounds at 0, 8, 16 applied at 3, 11, 19: 2 copies of 4 x 3 float32 held in between (eager).
    held = [h[8] for h in eager["held"]]
    assert held[0] == held[1] == held[2] == 2 * N_TENSORS * 3 * 4 and held[3] == 0 and held[8] == 2 * 48
    assert eager["started"][1] == 3 and eager["applied"][1] == 3
    none_held = [h[8] for h in out[0]["none_mixed"]["held"]]
    assert none_held[0] == N_TENSORS * 3 * 4  # the "none" correction keeps no snapshot
    frag = out[0]["fragments_delayed"]
    assert frag["started"][1] == 12  # 4 fragment rounds per period of 8, over 24 counts


def _bitwise_default(rank, world):
    from hieravg_optim import HierarchicalAveragingOptimizer

    finals = []
    for settings in ({}, {"delay_steps": {4: 0}, "fragments": 1, "delay_mixing": 0.0, "delay_correction": "eager"}):
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = HierarchicalAveragingOptimizer(inner, {2: 2, 4: world}, **settings)
        assert opt.averager._delayed is None
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(9):
            opt.zero_grad()
            x = torch.randn(8, 5, generator=g)
            model(x).square().mean().backward()
            opt.step()
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))
    return True


def test_defaults_given_explicitly_are_bitwise_the_synchronous_path():
    assert all(run_distributed(_bitwise_default, 4, timeout=120))


def _overlap_is_real(rank, world):
    """While a delayed round is in flight the main thread keeps stepping: the background thread is alive."""
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    averager = HierarchicalAverager(AveragingConfig.create({4: world}, delay_steps=3))
    tensors = [torch.full((1 << 20,), float(rank))]
    averager.step_and_average(lambda: tensors)  # count 0: starts, applied at 3
    round_ = averager._delayed.in_flight[0]
    assert round_.thread is not None and torch.equal(tensors[0], torch.full((1 << 20,), float(rank)))
    for _ in range(3):
        averager.step_and_average(lambda: tensors)
    assert not averager._delayed.in_flight
    assert torch.equal(tensors[0], torch.full((1 << 20,), (world - 1) / 2))
    # The end of training: the round started at count 4 is applied now (count 6) instead of at 7.
    for _ in range(2):
        averager.step_and_average(lambda: tensors)
        with torch.no_grad():
            tensors[0] += rank
    assert list(averager._delayed.in_flight) == [0] and averager.apply_rounds_in_flight(tensors) == 1
    # eager: the mean of the snapshots at count 4 plus this rank's progress since (two increments of rank)
    assert torch.equal(tensors[0], torch.full((1 << 20,), (world - 1) / 2 + 2.0 * rank))
    assert averager.apply_rounds_in_flight(tensors) == 0
    dist.barrier()
    return True


def test_round_runs_in_the_background_and_lands_at_t_plus_tau():
    assert all(run_distributed(_overlap_is_real, 2, timeout=120))

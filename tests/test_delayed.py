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
UNEQUAL = [(3, 5), (2, 3)]
"""Two unequal matrices (15 and 6 elements): 4 fragments split them inside the first one."""


def capture_round_inputs(delayed, read) -> dict:
    """Make ``delayed`` (an averager's DelayedRounds) store ``read()`` under ``"start"`` right before each round
    starts and under ``"apply"`` right before each round is applied; returns the dict. ``read`` may be collective
    (every rank starts and applies its rounds at the same counts)."""
    captured: dict = {}
    original_start, original_apply = delayed.start, delayed.apply

    def start(*args, **kwargs):
        captured["start"] = read()
        return original_start(*args, **kwargs)

    def apply(*args, **kwargs):
        captured["apply"] = read()
        return original_apply(*args, **kwargs)

    delayed.start, delayed.apply = start, apply
    return captured


def _increment(rank: int, count: int, position: int) -> float:
    return 0.25 * (rank + 1) * (count % 3 + 1) + 0.5 * position


class _Simulation:
    """Every rank's tensors (float64, one flat vector of all elements) under the documented semantics."""

    def __init__(self, world, levels, delay, fragments, correction, alpha, outer=None, shapes=None):
        self.world, self.levels = world, list(levels.items())
        n = len(self.levels)
        self.delay = [delay.get(p, 0) for p, _ in self.levels]
        self.frags = [fragments.get(p, 1) for p, _ in self.levels]
        self.correction = [correction.get(p, "eager") for p, _ in self.levels]
        self.alpha = [alpha.get(p, 0.0) for p, _ in self.levels]
        self.outer = outer or {}  # {level index: (lr, momentum)}: torch SGD with nesterov=True, elementwise
        shapes = shapes or [SHAPE] * N_TENSORS
        sizes = [torch.Size(s).numel() for s in shapes]
        self.position = torch.tensor([p for p, n_p in enumerate(sizes) for _ in range(n_p)], dtype=torch.float64)
        self.slices = [slice(sum(sizes[:p]), sum(sizes[: p + 1])) for p in range(len(sizes))]
        self.elements = sum(sizes)
        self.theta = [self.position.clone() for _ in range(world)]
        self.anchors = {li: [t.clone() for t in self.theta] for li in self.outer}
        self.synced = {li: False for li in self.outer}
        self.momentum = {li: [None] * world for li in self.outer}
        self.flight = {}
        self.started = [0] * n
        self.applied = [0] * n

    def group(self, r, li):
        size = self.levels[li][1]
        return list(range(r // size * size, r // size * size + size))

    def due(self, count):
        """Per element, the level whose round covers it at ``count`` (-1: none): fragment ``j`` of a level is the
        elements ``[b_j, b_{j+1})``, ``b_j`` the element boundary nearest to ``j * elements / F`` (float32 tensors,
        ties to the later one); each element follows the largest level due for it."""
        owner = torch.full((self.elements,), -1)
        for li in range(len(self.levels) - 1, -1, -1):
            period, f = self.levels[li][0], self.frags[li]
            if f == 1:
                if count % period == 0:
                    owner[owner < 0] = li
                    break
                continue
            offsets = [(2 * j * period + f) // (2 * f) for j in range(f)]
            if count % period in offsets:
                j = offsets.index(count % period)
                lo, hi = ((2 * k * self.elements + f) // (2 * f) for k in (j, j + 1))
                span = owner[lo:hi]
                span[span < 0] = li
        return owner

    def outer_step(self, li, r, mask, mean):
        lr, mom = self.outer[li]
        a = self.anchors[li][r]
        g = a - mean
        buf = self.momentum[li][r]
        if buf is None:
            buf = torch.zeros_like(a)
            buf[mask] = g[mask]
        else:
            buf[mask] = buf[mask] * mom + g[mask]
        self.momentum[li][r] = buf
        a[mask] -= lr * (g[mask] + mom * buf[mask])
        return a.clone()

    def apply(self, li, entry):
        mask, snap = entry["mask"], entry["snapshot"]
        for r in range(self.world):
            members = self.group(r, li)
            mean = sum(snap[m] for m in members) / len(members)
            result = self.outer_step(li, r, mask, mean) if li in self.outer else mean
            live = self.theta[r]
            value = result + (live - snap[r]) if self.correction[li] == "eager" else result.clone()
            a = self.alpha[li]
            value = (1 - a) * value + a * live if a else value
            self.theta[r] = torch.where(mask, value, live)
        self.applied[li] += 1

    def tensors(self, r):
        return [self.theta[r][s] for s in self.slices]

    def step(self, count):
        for r in range(self.world):
            self.theta[r] = self.theta[r] + _increment(r, count, self.position)
        for li in sorted(self.flight):
            if self.flight[li]["apply_at"] == count:
                self.apply(li, self.flight.pop(li))
        owner = self.due(count)
        for li in sorted(set(owner.tolist()) - {-1}):
            if li in self.outer and not self.synced[li]:
                for r in range(self.world):
                    members = self.group(r, li)
                    self.anchors[li][r] = sum(self.anchors[li][m] for m in members) / len(members)
                # (computed from the pre-round anchors of every rank: all equal here, as they start equal)
                self.synced[li] = True
            entry = {"mask": owner == li, "snapshot": [t.clone() for t in self.theta], "apply_at": count + self.delay[li]}
            if self.delay[li] or self.frags[li] > 1:
                self.started[li] += 1
            if self.delay[li] == 0:
                self.apply(li, entry)
            else:
                self.flight[li] = entry


def _run(rank, world, levels, *, delay=None, fragments=None, correction=None, alpha=None, outer=None, steps=24,
         outer_state_device=None, shapes=None, resume_at=None, average_now=False):
    """``resume_at``: after that count, continue on a new averager loaded from ``state_dict()`` (a round in flight
    included), after checking that one with other fragments refuses it, naming both splits. ``average_now``: at the
    end, the rounds in flight applied and a synchronous round of the top level (every fragment's pieces stepped
    once): the replicas bitwise equal, and equal to the anchors."""
    import copy

    from hieravg_optim import AveragingConfig, HierarchicalAverager

    delay, fragments, correction, alpha = delay or {}, fragments or {}, correction or {}, alpha or {}
    factories = {
        p: (lambda ts, lr=lr, m=m: torch.optim.SGD(ts, lr=lr, momentum=m, nesterov=True))
        for p, (lr, m) in (outer or {}).items()
    }
    config = AveragingConfig.create(
        levels, delay_steps=delay, fragments=fragments, delay_correction=correction or "eager", delay_mixing=alpha or 0.0,
        outer_optimizers=factories, outer_state_device=outer_state_device,
    )  # fmt: skip
    averager = HierarchicalAverager(config)
    periods = list(levels)
    sim = _Simulation(
        world, levels, delay, fragments, correction, alpha,
        outer={periods.index(p): v for p, v in (outer or {}).items()}, shapes=shapes,
    )  # fmt: skip
    tensors = [torch.full(shape, float(p)) for p, shape in enumerate(shapes or [SHAPE] * N_TENSORS)]
    held = []
    for count in range(steps):
        averager.begin_step(lambda: tensors)
        with torch.no_grad():
            for p, t in enumerate(tensors):
                t += _increment(rank, count, p)
        averager.step_and_average(lambda: tensors)
        sim.step(count)
        for p, (t, expected) in enumerate(zip(tensors, sim.tensors(rank))):
            expected = expected.view(t.shape)
            if outer or alpha:  # more bits than float32 holds after a few rounds: rounding, not semantics
                ok = torch.allclose(t.double(), expected, rtol=1e-6, atol=1e-6)
            else:
                ok = torch.equal(t.double(), expected)
            assert ok, f"step {count}, tensor {p}: {t.tolist()} != {expected.tolist()}"
        held.append({p: m["bytes_in_flight"] for p, m in averager.metrics().items()})
        if count == resume_at:
            state = copy.deepcopy(averager.state_dict())
            assert state.get("in_flight") and state["outer"][8]["pieces"] == [[0, 0, 5], [0, 5, 11], [0, 11, 15], [1, 0, 1], [1, 1, 6]]
            other = HierarchicalAverager(
                AveragingConfig.create(levels, delay_steps=delay, fragments={8: 2}, outer_optimizers=factories)
            )
            with pytest.raises(ValueError, match=r"fragments=4: tensor 0 \[0:5\).*here it steps fragments=2: tensor 0 \[0:11\)"):
                other.load_state_dict(state, tensors)
            averager = HierarchicalAverager(config)
            averager.load_state_dict(state, tensors)
    if average_now:
        import torch.distributed as dist

        averager.apply_rounds_in_flight(tensors)
        averager.average(-1, tensors)
        mine = torch.cat([t.reshape(-1) for t in tensors])
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        anchors = torch.cat([a.reshape(-1) for a in averager.state_dict()["outer"][8]["anchors"]])
        assert all(torch.equal(x, mine) for x in everyone) and torch.equal(anchors, mine), "average_now"
    if resume_at is not None:
        return {"resumed": True}
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
            "eager_snapshot_on_cpu": lambda r: _run(r, world, levels, delay={8: 3}, outer_state_device="cpu"),
            "none_mixed": lambda r: _run(r, world, levels, delay={8: 3}, correction={8: "none"}, alpha={8: 0.5}),
            "both_delayed": lambda r: _run(r, world, levels, delay={2: 1, 8: 5}, alpha={2: 0.25}),
            "fragments_delayed": lambda r: _run(r, world, levels, delay={2: 1, 8: 1}, fragments={8: 4}),
            "fragments_sync": lambda r: _run(r, world, levels, fragments={8: 2}),
            "outer_eager": lambda r: _run(r, world, levels, delay={8: 3}, outer={8: (0.5, 0.5)}),
            "outer_fragments": lambda r: _run(
                r, world, levels, delay={8: 1}, fragments={8: 2}, correction={8: "none"}, outer={8: (0.5, 0.5)},
                average_now=True,
            ),
            # Element ranges: 4 fragments of 2 unequal matrices, boundaries inside the first (5, 11, 16 of 21).
            "unequal_fragments": lambda r: _run(r, world, levels, delay={2: 1, 8: 1}, fragments={8: 4}, shapes=UNEQUAL),
            "unequal_outer_nesterov": lambda r: _run(
                r, world, levels, delay={8: 1}, fragments={8: 4}, outer={8: (0.7, 0.9)}, shapes=UNEQUAL, resume_at=12,
                average_now=True,
            ),
        },
        rank,
    )


def _background_groups(rank, world):
    """The process groups of each delayed level's background rounds: ``{2: 2, 8: world}`` (both levels of the
    same 2 ranks when ``world`` is 2), node-aware above 2 ranks (its in-node pairs are the lower level's ranks)."""
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    config = AveragingConfig.create(
        {2: 2, 8: world}, delay_steps={2: 1, 8: 5}, ranks_per_node=2 if world > 2 else None
    )  # fmt: skip
    background = HierarchicalAverager(config)._delayed.background
    groups = {}
    for li, lg in background.items():
        found = [lg.group] + ([lg.node.local, lg.node.cross] if lg.node is not None else [])
        groups[li] = {id(g) for g in found if g is not None}
    return groups


@pytest.mark.parametrize("world", [2, 4])
def test_no_background_group_serves_two_levels(world):
    # Two levels' rounds can be in flight at once (the lower one's inside the higher one's window), one of them
    # in a thread (node-aware, the checked float16 wire): on a shared group their collectives could be issued in
    # another order on each rank.
    out = run_distributed(_background_groups, world, timeout=120)
    for rank, groups in enumerate(out):
        assert sorted(groups) == [0, 1] and all(groups.values()), (rank, groups)
        assert not groups[0] & groups[1], (rank, groups)


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


def test_fragments_split_inside_tensors_within_one_element_of_equal_bytes():
    from hieravg_optim.fragments import split_fragments

    def nbytes(fragment, sizes):
        return sum((b - a) * sizes[i] for i, a, b in fragment)

    split = split_fragments([15, 6], [4, 4], 4)  # two unequal float32 matrices, (3, 5) and (2, 3)
    assert split == [((0, 0, 5),), ((0, 5, 11),), ((0, 11, 15), (1, 0, 1)), ((1, 1, 6),)]
    assert all(abs(nbytes(f, [4, 4]) - 84 / 4) <= 4 for f in split)
    mixed = split_fragments([1000, 37, 4096], [4, 2, 2], 3)  # fp32 then bf16: within the largest element size
    assert sum(nbytes(f, [4, 2, 2]) for f in mixed) == 12266 and all(abs(nbytes(f, [4, 2, 2]) - 12266 / 3) <= 4 for f in mixed)
    # A tensor that is not contiguous is kept whole: the boundary moves to its nearer end.
    assert split_fragments([10, 10], [4, 4], 2, [False, True]) == [((0, 0, 10),), ((1, 0, 10),)]
    assert split_fragments([16], [4], 1) == [((0, 0, 16),)]
    with pytest.raises(ValueError, match=r"fragments=4 at this level, but its rounds average 3 elements"):
        split_fragments([2, 1], [4, 4], 4)


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
    assert round_.works and torch.equal(tensors[0], torch.full((1 << 20,), float(rank)))  # async all-reduces issued
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
    # More fragments than elements: a ValueError on every rank at the first round, before any collective of it.
    split = HierarchicalAverager(AveragingConfig.create({4: world}, fragments=3))
    with pytest.raises(ValueError, match=r"fragments=3 at this level, but its rounds average 2 elements on this rank \(2 tensors\).*fragments=2"):
        split.step_and_average(lambda: [torch.zeros(1), torch.zeros(1)])
    _worked_example(rank)
    _landing_is_checked_on_every_rank(rank)
    dist.barrier()
    return True


def _documented_table() -> dict[str, list[tuple[float, float]]]:
    """The worked example's table of docs/semantics.md: per setting, (rank 0, rank 1) after each count."""
    import re

    from tests.launch import ROOT

    text = (ROOT / "docs" / "semantics.md").read_text().split("<!-- worked-example:delayed -->", 1)[1]
    rows = re.findall(r"^\| (\d+) \|[^|]*\|(.*)\|$", text.split("\n\n", 1)[0], re.M)
    assert [int(c) for c, _ in rows] == list(range(7)), rows
    columns = list(zip(*[[tuple(map(float, c.split("/"))) for c in cells.split("|")] for _, cells in rows]))
    return dict(zip(["eager", "none", "none_mixing"], map(list, columns)))


def _worked_example(rank):
    """docs/semantics.md's worked example, as the library runs it: {4: 2}, delay_steps=2, rank r adds r + 1."""
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    settings = {"eager": {}, "none": {"delay_correction": "none"}, "none_mixing": {"delay_correction": "none", "delay_mixing": 0.5}}
    for key, expected in _documented_table().items():
        averager = HierarchicalAverager(AveragingConfig.create({4: 2}, delay_steps=2, **settings[key]))
        tensors = [torch.zeros(1)]
        for count in range(7):
            tensors[0] += rank + 1
            averager.step_and_average(lambda: tensors)
            assert tensors[0].item() == expected[count][rank], (key, count, tensors[0].item(), expected[count])


def _landing_is_checked_on_every_rank(rank):
    """A round lands on the tensors it started from, else every rank raises and none applies it: a tensor list
    that changed in flight (a parameter frozen: its neighbour moves to its position, same shape), on every rank or
    on one; a tensor reshaped in flight on one rank; a step callback failing at a count where a round is only
    applied."""
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    for fragments, who in ((2, (0, 1)), (1, (1,))):
        averager = HierarchicalAverager(AveragingConfig.create({4: 2}, delay_steps=1, fragments=fragments))
        a, b, c = (torch.full((3,), 10.0 * (k + 1) + rank) for k in range(3))
        averager.step_and_average(lambda: [a, b, c])  # count 0: fragment 0 (a, then b[0:2]) or the whole round starts
        frozen = [b, c] if rank in who else [a, b, c]
        before = [t.clone() for t in (a, b, c)]
        mine = r"applied at step 1 to other tensors than it started with: tensor 0 of 2" if fragments == 2 else r"to 2 tensors, but it started with tensor positions up to 2"
        with pytest.raises(RuntimeError, match=mine if rank in who else r"Rank 1 failed while checking the tensors .* is applied to at step 1"):
            averager.step_and_average(lambda: frozen)
        assert all(torch.equal(x, y) for x, y in zip(before, (a, b, c)))  # applied nowhere
    # A tensor reshaped in flight on rank 1 (the same storage and elements): every rank raises, none applies it.
    averager = HierarchicalAverager(AveragingConfig.create({4: 2}, delay_steps=1))
    m = torch.full((2, 3), 1.0 + rank)
    averager.step_and_average(lambda: [m])
    reshaped = m.view(3, 2) if rank == 1 else m
    with pytest.raises(RuntimeError, match=r"tensor 0 has shape \(3, 2\) at step 1, but \(2, 3\)" if rank == 1
                       else r"Rank 1 failed while checking the tensors .* is applied to at step 1"):  # fmt: skip
        averager.step_and_average(lambda: [reshaped])
    assert torch.equal(m, torch.full((2, 3), 1.0 + rank))  # applied nowhere
    averager = HierarchicalAverager(AveragingConfig.create({4: 2}, delay_steps=1))
    averager.step_and_average(lambda: [a])

    def failing():
        if rank == 0:
            raise OSError("the callback of rank 0")
        return [a]

    with pytest.raises(OSError if rank == 0 else RuntimeError, match=r"the callback of rank 0"):
        averager.step_and_average(failing)  # count 1: the round is only applied; rank 1 raises too, no hang


def test_round_runs_in_the_background_and_lands_at_t_plus_tau():
    assert all(run_distributed(_overlap_is_real, 2, timeout=120))

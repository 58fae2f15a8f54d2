"""Compressed levels with ``delay_steps`` and ``fragments`` at the same level, on 4 real gloo ranks, 2 levels.

Each rank runs a HierarchicalAverager over 4 float32 tensors, adding a known increment before every step, and
checks its tensors after every step against a simulation of every rank written here from the documented formula
(docs/compression.md, "With delay_steps and fragments at the same level"): at ``t`` each rank encodes
``anchor - theta_t`` (its fragment's tensors) plus ``ef_decay`` times its residual, with the codecs of ``hieravg_optim.compression`` (checked alone in
``test_compression_codecs.py``), and keeps ``v - decode(payload)``; at ``t + tau`` the payloads are decoded in rank
order, their mean steps the anchors (``anchor - mean``, or ``torch.optim.SGD`` Nesterov), and the result ``R`` goes
through the eager correction ``R + (theta - theta_t)`` (or none) and the mixing ``(1 - alpha) * A + alpha * theta``.
The simulation does the same float32 operations in the same order, so the comparison is bitwise (``torch.equal``).
One spawn runs every scenario.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from tests.harness import default_timeout, run_distributed, run_scenarios

pytestmark = pytest.mark.timeout(default_timeout(300))

WORLD = 4
LEVELS = {2: 2, 4: WORLD}
N_TENSORS, SHAPE = 4, (40,)  # equal sizes: 2 fragments are positions {0, 1} and {2, 3}


def _start() -> list[torch.Tensor]:
    """The same start on every rank, in multiples of 1/16: the first average of the anchors is exact."""
    g = torch.Generator().manual_seed(5)
    return [torch.round(torch.randn(SHAPE, generator=g) * 16) / 16 for _ in range(N_TENSORS)]


def _increment(rank: int, count: int, position: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * count + position)
    return torch.randn(SHAPE, generator=g) * 0.05


def _decoded(codec, payload, numel) -> torch.Tensor:
    out = torch.zeros(codec.padded_numel(numel))
    codec.decode_add_(payload, out)
    return out[:numel]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class _Simulation:
    """Every rank's float32 tensors: a plain lower level (period 2, pairs) and the compressed top level."""

    def __init__(self, codec, decay, tau, fragments, correction, alpha, nesterov):
        self.codec, self.decay, self.tau, self.frags = codec, decay, tau, fragments
        self.correction, self.alpha = correction, alpha
        self.theta = [_start() for _ in range(WORLD)]
        self.anchors = [t.clone() for t in _start()]  # equal on every rank of the top group
        self.outer = torch.optim.SGD(self.anchors, lr=nesterov[0], momentum=nesterov[1], nesterov=True) if nesterov else None
        self.residuals = [[None] * N_TENSORS for _ in range(WORLD)]
        self.flight = None

    def top_positions(self, count):
        if self.frags == 1:
            return list(range(N_TENSORS)) if count % 4 == 0 else []
        offsets = [(2 * j * 4 + self.frags) // (2 * self.frags) for j in range(self.frags)]
        if count % 4 not in offsets:
            return []
        j, size = offsets.index(count % 4), N_TENSORS // self.frags
        return list(range(j * size, (j + 1) * size))

    def start(self, count, positions):
        payloads = []
        for r in range(WORLD):
            delta = _flat([self.anchors[p] for p in positions]) - _flat([self.theta[r][p] for p in positions])
            own = [self.residuals[r][p] for p in positions]
            v = delta if own[0] is None or self.decay == 0 else delta.add(_flat(own), alpha=self.decay)
            payload = self.codec.encode(v)
            e = v - _decoded(self.codec, payload, v.numel())
            offset = 0
            for p in positions:
                self.residuals[r][p] = e[offset : offset + SHAPE[0]].clone()
                offset += SHAPE[0]
            payloads.append(payload)
        snap = [[self.theta[r][p].clone() for p in positions] for r in range(WORLD)]
        self.flight = {"positions": positions, "payloads": payloads, "snapshot": snap, "apply_at": count + self.tau}

    def apply(self):
        entry, self.flight = self.flight, None
        positions = entry["positions"]
        n = len(positions) * SHAPE[0]
        total = torch.zeros(self.codec.padded_numel(n))
        for payload in entry["payloads"]:
            self.codec.decode_add_(payload, total)
        mean = total[:n] / WORLD
        pieces = [mean[k * SHAPE[0] : (k + 1) * SHAPE[0]] for k in range(len(positions))]
        if self.outer is None:
            for p, g in zip(positions, pieces):
                self.anchors[p] = self.anchors[p] - g
        else:
            for p, g in zip(positions, pieces):
                self.anchors[p].grad = g.clone()
            self.outer.step()
            for a in self.anchors:
                a.grad = None
        for r in range(WORLD):
            for k, p in enumerate(positions):
                live, R = self.theta[r][p], self.anchors[p].clone()
                value = R + (live - entry["snapshot"][r][k]) if self.correction == "eager" else R
                self.theta[r][p] = (1.0 - self.alpha) * value + self.alpha * live if self.alpha else value

    def step(self, count):
        for r in range(WORLD):
            for p in range(N_TENSORS):
                self.theta[r][p] = self.theta[r][p] + _increment(r, count, p)
        if self.flight is not None and self.flight["apply_at"] == count:
            self.apply()
        top = self.top_positions(count)
        if count % 2 == 0:  # the lower level takes the positions the top level does not
            for p in range(N_TENSORS):
                if p not in top:
                    for a in range(0, WORLD, 2):
                        mean = self.theta[a][p] / 2 + self.theta[a + 1][p] / 2
                        self.theta[a][p], self.theta[a + 1][p] = mean.clone(), mean.clone()
        if top:
            self.start(count, top)
            if self.tau == 0:
                self.apply()


def _averager(codec, decay, tau, fragments, correction, alpha, nesterov, **extra):
    from hieravg_optim import AveragingConfig, HierarchicalAverager, nesterov_outer

    config = AveragingConfig.create(
        LEVELS, compress={4: codec}, ef_decay={4: decay}, delay_steps={4: tau}, fragments={4: fragments},
        delay_correction=correction, delay_mixing={4: alpha},
        outer_optimizers={4: nesterov_outer(*nesterov)} if nesterov else None, **extra,
    )  # fmt: skip
    return HierarchicalAverager(config)


def _step(averager, tensors, rank, count):
    averager.begin_step(lambda: tensors)
    with torch.no_grad():
        for p, t in enumerate(tensors):
            t += _increment(rank, count, p)
    averager.step_and_average(lambda: tensors)


def _run(rank, codec, decay=1.0, tau=1, fragments=1, correction="eager", alpha=0.0, nesterov=None, steps=13):
    """The averager against the simulation after every step, bitwise; with ``"none"`` and no mixing the top
    group's replicas are bitwise equal right after each apply."""
    settings = (codec, decay, tau, fragments, correction, alpha, nesterov)
    averager = _averager(*settings)
    sim = _Simulation(*settings)
    tensors = _start()
    averager.take_anchors(tensors)
    equal_after_apply = []
    for count in range(steps):
        _step(averager, tensors, rank, count)
        applied = sim.flight["positions"] if sim.flight is not None and sim.flight["apply_at"] == count else []
        sim.step(count)
        if tau == 0:
            applied = sim.top_positions(count)
        for p, t in enumerate(tensors):
            expected = sim.theta[rank][p]
            assert torch.equal(t, expected), (count, p, float((t - expected).abs().max()))
        if applied and correction == "none" and not alpha:
            mine = _flat([tensors[p] for p in applied])
            everyone = [torch.empty_like(mine) for _ in range(WORLD)]
            dist.all_gather(everyone, mine)
            equal_after_apply.append(all(torch.equal(x, mine) for x in everyone))
    residuals = averager.state_dict()["outer"][4].get("residuals")
    if decay:
        assert all(torch.equal(a, b) for a, b in zip(residuals, sim.residuals[rank])), "residuals differ"
    m = averager.metrics()[4]
    assert m["rounds_started"] == m["rounds_applied"] + (1 if averager._delayed.in_flight else 0) > 0
    assert 0 < m["compressed_bytes"] and m["compression_ratio"] < 1.0, m
    return {"equal_after_apply": equal_after_apply, "ratio": m["compression_ratio"]}


def _resume(rank, codec):
    """A checkpoint with the compressed round in flight (started at 4, applied at 6, saved after count 5)
    resumes bitwise equal to the uninterrupted run, through torch.save / torch.load(weights_only=True)."""
    settings = (codec, 0.9, 2, 1, "eager", 0.25, (0.7, 0.9))
    averager = _averager(*settings)
    tensors = _start()
    averager.take_anchors(tensors)
    for count in range(6):
        _step(averager, tensors, rank, count)
    state = averager.state_dict()
    entry = state["in_flight"][4]
    assert entry["started"] == 4 and entry["apply_at"] == 6 and entry["compressed"]["gathered"].shape[0] == WORLD
    buffer = io.BytesIO()
    torch.save({"averaging": state, "tensors": tensors}, buffer)
    for count in range(6, 11):
        _step(averager, tensors, rank, count)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _averager(*settings)
    again = [t.clone() for t in saved["tensors"]]
    resumed.load_state_dict(saved["averaging"], again)
    assert list(resumed._delayed.in_flight) == [1] and resumed._delayed.in_flight[1].compressed is not None
    for count in range(6, 11):
        _step(resumed, again, rank, count)
    worst = max(float((a - b).abs().max()) for a, b in zip(tensors, again))
    assert all(torch.equal(a, b) for a, b in zip(tensors, again)), worst  # the same payloads, decoded in order
    # An uncompressed run refuses the compressed round in flight instead of misreading it.
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    plain = HierarchicalAverager(
        AveragingConfig.create(LEVELS, delay_steps={4: 2}, delay_mixing={4: 0.25}, outer_optimizers=None)
    )
    refused = pytest.raises(ValueError, match=r"saved by a compressed level.*resume with the saved run's compress")
    with pytest.warns(UserWarning, match="no outer optimizer: they are not loaded"), refused:
        plain.load_state_dict(saved["averaging"], [t.clone() for t in saved["tensors"]])
    # Another meaning of the same payloads is refused too, naming the saved and the present value (load is local).
    from hieravg_optim.compression import TopK

    other_values = TopK(density=codec.density, chunk=codec.chunk, values="bfloat16")
    for changed, named in [
        ((other_values, *settings[1:]), "compress={'type': 'topk'.*'values': 'int8'}.*'values': 'bfloat16'}"),
        ((codec, 0.5, *settings[2:]), "ef_decay=0.9.*ef_decay=0.5"),
        ((*settings[:4], "none", *settings[5:]), "delay_correction='eager'.*delay_correction='none'"),
        ((*settings[:5], 0.5, settings[6]), "delay_mixing=0.25.*delay_mixing=0.5"),
    ]:
        with pytest.raises(ValueError, match=named + ": resume with the saved run's .*, or save at a count with no"):
            _averager(*changed).load_state_dict(saved["averaging"], [t.clone() for t in saved["tensors"]])
    moved = {**saved["averaging"], "in_flight": {4: {**entry, "meaning": {**entry["meaning"], "group_ranks": [0, 1]}}}}
    with pytest.raises(ValueError, match=r"group_ranks=\[0, 1\], but this averager has group_ranks=\[0, 1, 2, 3\]"):
        _averager(*settings).load_state_dict(moved, [t.clone() for t in saved["tensors"]])
    old = {**saved["averaging"], "in_flight": {4: {k: v for k, v in entry.items() if k != "meaning"}}}
    _averager(*settings).load_state_dict(old, [t.clone() for t in saved["tensors"]])  # saved before: not checked
    return worst


def _nonfinite(rank, codec):
    """A NaN on rank 1 at the start of a compressed delayed round: a RuntimeError on every rank, before anything is
    compressed (no residual, no round in flight); ``skip_replica`` leaves its payload out and gives it ``R``."""
    averager = _averager(codec, 1.0, 1, 1, "none", 0.0, None)
    tensors = _start()
    averager.take_anchors(tensors)
    for count in range(4):
        _step(averager, tensors, rank, count)
    if rank == 1:
        tensors[2][3] = float("nan")
    before = [e.clone() for e in averager._outers.by_level[1].residuals]
    named = r"Non-finite values .* rank \[1\] .*before the averaging round at step 4 \(period 4, group size 4, delayed 1"
    with pytest.raises(RuntimeError, match=named):
        averager.step_and_average(lambda: tensors)
    after = averager._outers.by_level[1].residuals
    assert not averager._delayed.in_flight and all(torch.equal(a, b) for a, b in zip(before, after))
    skipping = _averager(codec, 1.0, 1, 1, "none", 0.0, None, nonfinite="skip_replica")
    tensors = _start()
    skipping.take_anchors(tensors)
    for count in range(6):  # the round of count 4 skips rank 1, applied at 5
        if count == 4 and rank == 1:
            tensors[2][3] = float("nan")
        _step(skipping, tensors, rank, count)
    mine = _flat(tensors)
    everyone = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(everyone, mine)
    assert bool(torch.isfinite(mine).all()) and all(torch.equal(x, mine) for x in everyone)
    # Finite tensors whose delta overflows float32 (anchors 2**126, rank 1 at -3e38; 3 anchors still sum finite):
    # the same, delayed or not.
    for tau in (1, 0):
        for policy in ("raise", "skip_replica"):
            averager = _averager(codec, 1.0, tau, 1, "none", 0.0, None, nonfinite=policy)
            tensors = [torch.full(SHAPE, 2.0**126) for _ in range(N_TENSORS)]
            averager.take_anchors(tensors)
            if rank == 1:
                tensors[1].fill_(-3e38)
            if policy == "raise":
                with pytest.raises(RuntimeError, match=r"Non-finite values .* rank \[1\] .*delta encoded"):
                    averager.step_and_average(lambda: tensors)
                assert averager._outers.by_level[1].residuals is None
                assert tau == 0 or not averager._delayed.in_flight
                continue
            for _ in range(tau + 1):
                averager.step_and_average(lambda: tensors)
            assert all(torch.equal(t, torch.full(SHAPE, 2.0**126)) for t in tensors), (tau, rank, tensors[1][:2])
    return True


def _scenarios(rank, world):
    from hieravg_optim.compression import Int8Block, TopK

    int8, topk = Int8Block(16), TopK(density=0.25, chunk=16, values="int8")
    return run_scenarios(
        {
            "delay_eager": lambda r: _run(r, int8, tau=2),
            "delay_none": lambda r: _run(r, topk, decay=0.5, tau=3, correction="none"),
            "fragments_delayed_nesterov": lambda r: _run(
                r, topk, decay=0.9, tau=1, fragments=2, alpha=0.25, nesterov=(0.7, 0.9)
            ),
            "fragments_sync": lambda r: _run(r, int8, tau=0, fragments=2, correction="none"),
            "resume": lambda r: _resume(r, topk),
            "nonfinite": lambda r: _nonfinite(r, int8),
        },
        rank,
    )


def test_compressed_delayed_and_fragment_rounds_follow_the_formula():
    out = run_distributed(_scenarios, WORLD, timeout=240)
    for rank, r in enumerate(out):
        assert r["delay_none"]["equal_after_apply"] == [True] * 3, (rank, r["delay_none"])
        assert r["fragments_sync"]["equal_after_apply"] == [True] * 7, (rank, r["fragments_sync"])
        assert r["resume"] == 0.0 and r["nonfinite"]

"""Compressed levels with ``delay_steps`` and ``fragments`` at the same level, on 4 real gloo ranks, 2 levels.

Each rank runs a HierarchicalAverager over 4 float32 tensors, adding a known increment before every step, and
checks its tensors after every step against a simulation of every rank written here from the documented formula
(docs/compression.md, "With delay_steps and fragments at the same level"): at ``t`` each rank encodes
``anchor - theta_t`` (its fragment's tensors) plus ``ef_decay`` times its residual, with the codecs of ``hieravg_optim.compression`` (checked alone in
``test_compression_codecs.py``), and keeps ``v - decode(payload)``; at ``t + tau`` the payloads are decoded in rank
order, their mean steps the anchors (``anchor - mean``, or ``torch.optim.SGD`` Nesterov), and the result ``R`` goes
through the eager correction ``R + (theta - theta_t)`` (or none) and the mixing ``(1 - alpha) * A + alpha * theta``.
The simulation does the same float32 operations in the same order, so the comparison is bitwise (``torch.equal``).

Node-aware (``ranks_per_node=2``: the top group of 4 spans 2 nodes of 2 ranks, the pairs of period 2 lie inside
one node): at ``t`` the deltas of each node's 2 ranks are summed, zero-padded to 2 equal shards, and rank ``i`` of
the node encodes its shard ``i`` divided by the 4 replicas, plus ``ef_decay`` times its residual of that shard (one
per fragment); at ``t + tau`` shard ``i`` is the payloads of the ranks ``i`` of both nodes decoded in node order,
and the mean is the shards one after the other. A sum of 2 float32 values is one rounding of the exact sum,
whichever comes first, so the node's reduce-scatter gives the simulation's ``a + b`` bit for bit: the comparison
is bitwise there too.
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
    """Every rank's float32 tensors: a plain lower level (period 2, pairs) and the compressed top level (node-aware
    with ``node``: 2 nodes of 2 ranks)."""

    def __init__(self, codec, decay, tau, fragments, correction, alpha, nesterov, node=False):
        self.codec, self.decay, self.tau, self.frags, self.node = codec, decay, tau, fragments, node
        self.correction, self.alpha = correction, alpha
        self.theta = [_start() for _ in range(WORLD)]
        self.anchors = [t.clone() for t in _start()]  # equal on every rank of the top group
        self.outer = torch.optim.SGD(self.anchors, lr=nesterov[0], momentum=nesterov[1], nesterov=True) if nesterov else None
        self.residuals = [[None] * N_TENSORS for _ in range(WORLD)]
        self.shards = [[None] * fragments for _ in range(WORLD)]  # node-aware: a residual shard per fragment
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
        if self.node:
            return self.start_node(count, positions)
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

    def start_node(self, count, positions):
        """Node-aware: per node, the sum of its 2 ranks' deltas; rank ``i`` of the node encodes shard ``i`` / 4."""
        j = 0 if self.frags == 1 else positions[0] * self.frags // N_TENSORS  # the fragment
        n = len(positions) * SHAPE[0]
        half = -(-n // 2)
        deltas = [_flat([self.anchors[p] for p in positions]) - _flat([self.theta[r][p] for p in positions])
                  for r in range(WORLD)]  # fmt: skip
        payloads = [None] * WORLD
        for node in range(2):
            total = torch.zeros(2 * half)
            total[:n] = deltas[2 * node] + deltas[2 * node + 1]  # one rounding, in either order
            for i in range(2):
                r = 2 * node + i
                shard = total[i * half : (i + 1) * half] / WORLD
                own = self.shards[r][j]
                v = shard if own is None or self.decay == 0 else shard.add(own, alpha=self.decay)
                payloads[r] = self.codec.encode(v)
                self.shards[r][j] = v - _decoded(self.codec, payloads[r], v.numel())
        snap = [[self.theta[r][p].clone() for p in positions] for r in range(WORLD)]
        apply_at = None if count is None else count + self.tau
        self.flight = {"positions": positions, "payloads": payloads, "snapshot": snap, "apply_at": apply_at}

    def node_mean(self, payloads, n):
        """Shard ``i``: the payloads of the ranks ``i`` of nodes 0 and 1 decoded in that order (divided already)."""
        half = -(-n // 2)
        shards = []
        for i in range(2):
            total = torch.zeros(self.codec.padded_numel(half))
            for node in range(2):
                self.codec.decode_add_(payloads[2 * node + i], total)
            shards.append(total[:half])
        return torch.cat(shards)[:n]

    def outer_step(self, positions, pieces):
        if self.outer is None:
            for p, g in zip(positions, pieces):
                self.anchors[p] = self.anchors[p] - g
        else:
            for p, g in zip(positions, pieces):
                self.anchors[p].grad = g.clone()
            self.outer.step()
            for a in self.anchors:
                a.grad = None

    def sync_round(self):
        """``average(1)`` at the node-aware level with fragments: each fragment's node-aware exchange (its own
        residual shards), then one outer step, and every rank takes the anchors (no correction, no mixing)."""
        size = N_TENSORS // self.frags
        for j in range(self.frags):
            positions = list(range(j * size, (j + 1) * size))
            self.start_node(None, positions)
            entry, self.flight = self.flight, None
            mean = self.node_mean(entry["payloads"], size * SHAPE[0])
            self.outer_step(positions, [mean[k * SHAPE[0] : (k + 1) * SHAPE[0]] for k in range(size)])
        for r in range(WORLD):
            self.theta[r] = [a.clone() for a in self.anchors]

    def apply(self):
        entry, self.flight = self.flight, None
        positions = entry["positions"]
        n = len(positions) * SHAPE[0]
        if self.node:
            mean = self.node_mean(entry["payloads"], n)
        else:
            total = torch.zeros(self.codec.padded_numel(n))
            for payload in entry["payloads"]:
                self.codec.decode_add_(payload, total)
            mean = total[:n] / WORLD
        pieces = [mean[k * SHAPE[0] : (k + 1) * SHAPE[0]] for k in range(len(positions))]
        self.outer_step(positions, pieces)
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


def _averager(codec, decay, tau, fragments, correction, alpha, nesterov, node=False, **extra):
    from hieravg_optim import AveragingConfig, HierarchicalAverager, nesterov_outer

    config = AveragingConfig.create(
        LEVELS, compress={4: codec}, ef_decay={4: decay}, delay_steps={4: tau}, fragments={4: fragments},
        delay_correction=correction, delay_mixing={4: alpha},
        outer_optimizers={4: nesterov_outer(*nesterov)} if nesterov else None,
        ranks_per_node=2 if node else None, **extra,
    )  # fmt: skip
    averager = HierarchicalAverager(config)
    assert (averager.level_groups[1].node is not None) == node and averager.level_groups[0].node is None
    return averager


def _step(averager, tensors, rank, count):
    averager.begin_step(lambda: tensors)
    with torch.no_grad():
        for p, t in enumerate(tensors):
            t += _increment(rank, count, p)
    averager.step_and_average(lambda: tensors)


def _run(
    rank, codec, decay=1.0, tau=1, fragments=1, correction="eager", alpha=0.0, nesterov=None, node=False, steps=13
):
    """The averager against the simulation after every step, bitwise; with ``"none"`` and no mixing the top
    group's replicas are bitwise equal right after each apply."""
    settings = (codec, decay, tau, fragments, correction, alpha, nesterov, node)
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
        expected = sim.shards[rank] if node else sim.residuals[rank]
        assert len(residuals) == len(expected), [tuple(r.shape) for r in residuals]
        assert all(torch.equal(a, b) for a, b in zip(residuals, expected)), "residuals differ"
    m = averager.metrics()[4]
    assert m["rounds_started"] == m["rounds_applied"] + (1 if averager._delayed.in_flight else 0) > 0
    assert 0 < m["compressed_bytes"] and m["compression_ratio"] < 1.0, m
    if node:  # per applied round: one payload of this rank's shard to the other node, fp32 inside the node
        n = N_TENSORS * SHAPE[0] // fragments
        applied = m["rounds_applied"]
        assert m["compressed_bytes"] == applied * codec.payload_nbytes(-(-n // 2)), m
        assert m["uncompressed_bytes"] == m["rounds_started"] * (2 * 4 * n // 4), m  # 2 (q - 1) 4 n / (q m)
        assert m["bytes_sent"] == applied * (codec.payload_nbytes(-(-n // 2)) + 4 * n), m  # + 2 (m - 1) 4 n / m
    if node and fragments > 1:
        # The round in flight applied now, then a synchronous round of the level (average_now's): one exchange per
        # fragment, each with its own residual shard, as the fragments' own rounds keep them.
        if sim.flight is not None:
            sim.apply()
        averager.apply_rounds_in_flight(tensors)
        averager.average(1, tensors)
        sim.sync_round()
        assert all(torch.equal(t, e) for t, e in zip(tensors, sim.theta[rank])), "average_now differs"
        residuals = averager.state_dict()["outer"][4].get("residuals")
        assert [tuple(r.shape) for r in residuals] == [(N_TENSORS * SHAPE[0] // fragments // 2,)] * fragments
        if decay:
            assert all(torch.equal(a, b) for a, b in zip(residuals, sim.shards[rank])), "residuals differ"
    return {"equal_after_apply": equal_after_apply, "ratio": m["compression_ratio"]}


def _resume(rank, codec, node=False):
    """A checkpoint with the compressed round in flight (started at 4, applied at 6, saved after count 5)
    resumes bitwise equal to the uninterrupted run, through torch.save / torch.load(weights_only=True). Node-aware,
    the saved payloads are those of this rank's shard, one per node, and a run that is not node-aware refuses them."""
    settings = (codec, 0.9, 2, 1, "eager", 0.25, (0.7, 0.9), node)
    averager = _averager(*settings)
    tensors = _start()
    averager.take_anchors(tensors)
    for count in range(6):
        _step(averager, tensors, rank, count)
    state = averager.state_dict()
    entry = state["in_flight"][4]
    assert entry["started"] == 4 and entry["apply_at"] == 6
    assert entry["compressed"]["gathered"].shape[0] == (2 if node else WORLD)
    assert entry["compressed"].get("shard") == (N_TENSORS * SHAPE[0] // 2 if node else None), entry["compressed"]
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
    if node:  # the shard payloads of a node-aware round mean nothing to a flat level (load is local)
        refused = r"saved by a node-aware level .* but this level is not node-aware .*the saved run's ranks_per_node"
        with pytest.raises(ValueError, match=refused):
            _averager(*settings[:-1], False).load_state_dict(saved["averaging"], [t.clone() for t in saved["tensors"]])
        return worst
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
        ((*settings[:5], 0.5, *settings[6:]), "delay_mixing=0.25.*delay_mixing=0.5"),
    ]:
        with pytest.raises(ValueError, match=named + ": resume with the saved run's .*, or save at a count with no"):
            _averager(*changed).load_state_dict(saved["averaging"], [t.clone() for t in saved["tensors"]])
    moved = {**saved["averaging"], "in_flight": {4: {**entry, "meaning": {**entry["meaning"], "group_ranks": [0, 1]}}}}
    with pytest.raises(ValueError, match=r"group_ranks=\[0, 1\], but this averager has group_ranks=\[0, 1, 2, 3\]"):
        _averager(*settings).load_state_dict(moved, [t.clone() for t in saved["tensors"]])
    old = {**saved["averaging"], "in_flight": {4: {k: v for k, v in entry.items() if k != "meaning"}}}
    _averager(*settings).load_state_dict(old, [t.clone() for t in saved["tensors"]])  # saved before: not checked
    return worst


def _nonfinite(rank, codec, node=False):
    """A NaN on rank 1 at the start of a compressed delayed round: a RuntimeError on every rank, before anything is
    compressed (no residual, no round in flight); ``skip_replica`` leaves its payload out (node-aware: adds zeros
    to its node's sum) and gives it ``R``."""
    averager = _averager(codec, 1.0, 1, 1, "none", 0.0, None, node)
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
    skipping = _averager(codec, 1.0, 1, 1, "none", 0.0, None, node, nonfinite="skip_replica")
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
            averager = _averager(codec, 1.0, tau, 1, "none", 0.0, None, node, nonfinite=policy)
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
            # Node-aware (ranks_per_node=2): the same formulas with the node's full-precision sum
            "node_delay_eager": lambda r: _run(r, int8, tau=2, node=True),
            "node_delay_none": lambda r: _run(r, topk, decay=0.5, tau=3, correction="none", node=True),
            "node_fragments_delayed_nesterov": lambda r: _run(
                r, topk, decay=0.9, tau=1, fragments=2, alpha=0.25, nesterov=(0.7, 0.9), node=True
            ),
            "node_fragments_sync": lambda r: _run(r, int8, tau=0, fragments=2, correction="none", node=True),
            "node_resume": lambda r: _resume(r, topk, node=True),
            "node_nonfinite": lambda r: _nonfinite(r, int8, node=True),
        },
        rank,
    )


def test_compressed_delayed_and_fragment_rounds_follow_the_formula():
    out = run_distributed(_scenarios, WORLD, timeout=300)
    for rank, r in enumerate(out):
        for prefix in ("", "node_"):
            if prefix + "resume" not in r:  # left out by HIERAVG_CORE_SCENARIOS
                continue
            assert r[prefix + "delay_none"]["equal_after_apply"] == [True] * 3, (rank, prefix, r[prefix + "delay_none"])
            assert r[prefix + "fragments_sync"]["equal_after_apply"] == [True] * 7, (rank, prefix)
            assert r[prefix + "resume"] == 0.0 and r[prefix + "nonfinite"]

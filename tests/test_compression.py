"""Compressed rounds on 8 real gloo ranks with 2 levels, against references replayed here in one process.

Every rank's tensors are set from its rank, so each rank knows every other rank's pseudo-gradient; the
reference replays the documented round (``v = decay * e + delta``, encode, decode every rank's payload in rank
order, divide, one outer step) with the codecs of ``hieravg_optim.compression`` (checked alone in
``test_compression_codecs.py``) and ``torch.optim.SGD``, and the ranks' results must equal it bit for bit: the
library fixes the order of every sum of a compressed round. One spawn runs every scenario.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.harness import default_timeout, run_distributed, run_scenarios

WORLD = 8
LEVELS = {2: 4, 4: 8}
SHAPES = [(3,), (37, 11), (5,)]
pytestmark = pytest.mark.timeout(default_timeout(400))


def _theta(rank: int, salt: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _gather(flat: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _decode(codec, payload, numel):
    out = torch.zeros(codec.padded_numel(numel))
    codec.decode_add_(payload, out)
    return out[:numel]


def _averager(**settings):
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    return HierarchicalAverager(AveragingConfig.create(LEVELS, **settings))


# -- scenarios -------------------------------------------------------------------------------------------------
def _lossless_exact_means(rank: int) -> None:
    """A lossless codec (top-k of density 1 in float32) and parameter = rank: exact subgroup means, both levels."""
    lossless = {"type": "topk", "density": 1.0, "chunk": 16, "values": "float32"}
    averager = _averager(compress=lossless)
    tensors = [torch.zeros(s) for s in SHAPES]
    averager.take_anchors(tensors)
    for t in tensors:
        t.fill_(float(rank))
    averager.average(0, tensors)
    block = rank // 4 * 4
    for t in tensors:
        assert torch.equal(t, torch.full_like(t, block + 1.5)), (rank, t)
    for t in tensors:
        t.add_(float(rank))  # ranks 0..3 now hold 1.5 + rank, ranks 4..7 5.5 + rank
    averager.average(1, tensors)
    for t in tensors:
        assert torch.equal(t, torch.full_like(t, 3.5 + 3.5)), (rank, t)  # mean of the block means + mean rank
    m = averager.metrics()
    assert m[2]["rounds"] == 1 and m[4]["rounds"] == 1


def _reference_round(codec, deltas, residuals, decay):
    """The mean decoded delta of ``deltas`` (one flat per rank, rank order) and the new residuals."""
    total = torch.zeros(codec.padded_numel(deltas[0].numel()))
    new = []
    for d, e in zip(deltas, residuals):
        v = d if e is None else d.add(e, alpha=decay)
        payload = codec.encode(v)
        codec.decode_add_(payload, total)
        new.append(v - _decode(codec, payload, v.numel()))
    return total[: deltas[0].numel()] / len(deltas), new


def _bitwise_replicas(rank: int) -> dict:
    """int8 and top-k with error feedback (decay 1, 0.9 and 0.5), plain and under outer Nesterov, 3 top-level rounds:
    bitwise equal replicas, bitwise equal to the reference."""
    from hieravg_optim import nesterov_outer
    from hieravg_optim.compression import Int8Block, TopK

    results = {}
    cases = {
        "int8": (Int8Block(64), 1.0, None),
        "topk": (TopK(density=0.05, chunk=128, values="int8"), 1.0, None),
        "topk-bf16-decay": (TopK(density=0.1, chunk=64, values="bfloat16"), 0.5, None),
        "int8-nesterov": (Int8Block(256), 0.9, (0.7, 0.9)),
        # The residual in pseudo-gradient units, added before the outer momentum (MuLoCo's order, no outer lr in
        # it), the anchors reset to the round's result: top-k's residual is large, so any other order shows.
        "topk-nesterov": (TopK(density=0.05, chunk=128, values="int8"), 1.0, (0.7, 0.9)),
    }
    for name, (codec, decay, nesterov) in cases.items():
        outer = {4: nesterov_outer(*nesterov)} if nesterov else None
        averager = _averager(compress={4: codec}, ef_decay={4: decay}, outer_optimizers=outer)
        # The same start on every rank, in multiples of 1/16: the first round's average of the anchors is exact.
        start = [torch.round(t * 16) / 16 for t in _theta(0, salt=7)]
        tensors = [t.clone() for t in start]
        averager.take_anchors(tensors)
        anchor = _flat(start)
        ref_outer = None
        if nesterov:
            ref_anchors = [t.clone() for t in start]  # one tensor per anchor, as the library steps them
            ref_outer = torch.optim.SGD(ref_anchors, lr=nesterov[0], momentum=nesterov[1], nesterov=True)
        residuals = [None] * WORLD
        for r in range(3):
            for t, m in zip(tensors, _theta(rank, salt=r)):
                t.add_(m * 0.01)
            mine = _flat(tensors)
            everyone = _gather(mine)
            averager.average(1, tensors)
            after = _flat(tensors)
            assert all(torch.equal(a, after) for a in _gather(after)), f"{name}: replicas differ after round {r}"
            mean, residuals = _reference_round(codec, [anchor - x for x in everyone], residuals, decay)
            if nesterov:
                offset = 0
                for a in ref_anchors:
                    a.grad = mean[offset : offset + a.numel()].view(a.shape).clone()
                    offset += a.numel()
                ref_outer.step()
                anchor = _flat(ref_anchors)
            else:
                anchor = anchor - mean
            assert torch.equal(after, anchor), (f"{name}: round {r} differs from the reference", float((after - anchor).abs().max()), int((after != anchor).sum()))
        state = averager.state_dict()["outer"][4]
        torch.testing.assert_close(_flat(state["residuals"]), residuals[rank], rtol=0, atol=0)
        m = averager.metrics()[4]
        payload = codec.payload_nbytes(anchor.numel())
        assert m["compressed_bytes"] == 3 * (WORLD - 1) * payload
        assert m["uncompressed_bytes"] == 3 * (2 * (WORLD - 1) * 4 * anchor.numel() // WORLD)
        assert m["compression_ratio"] == m["compressed_bytes"] / m["uncompressed_bytes"]
        assert abs(m["residual_norm"] - float(residuals[rank].norm())) < 1e-4
        results[name] = m["compression_ratio"]
    return results


def _error_feedback_bounded(rank: int) -> dict:
    """K rounds of the same delta: the applied updates sum to K * mean delta minus the mean final residual (up to
    fp32 rounding), and the residual stays bounded (no growth with K); without error feedback they fall short."""
    from hieravg_optim.compression import TopK

    codec = TopK(density=0.1, chunk=64, values="int8")
    out = {}
    for decay in (1.0, 0.0):
        averager = _averager(compress={4: codec}, ef_decay={4: decay})
        tensors = [torch.zeros(s) for s in SHAPES]
        averager.take_anchors(tensors)
        delta = _flat(_theta(rank, salt=3))
        everyone = _gather(delta)
        mean_delta = torch.stack(everyone).mean(0)
        norms = []
        K = 16
        for k in range(K):
            start = _flat(tensors)
            offset = 0
            for t in tensors:  # theta = anchor - delta: the same pseudo-gradient each round
                t.sub_(delta[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
            averager.average(1, tensors)
            if decay:
                norms.append(averager.metrics()[4]["residual_norm"])
        applied = -_flat(tensors)  # anchors started at 0: the sum of the applied mean updates
        if decay:
            residual = _flat(averager.state_dict()["outer"][4]["residuals"])
            mean_residual = torch.stack(_gather(residual)).mean(0)
            torch.testing.assert_close(applied, K * mean_delta - mean_residual, rtol=0, atol=1e-4)
            # Bounded: the residual never exceeds a few rounds' worth of the delta, and stops growing (every rank's
            # figures, so that every rank passes or fails together).
            mine = torch.tensor([max(norms) / float(delta.norm()), norms[-1] / max(norms[: K // 2])])
            growth = torch.stack(_gather(mine))
            assert bool((growth[:, 0] <= 6).all()) and bool((growth[:, 1] <= 1.5).all()), growth
        out[decay] = float((applied - K * mean_delta).norm() / (K * mean_delta).norm())
        del start
    assert out[1.0] < 0.5 * out[0.0], out  # what error feedback has not sent yet is the residual, bounded
    return out


def _none_is_today(rank: int) -> None:
    """compress=None (and {period: None}) runs today's path: no anchors, the same bits as no setting."""
    base = None
    for settings in ({}, {"compress": None}, {"compress": {4: None, "2": "none"}}, {"ef_decay": 0.5}):
        averager = _averager(**settings)
        assert not averager.has_outer and averager.config.compress == ()
        tensors = _theta(rank, salt=11)
        averager.average(0, tensors)
        averager.average(1, tensors)
        got = _flat(tensors)
        if base is None:
            base = got
            expected = torch.stack([_flat(_theta(r, salt=11)) for r in range(WORLD)])
            # The exact subgroup means, as today's path computes them (two-level sum, divided by the group size).
            assert all(torch.equal(got, x) for x in _gather(got))
            torch.testing.assert_close(got, expected.mean(0), rtol=0, atol=1e-6)
        assert torch.equal(got, base), settings
        assert averager.metrics()[4]["compressed_bytes"] == 0


def _skip_replica(rank: int) -> None:
    """A NaN on rank 5 under skip_replica: the others' payloads only, rank 5 gets the result; under raise,
    every rank raises before anything is compressed."""
    from hieravg_optim.compression import Int8Block

    codec = Int8Block(32)
    for policy in ("skip_replica", "raise"):
        averager = _averager(compress={4: codec}, nonfinite=policy)
        tensors = [torch.zeros(s) for s in SHAPES]
        averager.take_anchors(tensors)
        theta = _theta(rank, salt=5)
        for t, x in zip(tensors, theta):
            t.copy_(x)
        if rank == 5:
            tensors[1][0, 0] = float("nan")
        if policy == "raise":
            with pytest.raises(RuntimeError, match="Non-finite values"):
                averager.average(1, tensors)
            continue
        replaced = averager.average(1, tensors)
        assert replaced == (rank == 5)
        after = _flat(tensors)
        assert all(torch.equal(a, after) for a in _gather(after))
        finite = [-_flat(_theta(r, salt=5)) for r in range(WORLD) if r != 5]
        mean, _ = _reference_round(codec, finite, [None] * len(finite), 1.0)
        assert torch.equal(after, -mean)
        state = averager.state_dict()["outer"][4]
        assert ("residuals" in state) == (rank != 5)


def _node_aware(rank: int) -> None:
    """ranks_per_node=4: the node sums at full precision, only each rank's shard crosses nodes, compressed;
    bitwise equal replicas, bitwise equal to the reference; residuals are node shards."""
    from hieravg_optim.compression import Int8Block

    codec = Int8Block(16)
    averager = _averager(compress={4: codec}, ranks_per_node=4)
    assert averager.level_groups[1].node is not None
    tensors = [torch.zeros(s) for s in SHAPES]
    averager.take_anchors(tensors)
    for t in tensors:  # integers: the node sums are exact in any order
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) % 7 * (rank + 1))
    everyone = _gather(_flat(tensors))
    averager.average(1, tensors)
    after = _flat(tensors)
    assert all(torch.equal(a, after) for a in _gather(after))
    numel = after.numel()
    padded = -(-numel // 4) * 4
    shard = padded // 4
    mean = torch.zeros(padded)
    for j in range(4):
        total = torch.zeros(codec.padded_numel(shard))
        for node in range(2):
            s = torch.zeros(padded)
            s[:numel] = -sum(everyone[node * 4 + i] for i in range(4))
            codec.decode_add_(codec.encode(s[j * shard : (j + 1) * shard] / 8), total)
        mean[j * shard : (j + 1) * shard] = total[:shard]
    assert torch.equal(after, -mean[:numel])
    residuals = averager.state_dict()["outer"][4]["residuals"]
    assert [tuple(r.shape) for r in residuals] == [(shard,)]
    m = averager.metrics()[4]
    assert m["compressed_bytes"] == codec.payload_nbytes(shard)  # one payload to the other node
    assert m["uncompressed_bytes"] == 2 * 4 * numel // 8


def _resume_equals_uninterrupted(rank: int) -> None:
    """The wrapper with a compressed top level (top-k, Nesterov): a state dict saved at count 6 (residuals
    included) and loaded into a new wrapper continues bit for bit as the uninterrupted run."""
    from hieravg_optim import HierarchicalAveragingOptimizer, nesterov_outer

    def make():
        params = [torch.nn.Parameter(t) for t in _theta(0, salt=9)]
        opt = HierarchicalAveragingOptimizer(
            torch.optim.SGD(params, lr=0.1), LEVELS, compress={4: {"type": "topk", "density": 0.1, "chunk": 64}},
            ef_decay=0.9, outer_optimizers={4: nesterov_outer()},
        )  # fmt: skip
        return params, opt

    def train(params, opt, start, stop):
        for count in range(start, stop):
            for p, g in zip(params, _theta(rank, salt=100 + count)):
                p.grad = g
            opt.step()

    params, opt = make()
    train(params, opt, 0, 6)
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "params": [p.detach() for p in params]}, buf)
    train(params, opt, 6, 13)
    uninterrupted = _flat(params)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert "residuals" in saved["optimizer"]["hierarchical_averaging"]["outer"][4]
    params2, opt2 = make()
    opt2.load_state_dict(saved["optimizer"])
    with torch.no_grad():
        for p, q in zip(params2, saved["params"]):
            p.copy_(q)
    train(params2, opt2, 6, 13)
    assert torch.equal(_flat(params2), uninterrupted)


def _scenarios(rank: int, world_size: int) -> dict:
    return run_scenarios(
        {
            "lossless_exact_means": _lossless_exact_means,
            "bitwise_replicas": _bitwise_replicas,
            "error_feedback_bounded": _error_feedback_bounded,
            "none_is_today": _none_is_today,
            "skip_replica": _skip_replica,
            "node_aware": _node_aware,
            "resume_equals_uninterrupted": _resume_equals_uninterrupted,
        },
        rank,
    )


def test_compressed_rounds_8_ranks():
    results = run_distributed(_scenarios, WORLD, timeout=360)
    ratios = results[0].get("bitwise_replicas")  # absent when HIERAVG_CORE_SCENARIOS leaves it out
    if ratios is None:
        return
    # The all-gather of 8 payloads: 8 / 2 times the payload ratio against an fp32 ring all-reduce (int8 in blocks
    # of 64 over 417 elements padded to 448: 1.16x; checked exactly in the scenario).
    assert ratios["topk"] < ratios["int8"] < 1.2, ratios

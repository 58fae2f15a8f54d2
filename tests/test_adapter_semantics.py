"""Post-local SGD's promises in the FSDP adapter and the core wrapper, on 4 gloo ranks (2 replicas x 2 shards).

One spawn runs every scenario:

* initial weights: replicas seeded differently (the same seed within a replica) hold replica 0's
  shards right after ``FSDPHierarchicalAveragingOptimizer`` is built (FSDP1 and FSDP2);
* synchronous warm-up (the FSDP default): with different data on every rank, every rank's full
  parameters are identical after each warm-up step, and the replicas drift apart after it;
* frozen parameters (FSDP1 with the frozen Linear in its own unit, FSDP2, the core wrapper):
  after a round, the frozen local tensors are bit-identical to their rank-dependent values, the
  trainable ones are exactly the subgroup mean, and the averaged bytes exclude the frozen ones;
  ``average_frozen=True`` averages them too; ranks that disagree on which parameters are frozen
  raise a ``RuntimeError`` on every rank instead of averaging different tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_distributed, run_scenarios
from tests.test_fsdp import SHARDS, _batch, _flat, _full_params, _gather, _shard, _tiny

pytestmark = pytest.mark.timeout(300)

WORLD = 4


def _replica(rank: int) -> int:
    return rank // SHARDS


def _initial_weights_and_warmup(rank: int) -> dict:
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    reference = _flat([p.detach().reshape(-1) for p in _tiny(0).parameters()])  # replica 0's seed
    out = {}
    for config in ("fsdp1", "fsdp2"):
        model = _shard(config, mesh, seed=_replica(rank))
        differed = not torch.equal(_flat(_full_params(model)), reference)
        opt = FSDPHierarchicalAveragingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, mesh, {4: WORLD}, warmup_steps=3
        )
        start = _flat(_full_params(model))
        identical_after_step = []
        for step in range(4):  # counts 0..2: warm-up; count 3: local
            x, y = _batch(rank, step)  # different data on every rank
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            everyone = _gather(_flat(_full_params(model)))
            identical_after_step.append(all(torch.equal(t, everyone[0]) for t in everyone))
        out[config] = dict(
            differed_before=differed,
            start_is_replica_0=torch.equal(start, reference),
            identical_after_step=identical_after_step,
            rounds=opt.metrics()[4]["rounds"],
        )
    return out


def _fill_local(tensors: list[torch.Tensor], value: float) -> None:
    with torch.no_grad():
        for t in tensors:
            t.fill_(value)


def _frozen_fsdp(rank: int) -> dict:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh
    from hieravg_optim.fsdp import shard_replica

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    out = {}
    for config in ("fsdp1", "fsdp2"):
        for average_frozen in (False, True):
            model = _tiny(0)
            model[0].requires_grad_(False)  # Linear(4, 3): 15 frozen elements
            if config == "fsdp1":  # a flat parameter holds one requires_grad: the frozen Linear in its own unit
                model = shard_replica(
                    model, mesh, fsdp_version=1, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=False
                )
            else:
                model = shard_replica(model, mesh, fsdp_version=2, submodules=[model[0], model[2]])
            opt = FSDPHierarchicalAveragingOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.0), model, mesh, {4: WORLD}, average_frozen=average_frozen
            )
            frozen, trainable = _local_shards_by_requires_grad(model)
            _fill_local(frozen, float(rank))
            _fill_local(trainable, float(rank))
            opt.step()  # count 0: the top level averages (lr 0, no gradients: the inner step changes nothing)
            shard_mean = float(rank % SHARDS + 1)  # (s + (s + SHARDS)) / 2
            frozen_value = shard_mean if average_frozen else float(rank)
            out[f"{config}_average_frozen={average_frozen}"] = dict(
                frozen_exact=all(torch.equal(t, torch.full_like(t, frozen_value)) for t in frozen),
                trainable_mean=all(torch.equal(t, torch.full_like(t, shard_mean)) for t in trainable),
                payload_bytes=opt.metrics()[4]["payload_bytes"],
                expected_bytes=4 * sum(t.numel() for t in (trainable + frozen if average_frozen else trainable)),
                frozen_numel=sum(t.numel() for t in frozen),
            )
    return out


def _local_shards_by_requires_grad(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's local shards (FSDP1 flat parameters, FSDP2 DTensor local shards), frozen and trainable."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from hieravg_optim.averager import local_tensor

    units = [m for m in FSDP.fsdp_modules(model) if getattr(m, "_handle", None) is not None]
    params = [u._handle.flat_param for u in units] if units else list(model.parameters())
    frozen = [local_tensor(p) for p in params if not p.requires_grad]
    trainable = [local_tensor(p) for p in params if p.requires_grad]
    return frozen, trainable


def _frozen_core(rank: int) -> dict:
    from hieravg_optim import HierarchicalAveragingOptimizer

    out = {}
    for average_frozen in (False, True):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        model[0].requires_grad_(False)
        opt = HierarchicalAveragingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), {2: WORLD}, average_frozen=average_frozen
        )
        _fill_local(list(model.parameters()), float(rank))
        opt.step()  # count 0: all 4 ranks average
        mean = sum(range(WORLD)) / WORLD
        frozen_value = mean if average_frozen else float(rank)
        out[f"average_frozen={average_frozen}"] = dict(
            frozen_exact=all(torch.equal(p, torch.full_like(p, frozen_value)) for p in model[0].parameters()),
            trainable_mean=all(torch.equal(p, torch.full_like(p, mean)) for p in model[1].parameters()),
            payload_bytes=opt.metrics()[2]["payload_bytes"],
        )
    # Opting in to the synchronous warm-up in the core wrapper: identical after a warm-up step.
    model = nn.Linear(4, 1)
    opt = HierarchicalAveragingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), {8: WORLD}, warmup_steps=2, synchronous_warmup=True
    )
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    weights = _gather(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    out["synchronous_warmup_identical"] = all(torch.equal(w, weights[0]) for w in weights)
    # Ranks disagreeing on which parameter is frozen, with equal shapes: the skipped tensors' signatures
    # match, so only the agreement on requires_grad tells them apart.
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[rank % 2].requires_grad_(False)
    opt = HierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), {2: WORLD})
    try:
        opt.step()
        out["disagreement"] = None
    except RuntimeError as exc:
        out["disagreement"] = str(exc)
    return out


def _all(rank: int, world_size: int) -> dict:
    torch.manual_seed(1234 + rank)
    return run_scenarios(
        {"init_warmup": _initial_weights_and_warmup, "frozen_fsdp": _frozen_fsdp, "frozen_core": _frozen_core}, rank
    )


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all, WORLD, timeout=240)


@pytest.mark.parametrize("config", ["fsdp1", "fsdp2"])
def test_fsdp_replicas_start_from_replica_0_and_warm_up_synchronously(results, config):
    for rank, per_rank in enumerate(results):
        r = per_rank["init_warmup"][config]
        if rank >= SHARDS:
            assert r["differed_before"], f"rank {rank}: replica 1 was seeded like replica 0; the test is vacuous"
        assert r["start_is_replica_0"], f"rank {rank} {config}: shards after construction differ from replica 0's"
        # Counts 0-2 average all replicas; count 3 is a local step on different data.
        assert r["identical_after_step"] == [True, True, True, False], (rank, config, r)
        assert r["rounds"] == 3, r


@pytest.mark.parametrize("config", ["fsdp1", "fsdp2"])
def test_fsdp_frozen_parameters_are_skipped_unless_asked(results, config):
    for rank, per_rank in enumerate(results):
        for average_frozen in (False, True):
            r = per_rank["frozen_fsdp"][f"{config}_average_frozen={average_frozen}"]
            where = (rank, config, average_frozen, r)
            assert r["frozen_exact"], where
            assert r["trainable_mean"], where
            assert r["payload_bytes"] == r["expected_bytes"], where
    # The two shards of a replica together hold the frozen Linear's 15 elements (FSDP1: plus padding).
    held = sum(per_rank["frozen_fsdp"][f"{config}_average_frozen=False"]["frozen_numel"] for per_rank in results[:SHARDS])
    assert held >= 15, held


def test_core_frozen_parameters_are_skipped_unless_asked(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["frozen_core"]
        assert r["average_frozen=False"] == dict(frozen_exact=True, trainable_mean=True, payload_bytes=4 * (3 * 2 + 2))
        assert r["average_frozen=True"] == dict(
            frozen_exact=True, trainable_mean=True, payload_bytes=4 * (3 * 2 + 2 + 4 * 3 + 3)
        )
        assert r["synchronous_warmup_identical"], rank


def test_ranks_disagreeing_on_frozen_parameters_raise(results):
    for rank, per_rank in enumerate(results):
        message = per_rank["frozen_core"]["disagreement"]
        assert message is not None, f"rank {rank}: averaged although the ranks froze different parameters"
        assert "requires_grad=False" in message and "disagree" in message, message

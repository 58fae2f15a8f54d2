"""FSDP adapter: real FSDP1 / FSDP2 replicas on a 2 x 2 (replicate x shard) gloo mesh.

Every spawn runs several configurations: FSDP1 with use_orig_params False and True
(one unit, and one unit per Linear with bf16 mixed precision) and FSDP2 (fp32, and
per-Linear units with bf16 mixed precision). The tiny model has parameters of 12, 3, 3
and 1 elements, so over 2 shards some local shards are uneven and some empty.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_distributed

pytestmark = pytest.mark.timeout(600)

WORLD = 4
SHARDS = 2
CONFIGS = [
    "fsdp1",
    "fsdp1_orig",
    "fsdp1_orig_wrap_bf16",
    "fsdp1_shard_grad_op",
    "fsdp2",
    "fsdp2_wrap_bf16",
    "fsdp2_keep",
]
LEVELS = {3: 4}  # every 3 steps, both replicas (4 ranks) average; group size 2 would be one replica alone


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def _shard(config: str, mesh, seed: int = 0) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from hieravg_optim.fsdp import shard_replica

    model = _tiny(seed)
    if config == "fsdp1":
        return shard_replica(model, mesh, fsdp_version=1, use_orig_params=False)
    if config == "fsdp1_orig":
        return shard_replica(model, mesh, fsdp_version=1, use_orig_params=True)
    if config == "fsdp1_orig_wrap_bf16":
        return shard_replica(
            model,
            mesh,
            fsdp_version=1,
            use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        )
    if config == "fsdp1_shard_grad_op":
        return shard_replica(model, mesh, fsdp_version=1, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    if config == "fsdp2":
        return shard_replica(model, mesh, fsdp_version=2)
    if config == "fsdp2_keep":  # unsharded parameters kept between forward and backward
        return shard_replica(model, mesh, fsdp_version=2, reshard_after_forward=False)
    if config == "fsdp2_wrap_bf16":
        linears = [m for m in model if isinstance(m, nn.Linear)]
        return shard_replica(
            model, mesh, fsdp_version=2, submodules=linears, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        )
    raise AssertionError(config)


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    """The replica's full fp32 parameters, on every rank of the replica (collective over its shard group)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    if FSDP.fsdp_modules(model):
        with FSDP.summon_full_params(model, writeback=False):
            return [p.detach().clone().reshape(-1) for p in model.parameters()]
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().reshape(-1) for p in model.parameters()]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.float() for t in tensors])


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _train_step(model: nn.Module, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# -- averaging exactness, persistence after forward, local parity ------------------------------------------------
def _averaging_scenarios(rank: int, world_size: int) -> dict:
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    report = {}
    for config in CONFIGS:
        model = _shard(config, mesh)
        opt = FSDPHierarchicalAveragingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05), model, mesh, LEVELS, warmup_steps=3,
            synchronous_warmup=False,
        )
        # The same replica trained by plain FSDP + AdamW (no averaging), over the same shard group and data.
        plain = _shard(config, mesh)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
        assert opt.fsdp_version == (1 if config.startswith("fsdp1") else 2)

        # Counts 0..2: local steps only (warm-up without synchronous_warmup).
        for step in range(3):
            _train_step(model, opt, rank, step)
            _train_step(plain, plain_opt, rank, step)
        mine = _flat(_full_params(model))
        parity = torch.equal(mine, _flat(_full_params(plain)))
        everyone = _gather(mine)
        replicas_differ = not torch.equal(everyone[0], everyone[SHARDS])
        same_replica_equal = torch.equal(everyone[rank], everyone[(rank // SHARDS) * SHARDS])

        # Count 3: the inner step, then averaging. Capture the replica's full params in between.
        captured: dict[str, torch.Tensor] = {}

        def hook(optimizer, args, kwargs):
            captured["before"] = _flat(_full_params(model))

        handle = opt.optimizer.register_step_post_hook(hook)
        _train_step(model, opt, rank, 3)
        handle.remove()
        before = _gather(captured["before"])
        mean = (before[0] + before[SHARDS]) / 2
        after = _flat(_full_params(model))
        after_all = _gather(after)
        exact_mean = torch.equal(after, mean)
        all_equal = all(torch.equal(t, after_all[0]) for t in after_all)

        # A further forward and backward (no step), then the full params again.
        x, y = _batch(rank, 99)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.zero_grad()
        with torch.no_grad():
            model(x)
        still = _flat(_full_params(model))
        still_mean = torch.equal(still, mean)
        report[config] = dict(
            parity=parity,
            replicas_differ=replicas_differ,
            same_replica_equal=same_replica_equal,
            exact_mean=exact_mean,
            all_equal=all_equal,
            still_mean=still_mean,
            rounds=opt.metrics()[3]["rounds"],
            averaging_step=opt.averaging_step,
            local_numels=[t.numel() for t in opt.tensors_to_average()],
        )
    return report


def test_fsdp_averages_local_shards_exactly_and_persistently():
    results = run_distributed(_averaging_scenarios, WORLD, timeout=300)
    for rank, report in enumerate(results):
        for config, r in report.items():
            where = f"rank {rank}, {config}"
            assert r["parity"], f"{where}: local training differs from a plain FSDP replica"
            assert r["replicas_differ"], f"{where}: replicas equal before averaging (gradients crossed replicas?)"
            assert r["same_replica_equal"], f"{where}: ranks of one replica disagree on the full parameters"
            assert r["exact_mean"], f"{where}: averaged full params are not the mean of the replicas"
            assert r["all_equal"], f"{where}: ranks differ after averaging"
            assert r["still_mean"], f"{where}: the average was lost after a forward/backward"
            assert r["rounds"] == 1 and r["averaging_step"] == 4, f"{where}: {r}"
    # Uneven and empty shards: the local tensors differ across shard indexes and match within one.
    for config in CONFIGS:
        numels = [results[rank][config]["local_numels"] for rank in range(WORLD)]
        assert numels[0] == numels[2] and numels[1] == numels[3], (config, numels)
    assert results[0]["fsdp2"]["local_numels"] == [8, 2, 3, 1]  # 3x4 weight: 2 rows; bias 2; 1x3 weight: 1 row
    assert results[1]["fsdp2"]["local_numels"] == [4, 1, 0, 0]  # empty shards on the second shard index


# -- torch's averager as the contrast, and misuse errors ---------------------------------------------------------
def _contrast_and_misuse(rank: int, world_size: int) -> dict:
    from torch.distributed.algorithms.model_averaging.utils import average_parameters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, fully_shard

    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh, shard_replica

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    out: dict = {}

    # torch's average_parameters over the same-shard group: it rebinds flat_param.data, and FSDP's
    # next reshard points the flat parameter back at its _local_shard: the average is lost.
    model = _shard("fsdp1", mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, inner, rank, 0)
    own = _flat(_full_params(model))
    mean = sum(_gather(own)[:: SHARDS][: world_size // SHARDS]) / (world_size // SHARDS)
    flat = FSDP.fsdp_modules(model)[0]._handle.flat_param
    average_parameters(iter([flat]), mesh["replicate"].get_group())
    out["torch_rebound"] = flat.untyped_storage().data_ptr() != flat._local_shard.untyped_storage().data_ptr()
    x, y = _batch(rank, 1)
    nn.functional.mse_loss(model(x).float(), y).backward()  # forward and backward, as in the test above
    after = _flat(_full_params(model))
    out["torch_lost"] = torch.equal(after, own) and not torch.allclose(after, mean)

    def error_of(fn) -> tuple[str, str] | None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            return type(exc).__name__, str(exc)
        return None

    # On FSDP2 it fails: it flattens the DTensor parameters, which are unevenly sharded.
    fsdp2 = _shard("fsdp2", mesh)
    _train_step(fsdp2, torch.optim.AdamW(fsdp2.parameters(), lr=0.05), rank, 0)
    out["torch_fsdp2"] = error_of(lambda: average_parameters(iter(fsdp2.parameters()), mesh["replicate"].get_group()))

    def adam(m):
        return torch.optim.AdamW(m.parameters(), lr=0.01)

    # FSDP1 HYBRID_SHARD over the same mesh: all-reduces across replicas every step.
    hybrid = FSDP(
        _tiny(), device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu")
    )
    out["fsdp1_hybrid"] = error_of(lambda: FSDPHierarchicalAveragingOptimizer(adam(hybrid), hybrid, mesh, LEVELS))
    out["shard_replica_hybrid"] = error_of(
        lambda: shard_replica(_tiny(), mesh, fsdp_version=1, sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2)
    )
    # FSDP2 with the 2-D mesh: HSDP.
    hsdp = _tiny()
    fully_shard(hsdp, mesh=mesh)
    out["fsdp2_hsdp"] = error_of(lambda: FSDPHierarchicalAveragingOptimizer(adam(hsdp), hsdp, mesh, LEVELS))
    # FSDP1 over the whole world (one replica): shards over other ranks than the mesh row.
    world_fsdp = FSDP(_tiny(), device_id=torch.device("cpu"))
    out["fsdp1_world"] = error_of(
        lambda: FSDPHierarchicalAveragingOptimizer(adam(world_fsdp), world_fsdp, mesh, LEVELS)
    )
    # A mesh whose dimensions are named the other way round, and one with another layout.
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
    good = _shard("fsdp2", mesh)
    out["swapped_names"] = error_of(lambda: FSDPHierarchicalAveragingOptimizer(adam(good), good, swapped, LEVELS))
    from torch.distributed.device_mesh import DeviceMesh

    strided = DeviceMesh("cpu", torch.arange(4).view(2, 2).t().contiguous(), mesh_dim_names=("replicate", "shard"))
    out["strided_layout"] = error_of(lambda: FSDPHierarchicalAveragingOptimizer(adam(good), good, strided, LEVELS))
    out["shards_not_dividing"] = error_of(lambda: init_replicate_shard_mesh(3, "cpu"))
    # Not sharded at all; a bad group size (not a multiple of the shards per replica).
    plain = _tiny()
    out["plain_module"] = error_of(lambda: FSDPHierarchicalAveragingOptimizer(adam(plain), plain, mesh, LEVELS))
    out["bad_group_size"] = error_of(lambda: FSDPHierarchicalAveragingOptimizer(adam(good), good, mesh, {2: 1, 4: 4}))
    # An optimizer parameter FSDP does not manage.
    extra = nn.Parameter(torch.zeros(3))
    out["unmanaged_param"] = error_of(
        lambda: FSDPHierarchicalAveragingOptimizer(
            torch.optim.AdamW([*good.parameters(), extra]), good, mesh, LEVELS
        )
    )
    # Averaging while FSDP1's flat parameters are unsharded would average the wrong tensors.
    fsdp1 = _shard("fsdp1", mesh)
    fsdp1_opt = FSDPHierarchicalAveragingOptimizer(adam(fsdp1), fsdp1, mesh, LEVELS)
    with FSDP.summon_full_params(fsdp1):
        out["inside_summon"] = error_of(fsdp1_opt.tensors_to_average)
    out["outside_summon"] = error_of(fsdp1_opt.tensors_to_average)
    # Nothing hangs: every rank is still in step.
    dist.barrier()
    return out


def test_torch_averager_loses_the_average_and_misuse_is_rejected():
    results = run_distributed(_contrast_and_misuse, WORLD, timeout=240)
    for rank, out in enumerate(results):
        assert out["torch_rebound"] and out["torch_lost"], f"rank {rank}: torch's averager kept the average?"
        kind, msg = out["torch_fsdp2"]
        assert kind == "RuntimeError" and "unevenly sharded" in msg, msg
        kind, msg = out["fsdp1_hybrid"]
        assert kind == "ValueError" and "HYBRID_SHARD" in msg and "mesh['shard']" in msg, msg
        kind, msg = out["shard_replica_hybrid"]
        assert kind == "ValueError" and "_HYBRID_SHARD_ZERO2" in msg, msg
        kind, msg = out["fsdp2_hsdp"]
        assert kind == "ValueError" and "HSDP" in msg and "Replicate" in msg, msg
        kind, msg = out["fsdp1_world"]
        assert kind == "ValueError" and "[0, 1, 2, 3]" in msg, msg
        kind, msg = out["swapped_names"]
        assert kind == "ValueError" and "mesh_dim_names" in msg, msg
        kind, msg = out["strided_layout"]
        assert kind == "ValueError" and "arange(world_size=4).view(2, 2)" in msg, msg
        kind, msg = out["shards_not_dividing"]
        assert kind == "ValueError" and "shards_per_replica=3 must divide the world size (4)" in msg, msg
        kind, msg = out["plain_module"]
        assert kind == "TypeError" and "not sharded with FSDP" in msg, msg
        kind, msg = out["bad_group_size"]
        assert kind == "ValueError" and "multiple of ranks_per_replica=2" in msg, msg
        kind, msg = out["unmanaged_param"]
        assert kind == "ValueError" and "plain tensor" in msg, msg
        kind, msg = out["inside_summon"]
        assert kind == "RuntimeError" and "summon_full_params" in msg, msg
        assert out["outside_summon"] is None


# -- resume through torch.distributed.checkpoint ---------------------------------------------------------------------
def _resume(rank: int, world_size: int, folder: str) -> dict:
    from hieravg_optim.fsdp import (
        FSDPHierarchicalAveragingOptimizer,
        init_replicate_shard_mesh,
        load_checkpoint,
        save_checkpoint,
    )

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    out = {}
    total, stop = 8, 5  # averaging at counts 3 and 6 (warm-up 1); saved at count 5, replicas differing

    def build(config):
        model = _shard(config, mesh)
        opt = FSDPHierarchicalAveragingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1), model, mesh, LEVELS, warmup_steps=1
        )
        return model, opt

    for config in ["fsdp1", "fsdp1_orig", "fsdp2"]:
        model, opt = build(config)
        for step in range(total):
            _train_step(model, opt, rank, step)
        straight = _flat(_full_params(model))

        model, opt = build(config)
        for step in range(stop):
            _train_step(model, opt, rank, step)
        saved = _gather(_flat(_full_params(model)))
        path = os.path.join(folder, config)
        save_checkpoint(path, model, opt)
        del model, opt

        model, opt = build(config)
        load_checkpoint(path, model, opt)
        loaded_step = opt.averaging_step
        loaded_equal = torch.equal(_flat(_full_params(model)), saved[rank])
        for step in range(stop, total):
            _train_step(model, opt, rank, step)
        resumed = _flat(_full_params(model))
        out[config] = dict(
            replicas_differed_at_save=not torch.equal(saved[0], saved[SHARDS]),
            loaded_step=loaded_step,
            loaded_equal=loaded_equal,
            resumed_equal=torch.equal(resumed, straight),
            folders=sorted(os.listdir(path)),
        )
    return out


def test_dcp_resume_equals_uninterrupted_run(tmp_path):
    results = run_distributed(_resume, WORLD, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        for config, r in out.items():
            where = f"rank {rank}, {config}"
            assert r["replicas_differed_at_save"], where
            assert r["loaded_step"] == 5, f"{where}: {r}"
            assert r["loaded_equal"], f"{where}: loaded parameters differ from the saved ones"
            assert r["resumed_equal"], f"{where}: the resumed run differs from the uninterrupted one"
            assert r["folders"] == ["replica_0", "replica_1"], f"{where}: {r['folders']}"


# -- two levels on 8 ranks: 4 replicas x 2 shards ----------------------------------------------------------------------
def _two_levels(rank: int, world_size: int) -> dict:
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    replicas = world_size // SHARDS
    out = {}
    for config in ["fsdp1", "fsdp2"]:
        model = _shard(config, mesh)
        # Counts 2 and 6: pairs of replicas (4 ranks) average; count 4: all 4 replicas (8 ranks). Warm-up 1.
        opt = FSDPHierarchicalAveragingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05), model, mesh, {2: 4, 4: 8}, warmup_steps=1
        )
        captured: dict[int, torch.Tensor] = {}
        handle = opt.optimizer.register_step_post_hook(
            lambda optimizer, args, kwargs: captured.__setitem__(opt.averaging_step, _flat(_full_params(model)))
        )
        checks = {}
        for step in range(5):
            _train_step(model, opt, rank, step)
            if step in (2, 4):
                before = _gather(captured[step])  # every rank's replica, before this step's averaging
                after = _gather(_flat(_full_params(model)))
                per_replica = [before[r * SHARDS] for r in range(replicas)]
                if step == 2:  # replicas {0, 1} and {2, 3} average
                    means = [(per_replica[2 * (r // 2)] + per_replica[2 * (r // 2) + 1]) / 2 for r in range(replicas)]
                else:  # all four
                    means = [sum(per_replica) / replicas] * replicas
                # atol: gloo may sum 4 replicas in another order than sum() does.
                checks[step] = all(
                    torch.allclose(after[r], means[r // SHARDS], rtol=0, atol=1e-6) for r in range(world_size)
                )
                checks[f"{step}_pairs_differ"] = not torch.equal(after[0], after[2 * SHARDS])
        handle.remove()
        out[config] = checks
    return out


def test_two_levels_on_four_replicas():
    results = run_distributed(_two_levels, 8, timeout=300)
    for rank, out in enumerate(results):
        for config, checks in out.items():
            assert checks[2] and checks[4], f"rank {rank}, {config}: {checks}"
            assert checks["2_pairs_differ"] and not checks["4_pairs_differ"], f"rank {rank}, {config}: {checks}"

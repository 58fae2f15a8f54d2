"""hieravg_optim.deepspeed on real DeepSpeed engines: CPU accelerator, gloo, 4 ranks as 2 replicas of 2.

Every engine scenario runs in one spawn of 4 ranks (importing DeepSpeed and starting
processes costs most of the time on 2 cores); the tests below check its results. Each rank
trains on its own data, so the replicas differ until they average.

* For ZeRO stages 0-3 in fp32 and bf16 (and ZeRO-1 bf16 with fp32 gradient accumulation,
  DeepSpeed's ``BF16_Optimizer``; ZeRO-2/3 with the optimizer offloaded to the CPU), with two
  parameter groups: after the averaging step,
  every rank's full module parameters are equal, the fp32 master weights equal exactly
  ``(replica 0 + replica 1) / 2`` of the master weights taken right before averaging, and
  the module parameters are exactly that mean rounded to the module's dtype.
* Gradient accumulation 2: one averaging step per engine step, not per micro batch.
* A never-firing run equals plain ``deepspeed.initialize`` with the same replica groups
  exactly, with the config's optimizer and scheduler, and with a client scheduler.
* An overflow (inf gradients) forced in one replica only, with bf16 loss checking
  (fp16 where the CPU supports it): no hang, equal step counts, the step skipped in one
  replica only. fp16 on CPUs without mkldnn fp16: tests/test_deepspeed_fp16.py.
* Checkpoint save / load: the resumed run equals the uninterrupted one.
* Bad sections: ``ValueError`` on every rank, before any engine exists.

Runtime budget of this file: about 3 minutes on 2 idle cores (measured 2-5 minutes on the shared,
loaded 2-core machine; the deepspeed launcher test is 60-190 s of that, mostly starting 4 processes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness import default_timeout, run_distributed

deepspeed = pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
S = 2  # ranks per replica

pytestmark = pytest.mark.timeout(900)

# (name, zero stage, precision, gradient accumulation, extra config)
AVERAGING_CASES = [
    ("zero0_fp32", 0, "fp32", 1, {}),
    ("zero0_bf16", 0, "bf16", 1, {}),
    ("zero1_fp32", 1, "fp32", 1, {}),
    ("zero1_bf16", 1, "bf16", 1, {}),
    ("zero1_bf16_fp32accum", 1, "bf16", 1, {"data_types": {"grad_accum_dtype": "fp32"}}),
    ("zero2_fp32", 2, "fp32", 1, {}),
    ("zero2_bf16", 2, "bf16", 1, {}),
    ("zero3_fp32", 3, "fp32", 1, {}),
    ("zero3_bf16", 3, "bf16", 1, {}),
    ("zero2_bf16_cpu_offload", 2, "bf16", 1,
     {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}),
    ("zero3_fp32_cpu_offload", 3, "fp32", 1,
     {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}),
    ("zero2_fp32_gas2", 2, "fp32", 2, {}),
    ("zero3_bf16_gas2", 3, "bf16", 2, {}),
]


# ------------------------------------------------------------------------------------------------
# Helpers run inside the ranks
# ------------------------------------------------------------------------------------------------
def _config(stage, prec, gas=1, section=None, extra=None, optimizer_section=False, scheduler_section=False):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
    }
    if prec in ("bf16", "fp16"):
        cfg[prec] = {"enabled": True}
    if optimizer_section:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}}
    if scheduler_section:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 3}}  # fmt: skip
    cfg.update(extra or {})
    if section is not None:
        cfg["hierarchical_averaging"] = section
    return cfg


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _two_groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]


def _client_optimizer(model):
    import torch

    return torch.optim.AdamW(_two_groups(model), lr=0.01)


def _dtype(engine):
    import torch

    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def _micro_step(engine, rank, index, scale=1.0):
    """One forward/backward/step on this rank's deterministic micro batch number ``index``."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + index)
    x = torch.randn(4, 8, generator=g)
    y = torch.randn(4, 4, generator=g)
    loss = (engine(x.to(_dtype(engine))).float() - y).pow(2).mean() * scale
    engine.backward(loss)
    engine.step()


def _full_module(engine):
    """Full module parameters as fp32 CPU copies (gathered under ZeRO-3). Collective in the replica."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().float().cpu().clone() for p in params]
    return [p.detach().float().cpu().clone() for p in params]


def _full_masters(engine):
    """Full fp32 master weights per module parameter (DeepSpeed's own accessors). Collective in the replica."""
    from deepspeed.utils import safe_get_full_fp32_param

    from hieravg_optim.deepspeed.engine import _optimizer_kind

    kind = _optimizer_kind(engine.optimizer)
    params = list(engine.module.parameters())
    if kind == "plain":
        return [p.detach().cpu().clone() for p in params]
    if kind == "fp16_unfused":
        opt = engine.optimizer
        hp = {id(lp): h for lg, hg in zip(opt.fp16_groups, opt.fp32_groups) for lp, h in zip(lg, hg)}
        return [hp[id(p)].detach().cpu().clone() for p in params]
    return [safe_get_full_fp32_param(p).detach().float().cpu().clone() for p in params]


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _all_equal(lists):
    import torch

    return all(all(torch.equal(a, b) for a, b in zip(lists[0], other)) for other in lists)


def _max_diff(xs, ys):
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys))


# ------------------------------------------------------------------------------------------------
# Scenarios
# ------------------------------------------------------------------------------------------------
def capture_masters_before_averaging(engine, state) -> dict:
    """Make every averaging round first store the full fp32 masters under ``["before"]`` of the returned dict.

    Gathering the masters is a collective within the replica; all its ranks average at the same step.
    """
    captured: dict = {}
    original_average = state.averager.average

    def recording_average(level_index, tensors, **kwargs):
        captured["before"] = _full_masters(engine)
        return original_average(level_index, tensors, **kwargs)

    state.averager.average = recording_average
    return captured


def _averaging_case(rank, name, stage, prec, gas, extra):
    """Averaging at count 2 (warmup 1, period 2): exact means of the replicas' master weights."""
    import hieravg_optim.deepspeed as hds

    # A local warm-up, so that the replicas differ before the round checked here.
    section = {"period_group_size": {"2": WORLD}, "warmup_steps": 1, "ranks_per_replica": S, "synchronous_warmup": False}
    model = _model()
    engine, _, _, _ = hds.initialize(
        model=model, optimizer=_client_optimizer(model), config=_config(stage, prec, gas, section, extra)
    )
    state = hds.get_averaging(engine)
    captured = capture_masters_before_averaging(engine, state)
    micro = 0
    for _ in range(3):  # counts 0, 1, 2; averaging at 2
        for _ in range(gas):
            _micro_step(engine, rank, micro)
            micro += 1
    before = _gather(captured.get("before"))
    after_masters = _full_masters(engine)
    after_module = _full_module(engine)
    everyone_module = _gather(after_module)
    dtype = _dtype(engine)
    mean = [(a + b) / 2 for a, b in zip(before[0], before[S])]
    return {
        "kind": state.kind,
        "count": state.step,
        "global_steps": engine.global_steps,
        "rounds": state.metrics()[2]["rounds"],
        "dp_world_size": engine.dp_world_size,
        "replicas_differed": _max_diff(before[0], before[S]) > 0,
        "replica_masters_consistent": _all_equal(before[:S]) and _all_equal(before[S:]),
        "masters_are_mean": all(a.equal(m) for a, m in zip(after_masters, mean)),
        "module_is_mean_in_dtype": all(a.equal(m.to(dtype).float()) for a, m in zip(after_module, mean)),
        "module_identical_everywhere": _all_equal(everyone_module),
        "param_groups": len(engine.basic_optimizer.param_groups),
    }


def _parity_case(rank, name, stage, prec, client_scheduler):
    """A never-firing section vs plain deepspeed.initialize with the same replica groups: exactly equal."""
    import torch

    import hieravg_optim.deepspeed as hds

    results = {}
    never = {"period_group_size": {"1000000": WORLD}, "warmup_steps": 1, "ranks_per_replica": S,
             "synchronous_warmup": False}  # fmt: skip
    runs = {}
    for label in ("ours", "plain"):
        model = _model()
        cfg = _config(stage, prec, 1, never if label == "ours" else None, optimizer_section=not client_scheduler,
                      scheduler_section=not client_scheduler)  # fmt: skip
        kwargs = {}
        if client_scheduler:
            optimizer = _client_optimizer(model)
            kwargs = {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}
        else:
            kwargs = {"model_parameters": _two_groups(model)}
        if label == "ours":
            engine, _, _, sched = hds.initialize(model=model, config=cfg, **kwargs)
        else:
            mpu = hds.ReplicaParallelUnit(S)
            engine, _, _, sched = deepspeed.initialize(model=model, config=cfg, mpu=mpu, **kwargs)
        lrs = []
        for step in range(4):
            _micro_step(engine, rank, step)
            lrs.append(engine.get_lr())
        runs[label] = (_full_module(engine), lrs, engine.dp_world_size, sched is not None)
    results["equal"] = all(a.equal(b) for a, b in zip(runs["ours"][0], runs["plain"][0]))
    results["lrs_equal"] = runs["ours"][1] == runs["plain"][1]
    results["lrs"] = runs["ours"][1]
    results["dp_world_sizes"] = (runs["ours"][2], runs["plain"][2])
    results["schedulers"] = (runs["ours"][3], runs["plain"][3])
    results["replicas_differ"] = not _all_equal(_gather(runs["ours"][0]))
    return results


def _no_section_case(rank):
    """Without the section (or disabled) it is deepspeed.initialize: one data-parallel group of 4."""
    import hieravg_optim.deepspeed as hds

    out = {}
    for label, section in (("absent", None), ("disabled", {"enabled": False, "period_group_size": {"2": 4}})):
        model = _model()
        engine, opt, _, _ = hds.initialize(model=model, optimizer=_client_optimizer(model),
                                           config=_config(1, "fp32", 1, section))  # fmt: skip
        _micro_step(engine, rank, 0)
        out[label] = {
            "dp_world_size": engine.dp_world_size,
            "has_averaging": hds.get_averaging(engine) is not None,
            "identical": _all_equal(_gather(_full_module(engine))),
        }
    return out


def _overflow_case(rank, name, stage, prec):
    """inf gradients in replica 1 at count 2 (an averaging step): skipped there only; no hang, counts equal."""
    import hieravg_optim.deepspeed as hds

    section = {"period_group_size": {"2": WORLD}, "warmup_steps": 0, "ranks_per_replica": S}
    model = _model()
    engine, _, _, _ = hds.initialize(model=model, optimizer=_client_optimizer(model),
                                     config=_config(stage, prec, 1, section))  # fmt: skip
    state = hds.get_averaging(engine)
    for step in range(4):  # counts 0..3; averaging at 0 and 2
        overflow_here = step == 2 and rank >= S
        _micro_step(engine, rank, step, scale=float("inf") if overflow_here else 1.0)
    return {
        "count": state.step,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "rounds": state.metrics()[2]["rounds"],
        "finite": all(bool(t.isfinite().all()) for t in _full_module(engine)),
    }


def _checkpoint_case(rank, name, stage, prec, folder):
    """Save after 3 steps, train 3 more; a fresh engine loading the checkpoint trains the same 3 steps equally."""
    import hieravg_optim.deepspeed as hds

    section = {"period_group_size": {"2": WORLD}, "warmup_steps": 0, "ranks_per_replica": S}

    def build():
        model = _model()
        return hds.initialize(model=model, model_parameters=_two_groups(model),
                              config=_config(stage, prec, 1, section, optimizer_section=True,
                                             scheduler_section=True))[0]  # fmt: skip

    engine = build()
    for step in range(3):
        _micro_step(engine, rank, step)
    engine.save_checkpoint(folder, tag="t3", client_state={"mine": 7})
    for step in range(3, 6):
        _micro_step(engine, rank, step)
    uninterrupted = _full_module(engine)
    count = hds.get_averaging(engine).step

    resumed = build()
    path, client = resumed.load_checkpoint(folder)
    count_loaded = hds.get_averaging(resumed).step
    for step in range(3, 6):
        _micro_step(resumed, rank, step)
    after = _full_module(resumed)
    return {
        "equal": all(a.equal(b) for a, b in zip(uninterrupted, after)),
        "count": count,
        "count_loaded": count_loaded,
        "count_resumed": hds.get_averaging(resumed).step,
        "client_state": {k: v for k, v in client.items() if k == "mine"},
        "our_key_hidden": "hierarchical_averaging" not in client,
        "top": sorted(os.listdir(folder)),
        "replica_dirs": sorted(d for d in os.listdir(os.path.join(folder, "t3")) if d.startswith("replica_")),
        "loaded_from": os.path.relpath(path, folder) if path else None,
    }


def _dataloader_case(rank):
    """DeepSpeed's loader for training_data gives every rank its own samples (not every replica the same)."""
    import torch

    import hieravg_optim.deepspeed as hds

    section = {"period_group_size": {"2": WORLD}, "ranks_per_replica": S}
    data = torch.utils.data.TensorDataset(torch.randn(64, 8))
    model = _model()
    engine, _, loader, _ = hds.initialize(model=model, optimizer=_client_optimizer(model), training_data=data,
                                          config=_config(1, "fp32", 1, section))  # fmt: skip
    # The indices this rank's loader draws (iterating would start worker processes, not allowed in the harness).
    seen = sorted(int(i) for i in loader.data_sampler)
    return {"loader_is_engines": loader is engine.training_dataloader, "samples": seen}


def _bad_world_case(rank):
    """Section errors that need the world size: ValueError on every rank, before any engine exists."""
    import hieravg_optim.deepspeed as hds

    bad = {
        "last_group_not_world": ({"period_group_size": {"2": 2}, "ranks_per_replica": 2}, {}),
        "group_not_multiple_of_replica": ({"period_group_size": {"2": 2, "4": 4}, "ranks_per_replica": 4}, {}),
        "replica_not_dividing_world": ({"period_group_size": {"2": 4}, "ranks_per_replica": 3}, {}),
        # "auto" is LOCAL_WORLD_SIZE (4 here): the error must say where the 4 came from.
        "auto_resolved_to_node": ({"period_group_size": {"2": 2, "4": 4}}, {}),
        # Neither one replica's count (8) nor the world's (16, rewritten: tests/test_deepspeed_install.py).
        "train_batch_size_mismatch": (
            {"period_group_size": {"2": 4}, "ranks_per_replica": 2},
            {"train_batch_size": 12},
        ),
    }
    out = {}
    for label, (section, extra) in bad.items():
        model = _model()
        try:
            hds.initialize(model=model, optimizer=_client_optimizer(model),
                           config=_config(1, "fp32", 1, section, extra))  # fmt: skip
            out[label] = "no error"
        except ValueError as err:
            out[label] = f"ValueError: {err}"
        except Exception as err:  # noqa: BLE001
            out[label] = f"{type(err).__name__}: {err}"
    return out


def _section_on_some_ranks_case(rank):
    """Rank 0's config has no section, the others' have one: a RuntimeError on every rank, naming both."""
    import hieravg_optim.deepspeed as hds

    section = None if rank == 0 else {"period_group_size": {"2": 4}, "ranks_per_replica": 2}
    model = _model()
    try:
        hds.initialize(model=model, optimizer=_client_optimizer(model), config=_config(1, "fp32", 1, section))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"


def _config_missing_on_some_ranks_case(rank):
    """Rank 0 has a config path that does not exist, or no config at all; the others a valid one."""
    import hieravg_optim.deepspeed as hds

    section = {"period_group_size": {"2": 4}, "ranks_per_replica": 2}
    out = {}
    for label, rank0_config in (("missing_file", "/nonexistent/ds_config.json"), ("no_config", None)):
        model = _model()
        config = rank0_config if rank == 0 else _config(1, "fp32", 1, section)
        try:
            hds.initialize(model=model, optimizer=_client_optimizer(model), config=config)
            out[label] = "no error"
        except Exception as err:  # noqa: BLE001
            out[label] = f"{type(err).__name__}: {err}"
    return out


def _synchronous_warmup_case(rank, stage):
    """The default synchronous warm-up: replicas seeded differently, different data, identical after each warm-up step."""
    import torch

    import hieravg_optim.deepspeed as hds

    section = {"period_group_size": {"1000": WORLD}, "warmup_steps": 3, "ranks_per_replica": S}
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank // S)  # replica 1 starts elsewhere; the engine starts it from replica 0's weights
    engine, _, _, _ = hds.initialize(model=model, optimizer=_client_optimizer(model), config=_config(stage, "fp32", 1, section))
    identical = [_all_equal(_gather(_full_module(engine)))]
    for step in range(4):  # counts 0..2: warm-up; count 3: a local step
        _micro_step(engine, rank, step)
        identical.append(_all_equal(_gather(_full_module(engine))) and _all_equal(_gather(_full_masters(engine))))
    state = hds.get_averaging(engine)
    return {"identical": identical, "rounds": state.metrics()[1000]["rounds"], "count": state.step}


def _frozen_case(rank, stage, average_frozen):
    """A frozen Linear (in the client optimizer's groups): skipped by default, averaged with "average_frozen"."""
    import torch

    import hieravg_optim.deepspeed as hds

    section = {"period_group_size": {"2": WORLD}, "ranks_per_replica": S}
    if average_frozen:
        section["average_frozen"] = True
    model = _model()
    frozen = model[0].weight  # 16 x 8
    frozen.requires_grad_(False)
    with torch.no_grad():
        frozen.add_(rank // S)  # replica 1's frozen weight differs until the engine broadcasts replica 0's
    expected_start = _model()[0].weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine, _, _, _ = hds.initialize(model=model, optimizer=optimizer, config=_config(stage, "fp32", 1, section))
    state = hds.get_averaging(engine)
    start_is_replica_0 = torch.equal(frozen, expected_start)
    masters = state.master_tensors()
    with torch.no_grad():
        frozen.fill_(rank)
        for t in masters:
            t.fill_(rank)
    state.average_now(-1)
    shard_mean = float(rank % S + 1)  # ranks s and s + S average
    frozen_value = shard_mean if average_frozen else float(rank)
    return {
        "kind": state.kind,
        "start_is_replica_0": start_is_replica_0,
        "frozen_exact": torch.equal(frozen, torch.full_like(frozen, frozen_value)),
        "masters_mean": all(torch.equal(t, torch.full_like(t, shard_mean)) for t in masters),
        "payload_bytes": state.metrics()[2]["payload_bytes"],
        "expected_bytes": 4 * (sum(t.numel() for t in masters) + (frozen.numel() if average_frozen else 0)),
        "masters_exclude_frozen": sum(t.numel() for t in masters) < sum(p.numel() for p in model.parameters()),
    }


def _all_scenarios(rank, world_size, folder):
    import torch

    torch.set_num_threads(1)
    # First: DeepSpeed keeps the mpu of the last engine built with one in a module global
    # (deepspeed.utils.groups.mpu), so a plain engine must be built before any replica engine.
    results = {"no_section": _no_section_case(rank)}
    results["bad_world"] = _bad_world_case(rank)
    results["section_on_some_ranks"] = _section_on_some_ranks_case(rank)
    results["config_missing_on_some_ranks"] = _config_missing_on_some_ranks_case(rank)
    results["dataloader"] = _dataloader_case(rank)
    results["averaging"] = {case[0]: _averaging_case(rank, *case) for case in AVERAGING_CASES}
    results["parity"] = {
        "zero0_fp32_config_scheduler": _parity_case(rank, "z0", 0, "fp32", client_scheduler=False),
        "zero2_bf16_client_scheduler": _parity_case(rank, "z2", 2, "bf16", client_scheduler=True),
        "zero3_fp32_config_scheduler": _parity_case(rank, "z3", 3, "fp32", client_scheduler=False),
    }
    results["overflow"] = {
        "zero1_bf16": _overflow_case(rank, "z1", 1, "bf16"),
        "zero2_bf16": _overflow_case(rank, "z2", 2, "bf16"),
        "zero3_bf16": _overflow_case(rank, "z3", 3, "bf16"),
    }
    if _fp16_supported():
        results["overflow"]["zero2_fp16"] = _overflow_case(rank, "z2f", 2, "fp16")
    results["checkpoint"] = {
        "zero2_bf16": _checkpoint_case(rank, "z2", 2, "bf16", os.path.join(folder, "z2")),
        "zero3_fp32": _checkpoint_case(rank, "z3", 3, "fp32", os.path.join(folder, "z3")),
        "zero0_fp32": _checkpoint_case(rank, "z0", 0, "fp32", os.path.join(folder, "z0")),
    }
    results["synchronous_warmup"] = {f"zero{stage}": _synchronous_warmup_case(rank, stage) for stage in (1, 3)}
    results["frozen"] = {
        f"zero{stage}_average_frozen={flag}": _frozen_case(rank, stage, flag) for stage in (0, 1) for flag in (False, True)
    }
    return results


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    import torch

    return torch.float16 in get_accelerator().supported_dtypes()


@pytest.fixture(scope="module")
def results():
    # pg_timeout is generous: on a fresh machine the first DeepSpeed import in each rank compiles
    # DeepSpeed's shm comm op (60-80 s on 2 cores, once; cached in ~/.cache/torch_extensions),
    # and the ranks that finish first wait for the others in their first collective.
    with tempfile.TemporaryDirectory(prefix="hieravg-ds-") as folder:
        out = run_distributed(_all_scenarios, WORLD, folder, timeout=600, pg_timeout=300)
    return out


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------
def assert_exact_replica_mean(results, case):
    """What ``_averaging_case`` found on every rank: the exact replica mean, in the masters and the module."""
    for rank, per_rank in enumerate(results):
        r = per_rank["averaging"][case]
        assert r["dp_world_size"] == S, (rank, r)
        assert r["replicas_differed"], f"rank {rank}: replicas were equal before averaging; the test is vacuous"
        assert r["replica_masters_consistent"], f"rank {rank}: ranks of one replica disagree before averaging"
        assert r["masters_are_mean"], f"rank {rank} {case}: fp32 masters are not the mean of the replicas"
        assert r["module_is_mean_in_dtype"], f"rank {rank} {case}: module params are not the mean in their dtype"
        assert r["module_identical_everywhere"], f"rank {rank} {case}: replicas differ after averaging"
        assert r["param_groups"] == 2
        # One count and one round per engine step (gradient-accumulation boundary), not per micro batch.
        assert r["count"] == 3 == r["global_steps"], r
        assert r["rounds"] == 1, r


@pytest.mark.parametrize("case", [c[0] for c in AVERAGING_CASES])
def test_averaging_gives_exact_replica_mean(results, case):
    assert_exact_replica_mean(results, case)


def test_averaging_covers_every_optimizer_kind(results):
    kinds = {name: results[0]["averaging"][name]["kind"] for name, *_ in AVERAGING_CASES}
    assert kinds["zero0_fp32"] == "plain"
    assert kinds["zero0_bf16"] == "fp16_unfused"
    assert kinds["zero1_bf16_fp32accum"] == "bf16"
    assert kinds["zero2_bf16"] == "zero12" and kinds["zero3_bf16"] == "zero3"


@pytest.mark.parametrize("case", ["zero0_fp32_config_scheduler", "zero2_bf16_client_scheduler",
                                  "zero3_fp32_config_scheduler"])  # fmt: skip
def test_never_firing_equals_plain_deepspeed(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank["parity"][case]
        assert r["dp_world_sizes"] == (S, S)
        assert r["schedulers"] == (True, True)
        assert r["equal"], f"rank {rank} {case}: parameters differ from plain deepspeed.initialize"
        assert r["lrs_equal"], r["lrs"]
        assert r["replicas_differ"], "the replicas never diverged, so the comparison is vacuous"
    lrs = [lr[0] for lr in results[0]["parity"][case]["lrs"]]
    assert len(set(lrs)) > 1, f"the scheduler did not change the learning rate: {lrs}"


def test_without_section_is_plain_deepspeed(results):
    for per_rank in results:
        for label in ("absent", "disabled"):
            r = per_rank["no_section"][label]
            assert r == {"dp_world_size": WORLD, "has_averaging": False, "identical": True}, (label, r)


@pytest.mark.parametrize("case", ["zero1_bf16", "zero2_bf16", "zero3_bf16", "zero2_fp16"])
def test_overflow_in_one_replica_only(results, case):
    if case not in results[0]["overflow"]:
        pytest.skip("fp16 is not supported by DeepSpeed's CPU accelerator on this machine "
                    "(torch.ops.mkldnn._is_mkldnn_fp16_supported() is False); tests/test_deepspeed_fp16.py "
                    "runs DeepSpeed's fp16 path here with only that capability check overridden")  # fmt: skip
    for rank, per_rank in enumerate(results):
        r = per_rank["overflow"][case]
        assert r["count"] == 4 == r["global_steps"], (rank, r)
        assert r["rounds"] == 2, (rank, r)
        assert r["skipped_steps"] == (1 if rank >= S else 0), (rank, r)
        assert r["finite"], (rank, r)


@pytest.mark.parametrize("case", ["zero2_bf16", "zero3_fp32", "zero0_fp32"])
def test_checkpoint_resume_equals_uninterrupted(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank["checkpoint"][case]
        assert r["count_loaded"] == 3 and r["count"] == 6 == r["count_resumed"], (rank, r)
        assert r["equal"], f"rank {rank} {case}: resumed run differs from the uninterrupted one"
        assert r["client_state"] == {"mine": 7} and r["our_key_hidden"], r
        assert r["top"] == ["latest", "t3"] and r["replica_dirs"] == ["replica_0", "replica_1"], r
        assert r["loaded_from"].startswith(f"t3/replica_{rank // S}/"), r


@pytest.mark.parametrize("stage", [1, 3])
def test_warmup_is_synchronous_across_replicas(results, stage):
    for rank, per_rank in enumerate(results):
        r = per_rank["synchronous_warmup"][f"zero{stage}"]
        # At construction (replica 0's weights), after counts 0-2 (warm-up), and not after the local count 3.
        assert r["identical"] == [True, True, True, True, False], (rank, stage, r)
        assert r["rounds"] == 3 and r["count"] == 4, r


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("average_frozen", [False, True])
def test_frozen_parameters_are_skipped_unless_asked(results, stage, average_frozen):
    for rank, per_rank in enumerate(results):
        r = per_rank["frozen"][f"zero{stage}_average_frozen={average_frozen}"]
        assert r["kind"] == ("plain" if stage == 0 else "zero12"), r
        assert r["start_is_replica_0"], f"rank {rank}: the frozen weight was not broadcast from replica 0"
        assert r["frozen_exact"], (rank, r)
        assert r["masters_mean"], (rank, r)
        assert r["masters_exclude_frozen"], (rank, r)
        assert r["payload_bytes"] == r["expected_bytes"], (rank, r)


def test_training_data_is_sharded_over_all_ranks(results):
    samples = [per_rank["dataloader"]["samples"] for per_rank in results]
    assert all(per_rank["dataloader"]["loader_is_engines"] for per_rank in results)
    assert all(len(s) == 64 // WORLD for s in samples), samples
    assert sorted(v for s in samples for v in s) == list(range(64)), samples


def test_bad_world_dependent_sections_raise_value_error(results):
    expected = {
        "last_group_not_world": "must be equal to the size of the process group",
        "group_not_multiple_of_replica": "multiple of ranks_per_replica",
        "replica_not_dividing_world": "must divide the size of the process group",
        "auto_resolved_to_node": '"ranks_per_replica": "auto" resolved to 4 from LOCAL_WORLD_SIZE=4',
        "train_batch_size_mismatch": "train_batch_size=12",
    }
    for rank, per_rank in enumerate(results):
        for label, fragment in expected.items():
            message = per_rank["bad_world"][label]
            assert message.startswith("ValueError") and fragment in message, (rank, label, message)
            if label != "train_batch_size_mismatch":  # a key of DeepSpeed's own, not of the section
                assert 'DeepSpeed config section "hierarchical_averaging"' in message, (rank, label, message)


def test_section_on_some_ranks_only_raises_on_every_rank(results):
    for rank, per_rank in enumerate(results):
        message = per_rank["section_on_some_ranks"]
        assert message.startswith("RuntimeError: Ranks disagree on the \"hierarchical_averaging\" section"), (
            rank,
            message,
        )
        assert "rank 0 has 'disabled', rank 1 has {" in message and "Give every rank the same section" in message, (
            rank,
            message,
        )


def test_config_missing_on_some_ranks_raises_on_every_rank(results):
    """Instead of the other ranks waiting for rank 0 until the process group's timeout."""
    for rank, per_rank in enumerate(results):
        missing, absent = per_rank["config_missing_on_some_ranks"].values()
        if rank == 0:
            assert missing.startswith("ValueError: Expected a path to an existing DeepSpeed config"), missing
        else:
            assert missing.startswith("RuntimeError: Rank 0 failed while checking"), missing
            assert "Expected a path to an existing DeepSpeed config" in missing, missing
            assert "/nonexistent/ds_config.json" in missing, missing
        assert absent.startswith("RuntimeError: Ranks disagree on the \"hierarchical_averaging\" section"), absent
        assert "rank 0 has 'no config', rank 1 has {" in absent, absent


# ------------------------------------------------------------------------------------------------
# No process group needed
# ------------------------------------------------------------------------------------------------
BAD_SECTIONS = [
    ([1, 2], "must be a JSON object"),
    ({"period_group_size": {"4": 4}, "period": 3}, "unknown key 'period'"),
    ({"warmup_steps": 3}, '"period_group_size" is required'),
    ({"period_group_size": [[4, 4]]}, '"period_group_size" must be'),
    ({"period_group_size": {}}, "must not be empty"),
    ({"period_group_size": {"8": 4, "4": 8}}, "strictly increasing"),
    ({"period_group_size": {"0": 4}}, "Period 0"),
    ({"period_group_size": {"x": 4}}, "'x'"),
    ({"period_group_size": {"4": 0}}, "Group size 0"),
    ({"period_group_size": {"4": "4"}}, "Group size '4'"),
    ({"period_group_size": {"4": 4}, "warmup_steps": -1}, '"warmup_steps"'),
    ({"period_group_size": {"4": 4}, "warmup_steps": True}, '"warmup_steps"'),
    ({"period_group_size": {"4": 4}, "warmup_steps": 1.5}, '"warmup_steps"'),
    ({"period_group_size": {"4": 4}, "synchronous_warmup": "yes"}, '"synchronous_warmup" must be true or false'),
    ({"period_group_size": {"4": 4}, "average_frozen": 1}, '"average_frozen" must be true or false'),
    ({"period_group_size": {"4": 4}, "ranks_per_replica": 0}, '"ranks_per_replica"'),
    ({"period_group_size": {"4": 4}, "ranks_per_replica": "node"}, '"ranks_per_replica"'),
    ({"period_group_size": {"4": 4}, "ranks_per_replica": 2.0}, '"ranks_per_replica"'),
    ({"period_group_size": {"4": 4}, "bucket_cap_mb": 0}, '"bucket_cap_mb"'),
    ({"period_group_size": {"4": 4}, "bucket_cap_mb": "25"}, '"bucket_cap_mb"'),
    ({"period_group_size": {"4": 4}, "enabled": "yes"}, '"enabled"'),
]


@pytest.mark.parametrize("section,fragment", BAD_SECTIONS, ids=[str(i) for i in range(len(BAD_SECTIONS))])
def test_bad_section_raises_value_error(section, fragment):
    from hieravg_optim.deepspeed import parse_section

    with pytest.raises(ValueError) as info:
        parse_section(section)
    assert fragment in str(info.value)
    assert "hierarchical_averaging" in str(info.value)


def test_bad_section_raises_before_any_process_group(tmp_path):
    """initialize() rejects a bad section before touching torch.distributed (no process group exists here)."""
    import torch
    import torch.distributed as dist

    import hieravg_optim.deepspeed as hds

    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_config(1, "fp32", 1, {"period_group_size": {"4": 4}, "warmup": 1})))
    with pytest.raises(ValueError, match="unknown key 'warmup'"):
        hds.initialize(model=torch.nn.Linear(2, 2), config=str(path))
    assert not dist.is_initialized()


def test_without_optimizer_the_section_is_left_out_before_any_process_group():
    """No optimizer (HF's ZeRO-3 evaluation engine): DeepSpeed's own engine, of the config without the section."""
    import torch
    import torch.distributed as dist

    from hieravg_optim.deepspeed.local import check_locally

    config = _config(1, "fp32", 1, {"period_group_size": {"4": 4}})
    local = check_locally(config, torch.nn.Linear(2, 2), None, None, None, False)
    assert local.settings is not None and local.averaging_config is None
    assert local.ds_config == {k: v for k, v in config.items() if k != "hierarchical_averaging"}
    assert not dist.is_initialized()


def test_ranks_per_replica_auto_reads_the_launcher(monkeypatch):
    from hieravg_optim.deepspeed.section import parse_section, resolve_ranks_per_replica

    settings = parse_section({"period_group_size": {"4": 8}})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the deepspeed launcher
    assert resolve_ranks_per_replica(settings) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun
    assert resolve_ranks_per_replica(settings) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_SIZE")
    with pytest.raises(ValueError, match="ranks_per_replica"):
        resolve_ranks_per_replica(settings)


CONFIG_FILES = sorted((ROOT / "ds_configs").glob("*.json"))


def test_ds_configs_cover_every_stage_and_precision():
    names = [p.name for p in CONFIG_FILES]
    for needle in ("zero0", "zero1", "zero2", "zero3", "bf16", "fp16"):
        assert any(needle in n for n in names), (needle, names)


def _auto_filled(config):
    """The ``"auto"`` values of an HF config (``hf_*.json``) as the ``Trainer`` fills them on one rank."""
    fill = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4,
            "gradient_clipping": 1.0, "enabled": True}  # fmt: skip
    return {
        k: _auto_filled(v) if isinstance(v, dict) else (fill[k] if v == "auto" else v) for k, v in config.items()
    }


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_ds_config_loads_with_this_library_and_deepspeed(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    from hieravg_optim.deepspeed.section import SECTION, _read_config, parse_section

    loaded = _read_config(str(path))
    settings = parse_section(loaded[SECTION])
    assert settings.enabled
    config = settings.averaging_config(settings.ranks_per_replica or 1)
    config.check_world_size(WORLD)  # the files are written for the 4-rank example
    stripped = _auto_filled({k: v for k, v in loaded.items() if k != SECTION})
    ds = DeepSpeedConfig(stripped)  # no process group: DeepSpeed assumes a world of 1
    stage = int(path.name.split("zero")[1][0])
    assert ds.zero_optimization_stage == stage
    assert ds.bfloat16_config.enabled == ("bf16" in path.name)
    assert ds.float16_config.enabled == ("fp16" in path.name)


# ------------------------------------------------------------------------------------------------
# The launcher
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_launcher_trains_digits(tmp_path):
    metrics_path = tmp_path / "metrics.json"
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(_free_port()),
        "examples/train_digits_deepspeed.py", "--deepspeed_config", "ds_configs/zero3_bf16.json",
        "--metrics-out", str(metrics_path),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=default_timeout(420))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"deepspeed launcher timed out\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n{err[-8000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n{err[-8000:]}"
    metrics = json.loads(metrics_path.read_text())
    for key in ("world_size", "period_group_size", "final_loss", "test_accuracy", "rounds_per_level",
                "replicas_identical"):  # fmt: skip
        assert key in metrics, key
    assert metrics["world_size"] == 4 and metrics["ranks_per_replica"] == 2 and metrics["zero_stage"] == 3
    assert metrics["replicas_identical"] is True
    assert metrics["rounds_per_level"] == metrics["expected_rounds_per_level"]
    assert metrics["test_accuracy"] >= 0.93, metrics["test_accuracy"]

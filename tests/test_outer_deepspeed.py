"""Outer optimizers (DiLoCo) on real DeepSpeed engines: CPU accelerator, gloo, 4 ranks as 2 replicas of 2.

Every engine scenario runs in one spawn of 4 ranks; each rank trains on its own data, so the
replicas differ until they average. The section's ``"outer_optimizer"`` steps, per level, on
``anchor - mean`` of each rank's fp32 master partition (docs/outer.md).

* Outer ``SGD(lr=1, momentum=0)`` equals plain averaging, ZeRO 0-3 in fp32 and bf16: the same
  engine run once with the plain section and once with the outer one, 3 rounds; every round's
  fp32 masters within 1e-6 of the exact mean of the replicas' masters just before it, and the
  final module parameters within 1e-6 of the plain run's.
* Nesterov (lr 0.7, momentum 0.9) on ZeRO-3 fp32, with the anchors on the CPU, over 3 rounds:
  every round's full masters within 1e-6 of a reference computed here with ``torch.optim.SGD`` on
  full-size copies; every rank identical after each round; the pseudo-gradient norms of the
  partitions add up (in squares) to the reference's; ``outer_bytes`` is anchors plus momentum.
  With a warm-up of 1 step (ZeRO-1 bf16), the anchors are the weights after the warm-up round.
* An outer optimizer on a level of one replica (Lookahead within the replica, ZeRO-2 bf16): the
  rounds move the masters with no peer, and the module gets them.
* Resume: ZeRO-2 bf16 and ZeRO-3 fp32 with Nesterov, saved after 2 rounds: the resumed run
  equals the uninterrupted one (1e-6), each rank restores its own anchors from its own file. One
  rank's file missing: an error on every rank. A checkpoint saved without outer optimizers: a
  warning, fresh anchors at the loaded weights, the replicas identical after the next round.
* fp16 (``"fp16": {"enabled": true}``, DeepSpeed's loss-scaled ZeRO-1/2 optimizer; the CPU capability
  override of tests/test_deepspeed_fp16.py, in a spawn of its own): outer SGD(lr=1) equals plain
  averaging (ZeRO-1 and ZeRO-2, within 1e-6, as above), and Nesterov on ZeRO-2 matches the
  ``torch.optim.SGD`` reference from the fp16-rounded weights the masters start at (1e-6), no step
  skipped.
* A checkpoint whose per-rank outer state does not fit the rank's masters (anchors in bf16, one
  element short, one anchor fewer), loaded during a warm-up: a ``ValueError`` at load naming the
  checkpoint and the file on that rank, a ``RuntimeError`` naming it on the others.
* Bad configs: ``ValueError`` naming the key on every rank, before any engine exists; a section
  whose outer optimizer differs between ranks is a ``RuntimeError`` on every rank.
* ``ds_configs/zero2_bf16_diloco.json`` as shipped trains with its two rounds.

Runtime budget: about 2 minutes on the loaded 2-core machine.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import pytest

from tests.harness import run_distributed, run_scenarios
from tests.test_deepspeed import _full_masters, _full_module, _gather, _max_diff, _model

deepspeed = pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
S = 2  # ranks per replica
PERIOD = 2
NESTEROV = {"type": "SGD", "params": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}
SGD1 = {"type": "SGD", "params": {"lr": 1.0, "momentum": 0.0}}
STAGES_AND_PRECISIONS = [(stage, prec) for stage in (0, 1, 2, 3) for prec in ("fp32", "bf16")]

pytestmark = pytest.mark.timeout(900)


# ------------------------------------------------------------------------------------------------
# Helpers run inside the ranks
# ------------------------------------------------------------------------------------------------
def _section(outer=None, warmup=0, **extra):
    section = {"period_group_size": {str(PERIOD): WORLD}, "warmup_steps": warmup, "ranks_per_replica": S,
               "synchronous_warmup": False, **extra}  # fmt: skip
    if outer is not None:
        section["outer_optimizer"] = {str(PERIOD): outer}
    return section


def _config(stage, prec, section=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}},
    }
    if prec == "bf16":
        cfg["bf16"] = {"enabled": True}
    if prec == "fp16":
        # A loss scale of 2**8 (not DeepSpeed's 2**16): the tiny model's first steps do not overflow.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if section is not None:
        cfg["hierarchical_averaging"] = section
    return cfg


def _build(stage, prec, section, shift=0.0):
    """The engine of a section; ``shift`` is added to every weight before initialize (replica 0's are kept)."""
    import torch

    import hieravg_optim.deepspeed as hds

    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    engine = hds.initialize(model=model, model_parameters=groups, config=_config(stage, prec, section))[0]
    return engine, hds.get_averaging(engine)


def _step(engine, rank, index):
    """One forward/backward/step on this rank's deterministic batch ``index``."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + index)
    x = torch.randn(4, 8, generator=g)
    y = torch.randn(4, 4, generator=g)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    engine.backward((engine(x.to(dtype)).float() - y).pow(2).mean())
    engine.step()


def _record_rounds(engine, state):
    """Make every averaging round append the full masters before and after it (before the module push)."""
    rounds = []
    original = state.averager.average

    def recording(level_index, tensors, **kwargs):
        before = _full_masters(engine)
        out = original(level_index, tensors, **kwargs)
        rounds.append((before, _full_masters(engine)))
        return out

    state.averager.average = recording
    return rounds


# ------------------------------------------------------------------------------------------------
# Scenarios
# ------------------------------------------------------------------------------------------------
def _sgd1_case(rank, stage, prec):
    """Outer SGD(lr=1, momentum=0) vs the plain section, same data: each round the exact mean, same end."""
    steps = 2 * PERIOD + 1  # rounds at counts 0, 2, 4
    out = {}
    for label, outer in (("plain", None), ("outer", SGD1)):
        engine, state = _build(stage, prec, _section(outer))
        rounds = _record_rounds(engine, state) if label == "outer" else []
        for step in range(steps):
            _step(engine, rank, step)
        out[label] = _full_module(engine)
        if label == "outer":
            everyone = _gather([(b, a) for b, a in rounds])
            out["rounds"] = len(rounds)
            # Each round: the masters after it vs the exact mean of the two replicas' masters before it.
            out["round_errors"] = [
                _max_diff(after, [(x + y) / 2 for x, y in zip(everyone[0][k][0], everyone[S][k][0])])
                for k, (_, after) in enumerate(rounds)
            ]
            out["replicas_differed"] = [_max_diff(everyone[0][k][0], everyone[S][k][0]) > 0 for k in range(len(rounds))]
            masters = _full_masters(engine)
            dtype = next(engine.module.parameters()).dtype
            out["module_is_masters_in_dtype"] = all(
                m.to(dtype).float().equal(p) for m, p in zip(masters, out["outer"])
            )
            metrics = state.metrics()[PERIOD]
            out["kind"] = state.kind
            out["skipped_steps"] = engine.skipped_steps
            out["pseudo_grad_norm"] = metrics["pseudo_grad_norm"]
            out["outer_bytes"] = metrics["outer_bytes"]
    out["final_diff_to_plain"] = _max_diff(out.pop("plain"), out.pop("outer"))
    return out


def _nesterov_case(rank, stage, prec, warmup, device):
    """Nesterov outer SGD over 3 rounds vs torch.optim.SGD on full-size copies, computed here."""
    import torch

    # With a warm-up, the synchronous one: its last round leaves every replica equal, then the anchors are taken.
    section = _section(NESTEROV, warmup=warmup, outer_state_device=device, synchronous_warmup=bool(warmup))
    # Replica 1 starts elsewhere: the anchors must be taken after the broadcast of replica 0's weights.
    engine, state = _build(stage, prec, section, shift=float(rank // S))
    # Replica 0's weights; in fp16 as DeepSpeed's masters start: the fp16 module weights, in fp32.
    low = torch.float16 if prec == "fp16" else torch.float32
    anchors = None if warmup else [p.detach().to(low).float() for p in _model().parameters()]
    rounds = _record_rounds(engine, state)
    first = -(-warmup // PERIOD) * PERIOD  # the first outer round: the first multiple of the period >= warmup
    errors, norms, identical = [], [], []
    reference_opt = None
    expected_norms = []
    for step in range(first + 2 * PERIOD + 1):  # 3 outer rounds
        count, seen = state.step, len(rounds)
        _step(engine, rank, step)
        if warmup and count == warmup - 1:
            anchors = _full_masters(engine)  # after the last warm-up round
        if len(rounds) > seen and count >= warmup:
            before, after = rounds[-1]
            everyone = _gather(before)
            mean = [(x + y) / 2 for x, y in zip(everyone[0], everyone[S])]
            if reference_opt is None:
                reference_opt = torch.optim.SGD(anchors, lr=0.7, momentum=0.9, nesterov=True)
            with torch.no_grad():
                for a, m in zip(anchors, mean):
                    a.grad = a - m
            expected_norms.append(float(torch.cat([a.grad.flatten() for a in anchors]).norm()))
            reference_opt.step()
            errors.append(_max_diff(after, anchors))
            norms.append(state.metrics()[PERIOD]["pseudo_grad_norm"])
            module = _full_module(engine)
            identical.append(all(all(m.equal(o) for m, o in zip(module, other)) for other in _gather(module)))
    own = [torch.as_tensor(t) for t in state.averager.state_dict()["outer"][PERIOD]["anchors"]]
    return {
        "kind": state.kind,
        "skipped_steps": engine.skipped_steps,
        "module_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "rounds": len(errors),
        "errors": errors,
        "identical": identical,
        "norms": norms,
        "expected_norms": expected_norms,
        "outer_bytes": state.metrics()[PERIOD]["outer_bytes"],
        "master_bytes": sum(t.numel() * t.element_size() for t in state.tensors_to_average()),
        "anchor_devices": sorted({str(t.device) for t in own}),
        "momentum_nonzero": any(float(s["momentum_buffer"].abs().max()) > 0
                                for s in state.averager.state_dict()["outer"][PERIOD]["optimizer"]["state"].values()),
    }  # fmt: skip


def _single_replica_level_case(rank, stage, prec):
    """An outer optimizer on a level of one replica (group size = ranks_per_replica): Lookahead within each replica.

    Levels {1: 2, 4: 4}; period 1 has outer SGD(lr=0.5): each round there moves the weights halfway
    from the anchor to this replica's own weights, with no peer to average with; the round at count 0
    and 4 (top level, plain) resets that anchor. The module must get the new masters after every round.
    """

    section = {"period_group_size": {"1": S, "4": WORLD}, "ranks_per_replica": S, "synchronous_warmup": False,
               "outer_optimizer": {"1": {"type": "SGD", "params": {"lr": 0.5}}}}  # fmt: skip
    engine, state = _build(stage, prec, section)
    rounds = _record_rounds(engine, state)
    dtype = next(engine.module.parameters()).dtype
    errors, pushed, anchors = [], [], None
    for step in range(6):  # counts 0 and 4: top level; 1-3 and 5: the replica level
        count = state.step
        _step(engine, rank, step)
        before, after = rounds[-1]
        if count % 4 == 0:
            anchors = after  # reset to the top level's result
        else:
            expected = [a - 0.5 * (a - b) for a, b in zip(anchors, before)]
            errors.append(_max_diff(after, expected))
            anchors = expected
        masters = _full_masters(engine)
        pushed.append(all(m.to(dtype).float().equal(p) for m, p in zip(masters, _full_module(engine))))
    return {
        "errors": errors,
        "pushed": pushed,
        "moved": [_max_diff(b, a) > 0 for (b, a) in rounds[1:4]],
        "rounds": [state.metrics()[p]["rounds"] for p in (1, 4)],
        "replicas_differ": _max_diff(*[_gather(_full_masters(engine))[i] for i in (0, S)]) > 0,
    }


def _resume_case(rank, stage, prec, folder):
    """Save after 3 steps (2 rounds), train 3 more; a fresh engine loading the checkpoint trains them the same."""
    import torch

    from hieravg_optim.deepspeed import outer_state_file

    engine, state = _build(stage, prec, _section(NESTEROV))
    for step in range(3):
        _step(engine, rank, step)
    saved_outer = state.averager.state_dict()["outer"][PERIOD]
    saved_anchors = [a.clone() for a in saved_outer["anchors"]]
    engine.save_checkpoint(folder, tag="t3")
    for step in range(3, 6):
        _step(engine, rank, step)
    uninterrupted = _full_module(engine)

    resumed, resumed_state = _build(stage, prec, _section(NESTEROV))
    resumed.load_checkpoint(folder)
    loaded = resumed_state.averager.state_dict()["outer"][PERIOD]
    anchors_restored = all(torch.equal(a, b) for a, b in zip(loaded["anchors"], saved_anchors))
    for step in range(3, 6):
        _step(resumed, rank, step)
    after = _full_module(resumed)
    tag_dir = os.path.join(folder, "t3", f"replica_{rank // S}")
    anchors_everywhere = _gather(saved_anchors)
    first = (rank // S) * S  # the first rank of this replica
    return {
        "diff": _max_diff(uninterrupted, after),
        "count_resumed": resumed_state.step,
        "anchors_restored": anchors_restored,
        "own_file": os.path.exists(outer_state_file(tag_dir, rank % S)),
        # The per-rank files matter: the two ranks of a replica hold different anchors.
        "ranks_of_replica_differ": _max_diff(anchors_everywhere[first], anchors_everywhere[first + 1]) > 0,
        "rounds": resumed_state.metrics()[PERIOD]["rounds"],
    }


def _resume_edges_case(rank, folder):
    """A rank's outer state file missing: an error on every rank. A checkpoint without outer state: fresh anchors."""
    import torch.distributed as dist

    from hieravg_optim.deepspeed import outer_state_file

    out = {}
    plain, _ = _build(1, "fp32", _section())
    for step in range(3):
        _step(plain, rank, step)
    plain.save_checkpoint(os.path.join(folder, "plain"), tag="t3")
    engine, state = _build(1, "fp32", _section(NESTEROV))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(os.path.join(folder, "plain"))
    out["warned"] = any("has no anchors or outer optimizer state" in str(w.message) for w in caught)
    out["anchors_at_loaded_weights"] = state.averager.has_anchors and _max_diff(
        [a.cpu() for a in state.averager.state_dict()["outer"][PERIOD]["anchors"]],
        [t.cpu() for t in state.tensors_to_average()],
    ) == 0
    for step in range(3, 5):  # a round at count 4: the anchors of the two replicas are averaged first
        _step(engine, rank, step)
    module = _full_module(engine)
    out["identical_after_round"] = all(all(m.equal(o) for m, o in zip(module, other)) for other in _gather(module))

    engine.save_checkpoint(os.path.join(folder, "outer"), tag="t5")
    dist.barrier()
    if rank == 3:
        os.remove(outer_state_file(os.path.join(folder, "outer", "t5", "replica_1"), 1))
    dist.barrier()
    fresh, _ = _build(1, "fp32", _section(NESTEROV))
    try:
        fresh.load_checkpoint(os.path.join(folder, "outer"))
        out["missing_file"] = "no error"
    except Exception as err:  # noqa: BLE001
        out["missing_file"] = f"{type(err).__name__}: {err}"
    return out


def _load_mismatch_case(rank, folder):
    """A checkpoint whose per-rank outer state does not fit this rank's masters, loaded during a warm-up (no anchors
    held yet): an error at load time on every rank, naming the checkpoint; the failing rank's averaging state unchanged."""
    import torch
    import torch.distributed as dist

    from hieravg_optim.deepspeed import outer_state_file

    engine, _ = _build(1, "fp32", _section(NESTEROV))
    for step in range(3):
        _step(engine, rank, step)

    def dtype(outer):  # a foreign file: anchors in bfloat16
        outer["anchors"] = [a.to(torch.bfloat16) for a in outer["anchors"]]

    def shape(outer):  # anchor 0 (and its momentum) one element short
        outer["anchors"][0] = outer["anchors"][0][:-1].clone()
        outer["optimizer"]["state"][0]["momentum_buffer"] = outer["optimizer"]["state"][0]["momentum_buffer"][:-1]

    def count(outer):  # the last anchor gone, and the outer optimizer state over the others (consistent in itself)
        last = len(outer["anchors"]) - 1
        outer["anchors"].pop()
        outer["optimizer"]["state"].pop(last)
        outer["optimizer"]["param_groups"][-1]["params"].remove(last)

    # (tag, the rank whose file is changed, the change)
    cases = [("dtype", 3, dtype), ("shape", 1, shape), ("count", 0, count)]
    for tag, _, _ in cases:
        engine.save_checkpoint(folder, tag=tag)
    dist.barrier()
    for tag, bad_rank, change in cases:
        if rank == bad_rank:
            path = outer_state_file(os.path.join(folder, tag, f"replica_{rank // S}"), rank % S)
            saved = torch.load(path, weights_only=True)
            change(saved["outer"][PERIOD])
            torch.save(saved, path)
    dist.barrier()
    out = {}
    for tag, _, _ in cases:
        # A fresh engine per case: a load that failed on another rank leaves this rank's state loaded.
        resumed, state = _build(1, "fp32", _section(NESTEROV, warmup=4))
        out["masters"] = [tuple(t.shape) for t in state.tensors_to_average()]
        try:
            resumed.load_checkpoint(folder, tag=tag)
            out[tag] = "no error"
        except Exception as err:  # noqa: BLE001
            out[tag] = f"{type(err).__name__}: {err}"
        out[f"{tag} unchanged"] = state.step == 0 and not state.averager.has_anchors
    return out


def _bad_config_case(rank):
    """Bad outer configs, the same on every rank or on one rank only: an error on every rank, never a hang."""
    import torch

    import hieravg_optim.deepspeed as hds

    bad = {
        "unknown_period": ({"period_group_size": {"2": 4}, "ranks_per_replica": S, "outer_optimizer": {"3": SGD1}}),
        "bad_params": {"period_group_size": {"2": 4}, "ranks_per_replica": S,
                       "outer_optimizer": {"2": {"type": "SGD", "params": {"lr": -1}}}},
        "device_not_accelerator": {"period_group_size": {"2": 4}, "ranks_per_replica": S,
                                   "outer_optimizer": {"2": SGD1}, "outer_state_device": "cuda"},
        # Rank 1 alone has a bad type: it raises its ValueError, the others a RuntimeError naming it.
        "bad_on_rank_1": {"period_group_size": {"2": 4}, "ranks_per_replica": S,
                          "outer_optimizer": {"2": {"type": "Nesterov" if rank == 1 else "SGD"}}},
        # Valid everywhere, but another lr on rank 3: the agreement names both.
        "lr_differs": {"period_group_size": {"2": 4}, "ranks_per_replica": S,
                       "outer_optimizer": {"2": {"type": "SGD", "params": {"lr": 0.5 if rank == 3 else 0.7}}}},
    }  # fmt: skip
    out = {}
    for label, section in bad.items():
        model = _model()
        try:
            hds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                           config=_config(1, "fp32", section))  # fmt: skip
            out[label] = "no error"
        except Exception as err:  # noqa: BLE001
            out[label] = f"{type(err).__name__}: {err}"
    return out


def _shipped_config_case(rank):
    """ds_configs/zero2_bf16_diloco.json as shipped: 9 steps, rounds at counts 0 and 8, replicas equal after."""
    import torch

    import hieravg_optim.deepspeed as hds

    model = _model()
    engine = hds.initialize(model=model, model_parameters=model.parameters(),
                            config=str(ROOT / "ds_configs" / "zero2_bf16_diloco.json"))[0]  # fmt: skip
    state = hds.get_averaging(engine)
    for step in range(9):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(32, 8, generator=g)
        engine.backward(engine(x.to(torch.bfloat16)).float().pow(2).mean())
        engine.step()
    module = _full_module(engine)
    period = max(state.metrics())
    return {
        "rounds": state.metrics()[period]["rounds"],
        "pseudo_grad_norm": state.metrics()[period]["pseudo_grad_norm"],
        "identical": all(all(m.equal(o) for m, o in zip(module, other)) for other in _gather(module)),
        "finite": all(bool(t.isfinite().all()) for t in module),
    }


def _buffers_case(rank):
    """BatchNorm buffers are averaged plainly at a level with an outer optimizer: never outer-stepped."""
    import torch

    import hieravg_optim.deepspeed as hds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    engine = hds.initialize(model=model, model_parameters=model.parameters(), config=_config(1, "fp32", _section(NESTEROV)))[0]
    state = hds.get_averaging(engine)
    bn = engine.module[1]
    rounds = []
    for i in range(2 * PERIOD + 1):  # rounds at counts 0, 2, 4
        g = torch.Generator().manual_seed(1000 * rank + i)
        x = torch.randn(4, 8, generator=g) * (1 + rank)  # every rank sees other statistics
        engine.backward((engine(x) - torch.randn(4, 4, generator=g)).pow(2).mean())
        before = [bn.running_mean.clone(), bn.running_var.clone()]
        engine.step()
        if i % PERIOD == 0:  # a round over the level, then the buffers' mean over the replica: the world's mean
            rounds.append((before, [bn.running_mean.clone(), bn.running_var.clone()]))
    errors, differed = [], []
    for before, after in rounds:
        everyone = _gather(before)
        mean = [sum(r[k] for r in everyone) / len(everyone) for k in range(2)]
        errors.append(_max_diff(after, mean))
        differed.append(_max_diff(everyone[0], everyone[-1]) > 1e-3)
    outer = state.averager.state_dict()["outer"][PERIOD]
    return {
        "rounds": len(rounds),
        "buffer_errors": errors,
        "replicas_differed": differed,
        "anchors": len(outer["anchors"]),
        "masters": len(state.master_tensors()),
        "running_var_min": float(bn.running_var.min()),
    }


def _all_scenarios(rank, world_size, folder):
    import torch

    torch.set_num_threads(1)
    scenarios = {"bad_config": _bad_config_case}
    for stage, prec in STAGES_AND_PRECISIONS:
        scenarios[f"sgd1_zero{stage}_{prec}"] = lambda r, s=stage, p=prec: _sgd1_case(r, s, p)
    scenarios["nesterov_zero3_fp32"] = lambda r: _nesterov_case(r, 3, "fp32", 0, "cpu")
    scenarios["nesterov_zero1_bf16_warmup"] = lambda r: _nesterov_case(r, 1, "bf16", 1, None)
    scenarios["single_replica_level_zero2_bf16"] = lambda r: _single_replica_level_case(r, 2, "bf16")
    scenarios["resume_zero2_bf16"] = lambda r: _resume_case(r, 2, "bf16", os.path.join(folder, "z2"))
    scenarios["resume_zero3_fp32"] = lambda r: _resume_case(r, 3, "fp32", os.path.join(folder, "z3"))
    scenarios["resume_edges_zero1_fp32"] = lambda r: _resume_edges_case(r, os.path.join(folder, "edges"))
    scenarios["load_mismatch_zero1_fp32"] = lambda r: _load_mismatch_case(r, os.path.join(folder, "mismatch"))
    scenarios["shipped_config"] = _shipped_config_case
    scenarios["buffers_zero1_fp32"] = _buffers_case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_scenarios(scenarios, rank)


FP16_STAGES = (1, 2)


def _fp16_scenarios(rank, world_size):
    """fp16 engines (DeepSpeed's loss-scaled ZeRO-1/2 optimizer), in their own spawn: the CPU capability override."""
    import torch

    from tests.test_deepspeed_fp16 import _allow_fp16_on_cpu

    torch.set_num_threads(1)
    _allow_fp16_on_cpu()
    scenarios = {f"sgd1_zero{stage}_fp16": lambda r, s=stage: _sgd1_case(r, s, "fp16") for stage in FP16_STAGES}
    scenarios["nesterov_zero2_fp16"] = lambda r: _nesterov_case(r, 2, "fp16", 0, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_scenarios(scenarios, rank)


@pytest.fixture(scope="module")
def fp16_results():
    return run_distributed(_fp16_scenarios, WORLD, timeout=300, pg_timeout=300)


@pytest.fixture(scope="module")
def results():
    # pg_timeout: the first DeepSpeed import may compile its shm comm op (see tests/test_deepspeed.py).
    with tempfile.TemporaryDirectory(prefix="hieravg-outer-ds-") as folder:
        return run_distributed(_all_scenarios, WORLD, folder, timeout=600, pg_timeout=300)


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------
def _assert_equals_plain_averaging(rank: int, r: dict) -> None:
    """Outer SGD with lr 1 and no momentum: every round's result is the plain mean, to 1e-6."""
    assert r["rounds"] == 3, (rank, r)
    assert all(r["replicas_differed"]), f"rank {rank}: replicas equal before a round; the test is vacuous"
    assert max(r["round_errors"]) <= 1e-6, (rank, r["round_errors"])
    assert r["final_diff_to_plain"] <= 1e-6, (rank, r["final_diff_to_plain"])
    assert r["module_is_masters_in_dtype"], rank
    assert r["pseudo_grad_norm"] > 0 and r["outer_bytes"] > 0, (rank, r)


@pytest.mark.parametrize("stage,prec", STAGES_AND_PRECISIONS, ids=[f"zero{s}_{p}" for s, p in STAGES_AND_PRECISIONS])
def test_outer_sgd_lr1_equals_plain_averaging(results, stage, prec):
    for rank, per_rank in enumerate(results):
        _assert_equals_plain_averaging(rank, per_rank[f"sgd1_zero{stage}_{prec}"])


@pytest.mark.parametrize("stage", FP16_STAGES, ids=[f"zero{s}_fp16" for s in FP16_STAGES])
def test_outer_sgd_lr1_equals_plain_averaging_fp16(fp16_results, stage):
    for rank, per_rank in enumerate(fp16_results):
        r = per_rank[f"sgd1_zero{stage}_fp16"]
        # DeepSpeed's fp16 ZeRO optimizer, its fp32 masters averaged, no step skipped (the rounds all ran).
        assert r["kind"] == "zero12" and r["skipped_steps"] == 0, (rank, r)
        _assert_equals_plain_averaging(rank, r)


def test_nesterov_matches_torch_sgd_reference_fp16(fp16_results):
    test_nesterov_matches_torch_sgd_reference(fp16_results, "nesterov_zero2_fp16")
    for rank, per_rank in enumerate(fp16_results):
        r = per_rank["nesterov_zero2_fp16"]
        assert r["kind"] == "zero12" and r["skipped_steps"] == 0, (rank, r)
        assert r["module_dtypes"] == ["torch.float16"], (rank, r)


@pytest.mark.parametrize("case", ["nesterov_zero3_fp32", "nesterov_zero1_bf16_warmup"])
def test_nesterov_matches_torch_sgd_reference(results, case):
    import math

    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        assert r["rounds"] == 3, (rank, r)
        assert max(r["errors"]) <= 1e-6, (rank, r["errors"])
        assert all(r["identical"]), (rank, r["identical"])
        assert r["momentum_nonzero"], rank
    for k in range(3):
        # Each rank reports the norm of its own partition's pseudo-gradient: a replica's add up in squares.
        for replica in range(WORLD // S):
            norms = [results[replica * S + i][case]["norms"][k] for i in range(S)]
            expected = results[replica * S][case]["expected_norms"][k]
            assert math.isclose(math.hypot(*norms), expected, rel_tol=1e-5), (case, k, norms, expected)


def test_outer_state_lives_on_outer_state_device_and_is_counted(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["nesterov_zero3_fp32"]
        assert r["anchor_devices"] == ["cpu"], r
        # fp32 anchors of this rank's partitions plus one SGD momentum buffer each.
        assert r["outer_bytes"] == 2 * r["master_bytes"], (rank, r)


def test_outer_optimizer_on_a_single_replica_level_updates_the_module(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["single_replica_level_zero2_bf16"]
        assert r["rounds"] == [4, 2], (rank, r)
        assert len(r["errors"]) == 4 and max(r["errors"]) <= 1e-6, (rank, r)
        assert all(r["moved"]), f"rank {rank}: a round of the replica level left the masters unchanged; vacuous"
        assert all(r["pushed"]), f"rank {rank}: the module does not hold the masters after a round: {r['pushed']}"
        assert r["replicas_differ"], rank


@pytest.mark.parametrize("case", ["resume_zero2_bf16", "resume_zero3_fp32"])
def test_resume_equals_uninterrupted(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        assert r["own_file"], (rank, r)
        assert r["ranks_of_replica_differ"], f"rank {rank}: both ranks of a replica hold the same anchors; vacuous"
        assert r["anchors_restored"], f"rank {rank}: {case} did not restore this rank's own anchors"
        assert r["diff"] <= 1e-6, (rank, r)
        assert r["count_resumed"] == 6 and r["rounds"] == 1, (rank, r)


def test_resume_without_outer_state_or_with_a_file_missing(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["resume_edges_zero1_fp32"]
        assert r["warned"] and r["anchors_at_loaded_weights"], (rank, r)
        assert r["identical_after_round"], (rank, r)
        if rank == 3:
            assert r["missing_file"].startswith("FileNotFoundError") and "dp_rank_1.pt is missing" in r["missing_file"]
        else:
            assert r["missing_file"].startswith("RuntimeError: Rank 3 failed"), (rank, r["missing_file"])


def test_outer_state_not_fitting_the_masters_raises_at_load_on_every_rank(results):
    import re

    expected = {
        "dtype": (3, r"anchor 0 is bfloat16, but anchors are float32 copies of the averaged tensors"),
        "shape": (1, r"anchor 0 has shape \((\d+),\), but this rank's tensor 0 has shape \((\d+),\)"),
        "count": (0, r"holds 1 anchors, but this rank averages 2 tensors"),
    }
    for rank, per_rank in enumerate(results):
        r = per_rank["load_mismatch_zero1_fp32"]
        assert len(r["masters"]) == 2, (rank, r)  # ZeRO-1: one flat fp32 partition per parameter group
        for tag, (bad_rank, pattern) in expected.items():
            message = r[tag]
            if rank != bad_rank:
                assert message.startswith(f"RuntimeError: Rank {bad_rank} failed"), (rank, tag, message)
            else:
                assert message.startswith("ValueError: Loading the averaging state of the checkpoint "), message
                assert f"{tag}/replica_{rank // S}/" in message, message
                assert f"hierarchical_averaging_outer_dp_rank_{rank % S}.pt" in message, message
                assert "The outer state of period 2 in the averaging state dict" in message, message
                assert "Resume with the model, trainable parameters, ZeRO stage and ranks_per_replica" in message
                # The failing rank's averaging state is unchanged (the others loaded theirs, then raised).
                assert r[f"{tag} unchanged"], (rank, tag, r)
            found = re.search(pattern, message)
            assert found, (rank, tag, message)
            if tag == "shape":
                assert int(found.group(1)) + 1 == int(found.group(2)) == r["masters"][0][0], (rank, message)


def test_bad_configs_raise_on_every_rank(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["bad_config"]
        assert r["unknown_period"].startswith("ValueError") and '"outer_optimizer" has period \'3\'' in r[
            "unknown_period"
        ], r
        assert r["bad_params"].startswith("ValueError") and "Invalid learning rate: -1" in r["bad_params"], r
        assert r["device_not_accelerator"].startswith("ValueError") and '"outer_state_device"' in r[
            "device_not_accelerator"
        ], r
        if rank == 1:
            assert r["bad_on_rank_1"].startswith("ValueError") and "'Nesterov'" in r["bad_on_rank_1"], r
        else:
            assert r["bad_on_rank_1"].startswith("RuntimeError: Rank 1 failed"), r
            assert "'Nesterov'" in r["bad_on_rank_1"], r
        assert r["lr_differs"].startswith("RuntimeError: Ranks disagree"), r
        assert "'lr': 0.5" in r["lr_differs"] and "'lr': 0.7" in r["lr_differs"], r


def test_shipped_diloco_config_trains(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["shipped_config"]
        assert r["rounds"] == 2 and r["identical"] and r["finite"] and r["pseudo_grad_norm"] > 0, (rank, r)


# ------------------------------------------------------------------------------------------------
# No process group needed
# ------------------------------------------------------------------------------------------------
_PGS = {"period_group_size": {"4": 4, "16": 8}}
BAD_OUTER = [
    ({"outer_optimizer": [1]}, 'key "outer_optimizer" must be a JSON object'),
    ({"outer_optimizer": {"8": SGD1}}, "has period '8', which is not a period"),
    ({"outer_optimizer": {"x": SGD1}}, "period 'x': the key must be a period"),
    ({"outer_optimizer": {"0": SGD1}}, "period '0': the key must be a period"),
    ({"outer_optimizer": {"16": SGD1, 16: SGD1}}, "period 16 is given twice ('16' and 16)"),
    ({"outer_optimizer": {"16": "SGD"}}, "period '16' must be a JSON object"),
    ({"outer_optimizer": {"16": {"params": {"lr": 0.7}}}}, '"type" is required'),
    ({"outer_optimizer": {"16": {"type": "SGD", "lr": 0.7}}}, "unknown key 'lr'"),
    ({"outer_optimizer": {"16": {"type": "Lookahead"}}}, "must name an optimizer class of torch.optim"),
    ({"outer_optimizer": {"16": {"type": "Optimizer"}}}, "got 'Optimizer'"),
    ({"outer_optimizer": {"16": {"type": "lr_scheduler"}}}, "got 'lr_scheduler'"),
    ({"outer_optimizer": {"16": {"type": 3}}}, "got 3"),
    ({"outer_optimizer": {"16": {"type": "SGD", "params": [0.7]}}}, '"params" must be a JSON object'),
    ({"outer_optimizer": {"16": {"type": "SGD", "params": {"lr": -1}}}}, "Invalid learning rate: -1"),
    ({"outer_optimizer": {"16": {"type": "SGD", "params": {"nesterov": True}}}}, "Nesterov momentum requires"),
    ({"outer_optimizer": {"16": {"type": "SGD", "params": {"torch_adam": True}}}}, "unexpected keyword argument"),
    ({"outer_optimizer": {"16": {"type": "LBFGS"}}}, "torch.optim.LBFGS cannot be an outer optimizer"),
    ({"outer_optimizer": {"16": {"type": "SparseAdam"}}}, "torch.optim.SparseAdam cannot be an outer optimizer"),
    ({"outer_state_device": "gpu"}, 'key "outer_state_device" must be a torch device name'),
    ({"outer_state_device": 0}, 'key "outer_state_device" must be a torch device name'),
]


@pytest.mark.parametrize("extra,fragment", BAD_OUTER, ids=[str(i) for i in range(len(BAD_OUTER))])
def test_bad_outer_keys_raise_value_error_naming_the_key(extra, fragment):
    from hieravg_optim.deepspeed import parse_section

    with pytest.raises(ValueError) as info:
        parse_section({**_PGS, **extra})
    message = str(info.value)
    assert fragment in message, message
    assert 'DeepSpeed config section "hierarchical_averaging"' in message and '"outer_' in message, message


@pytest.mark.parametrize("name,cls", [("SGD", "SGD"), ("sgd", "SGD"), ("AdamW", "AdamW"), ("adamw", "AdamW"),
                                      ("ADAM", "Adam"), ("NAdam", "NAdam")])  # fmt: skip
def test_type_names_a_torch_optim_class_case_insensitively(name, cls):
    import torch

    from hieravg_optim.deepspeed import parse_section

    settings = parse_section({**_PGS, "outer_optimizer": {"16": {"type": name, "params": {"lr": 0.5}}}})
    assert settings.outer_optimizer == {16: {"type": cls, "params": {"lr": 0.5}}}
    optimizer = settings.outer_optimizers()[16]([torch.zeros(3)])
    assert type(optimizer) is getattr(torch.optim, cls) and optimizer.param_groups[0]["lr"] == 0.5


def test_factory_builds_the_configured_sgd_and_steps_like_it():
    import torch

    from hieravg_optim.deepspeed import parse_section

    settings = parse_section({**_PGS, "outer_optimizer": {"4": NESTEROV}, "outer_state_device": "cpu"})
    assert settings.outer_state_device == "cpu"
    ours, theirs = torch.ones(5), torch.ones(5)
    opt = settings.outer_optimizers()[4]([ours])
    ref = torch.optim.SGD([theirs], lr=0.7, momentum=0.9, nesterov=True)
    for g in (torch.arange(5.0), -torch.arange(5.0) / 3):
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.equal(ours, theirs)
    assert set(settings.outer_optimizers()) == {4}, "the levels without an entry average"


def test_outer_state_device_without_outer_optimizer_warns():
    from hieravg_optim.deepspeed import parse_section

    with pytest.warns(UserWarning, match='"outer_state_device": \'cpu\' has no effect without "outer_optimizer"'):
        settings = parse_section({**_PGS, "outer_state_device": "cpu"})
    assert settings.outer_optimizers() == {}


def test_buffers_are_averaged_plainly_at_an_outer_level(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["buffers_zero1_fp32"]
        assert r["rounds"] == 3, (rank, r)
        assert any(r["replicas_differed"][1:]), f"rank {rank}: buffers equal before every round; the test is vacuous"
        assert max(r["buffer_errors"]) <= 1e-6, (rank, r["buffer_errors"])
        assert r["anchors"] == r["masters"], (rank, r)  # anchors cover the fp32 masters, not the buffers
        assert r["running_var_min"] > 0, (rank, r)

"""The wrapper averages only the same tensor on every rank of a group, and the one the next step reads.

Real processes, gloo, real DeepSpeed engines and real FSDP2 ``fully_shard`` modules:

* the wrapper handed to ``deepspeed.initialize`` as its client optimizer (ZeRO-1 and ZeRO-2):
  DeepSpeed puts its flat fp32 partitions, a different part of the model on each rank, in the
  wrapper's ``param_groups``; the first averaging round raises on every rank instead of averaging
  them. ``hieravg_optim.deepspeed.initialize`` refuses such an optimizer up front;
* ``param_groups`` rebound behind the wrapper (a group added to the inner optimizer directly, a
  parameter list replaced) raises at the next round; ``load_state_dict`` and the wrapper's own
  ``add_param_group`` do not;
* the core wrapper on an FSDP2 module sharded over ranks of an averaging subgroup: ``TypeError`` at
  construction (and from ``add_param_group``) pointing to ``hieravg_optim.fsdp``; the same module
  sharded within replicas, with ``ranks_per_replica``, and a replicated DTensor, average exactly;
* an inner optimizer with fp32 master weights (the layout of apex's / Transformer Engine's
  ``FusedAdam(master_weights=True)``): ``ValueError`` on every rank at the first round without
  ``tensors_to_average``; with it the masters are averaged and the next step keeps the mean.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_distributed, run_scenarios

pytestmark = pytest.mark.timeout(900)


class MasterWeightAdam(torch.optim.Optimizer):
    """Adam keeping fp32 moments and, with ``master_weights=True``, an fp32 master copy of each parameter.

    The layout of apex's and Transformer Engine's ``FusedAdam(master_weights=True)``: the master lives in
    ``state[p]["master_param"]``; each step updates the master in fp32 and writes it, rounded, into ``p``.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, master_weights: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.master_weights = master_weights

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if self.master_weights:
                        state["master_param"] = p.detach().float().clone()
                state["step"] += 1
                grad = p.grad.float()
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** state["step"])).sqrt_().add_(group["eps"])
                update = state["exp_avg"] / (1 - beta1 ** state["step"]) / denom * group["lr"]
                if self.master_weights:
                    state["master_param"].sub_(update)
                    p.copy_(state["master_param"])
                else:
                    p.copy_(p.float() - update)
        return None


def _error_of(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None


# ------------------------------------------------------------------------------------------------
# DeepSpeed: the wrapper as DeepSpeed's client optimizer (2 ranks)
# ------------------------------------------------------------------------------------------------
def _ds_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }


def _deepspeed_client_wrapper(rank: int, world_size: int) -> dict:
    import deepspeed

    import hieravg_optim.deepspeed as hds
    from hieravg_optim import HierarchicalAveragingOptimizer

    def client_wrapper(stage: int):
        def run(rank: int) -> dict:
            model = _ds_model()
            wrapper = HierarchicalAveragingOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), {2: 2})
            engine, *_ = deepspeed.initialize(model=model, optimizer=wrapper, config=_ds_config(stage))
            flat = [tuple(p.shape) for g in wrapper.param_groups for p in g["params"]]
            g = torch.Generator().manual_seed(rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            engine.backward((engine(x) - y).pow(2).mean())
            error = _error_of(engine.step)
            return {
                "flat": flat,
                "error": error,
                "count": wrapper.averaging_step,
                "rounds": wrapper.metrics()[2]["rounds"],
            }

        return run

    def refused_by_initialize(rank: int):
        model = _ds_model()
        wrapper = HierarchicalAveragingOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), {2: 2})
        config = dict(_ds_config(1), hierarchical_averaging={"period_group_size": {"2": 2}, "ranks_per_replica": 1})
        return _error_of(lambda: hds.initialize(model=model, optimizer=wrapper, config=config))

    return run_scenarios(
        {"zero1": client_wrapper(1), "zero2": client_wrapper(2), "initialize": refused_by_initialize}, rank
    )


def test_deepspeed_client_optimizer_wrapper_raises_on_every_rank():
    pytest.importorskip("deepspeed")
    results = run_distributed(_deepspeed_client_wrapper, 2, timeout=400, pg_timeout=120)
    for rank, out in enumerate(results):
        for stage in ("zero1", "zero2"):
            case = out[stage]
            # DeepSpeed did put one flat 1-D partition per group there (so the test exercises that layout).
            assert all(len(shape) == 1 for shape in case["flat"]), case["flat"]
            assert case["error"] is not None, f"rank {rank} {stage}: trained on without an error"
            kind, message = case["error"]
            assert kind == "RuntimeError", case["error"]
            assert "flat fp32 partition of a DeepSpeed" in message, message
            assert "hieravg_optim.deepspeed.initialize" in message and '"hierarchical_averaging"' in message, message
            # Raised before averaging: no round ran, and the count did not advance.
            assert (case["count"], case["rounds"]) == (0, 0), case
        kind, message = out["initialize"]
        assert kind == "TypeError", out["initialize"]
        assert "Pass the inner optimizer" in message and "hierarchical_averaging" in message, message


# ------------------------------------------------------------------------------------------------
# param_groups rebound behind the wrapper (2 ranks)
# ------------------------------------------------------------------------------------------------
def _rebinding(rank: int, world_size: int) -> dict:
    from hieravg_optim import HierarchicalAveragingOptimizer

    def fresh():
        p = nn.Parameter(torch.full((3,), float(rank)))
        inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        return p, inner, HierarchicalAveragingOptimizer(inner, {2: 2})  # averages at counts 0, 2, ...

    def step(wrapper, params):
        for p in params:
            p.grad = torch.zeros_like(p)
        wrapper.step()

    def load_state_dict_keeps(rank):
        p, _, wrapper = fresh()
        step(wrapper, [p])
        wrapper.load_state_dict(wrapper.state_dict())
        p.data.fill_(float(rank))
        step(wrapper, [p])
        step(wrapper, [p])  # count 2
        return p.tolist()

    def own_add_param_group(rank):
        p, _, wrapper = fresh()
        q = nn.Parameter(torch.full((2,), 10.0 * rank))
        wrapper.add_param_group({"params": [q], "lr": 0.0})
        step(wrapper, [p, q])
        return q.tolist()

    def inner_add_param_group(rank):
        p, inner, wrapper = fresh()
        q = nn.Parameter(torch.full((2, 2), 10.0 * rank))
        inner.add_param_group({"params": [q]})
        error = _error_of(lambda: step(wrapper, [p, q]))
        return error, p.tolist(), wrapper.averaging_step

    def replaced_by_flat(rank):
        p, inner, wrapper = fresh()
        inner.param_groups[0]["params"] = [torch.zeros(3 + rank)]  # e.g. a ZeRO partition
        return _error_of(lambda: wrapper.step())

    return run_scenarios(
        {
            "load_state_dict": load_state_dict_keeps,
            "own_add_param_group": own_add_param_group,
            "inner_add_param_group": inner_add_param_group,
            "replaced_by_flat": replaced_by_flat,
        },
        rank,
    )


def test_param_groups_rebound_behind_the_wrapper_raise_at_the_round():
    results = run_distributed(_rebinding, 2, timeout=240)
    for rank, out in enumerate(results):
        assert out["load_state_dict"] == [0.5] * 3, out["load_state_dict"]
        assert out["own_add_param_group"] == [5.0] * 2, out["own_add_param_group"]
        error, p, count = out["inner_add_param_group"]
        assert error is not None and error[0] == "RuntimeError", error
        assert "param_groups[1]['params'][0] (shape (2, 2)" in error[1] and "add_param_group" in error[1], error
        assert "DeepSpeed" not in error[1], error  # a 2-D tensor is not a flat partition
        assert p == [float(rank)] * 3 and count == 0, (p, count)  # nothing averaged
        kind, message = out["replaced_by_flat"]
        assert kind == "RuntimeError" and "flat fp32 partition of a DeepSpeed" in message, message


# ------------------------------------------------------------------------------------------------
# FSDP2 without the adapter (4 ranks)
# ------------------------------------------------------------------------------------------------
def _fsdp2_core(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from hieravg_optim import HierarchicalAveragingOptimizer

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))  # every dim divides by 4: even shards

    world = init_device_mesh("cpu", (world_size,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def sharded_over_world(rank):
        m = model()
        fully_shard(m, mesh=world)
        return {
            str(levels): _error_of(lambda: HierarchicalAveragingOptimizer(torch.optim.AdamW(m.parameters()), levels))
            for levels in ({2: 4}, {2: 2, 4: 4})
        }

    def sharded_within_replicas(rank):
        m = model()
        fully_shard(m, mesh=grid["shard"])
        refused = _error_of(lambda: HierarchicalAveragingOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), {2: 4}))
        wrapper = HierarchicalAveragingOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), {2: 4}, ranks_per_replica=2)
        for p in m.parameters():
            p.to_local().detach().fill_(float(rank))
        wrapper.step()
        means = [p.to_local().tolist() for p in m.parameters()]
        other = model()
        fully_shard(other, mesh=world)
        added = _error_of(lambda: wrapper.add_param_group({"params": list(other.parameters())}))
        return {"refused": refused, "means": means, "added": added, "groups": len(wrapper.param_groups)}

    def replicated(rank):
        p = nn.Parameter(distribute_tensor(torch.zeros(3), world, [Replicate()]))
        p.to_local().detach().fill_(float(rank))
        HierarchicalAveragingOptimizer(torch.optim.SGD([p], lr=0.0), {2: 4}).step()
        return p.to_local().tolist()

    return run_scenarios(
        {"world": sharded_over_world, "replicas": sharded_within_replicas, "replicated": replicated}, rank
    )


def test_core_wrapper_refuses_dtensors_sharded_over_its_averaging_group():
    results = run_distributed(_fsdp2_core, 4, timeout=300)
    for rank, out in enumerate(results):
        for levels, error in out["world"].items():
            assert error is not None, f"rank {rank}, {levels}: constructed over a module sharded across its group"
            kind, message = error
            assert kind == "TypeError", error
            assert "param_groups[0]['params'][0] (global shape (8, 8), local shape (2, 8))" in message, message
            assert "mesh dim(s) 0" in message and "Shard(dim=0)" in message, message
            assert "hieravg_optim.fsdp" in message and "FSDPHierarchicalAveragingOptimizer" in message, message
        kind, message = out["replicas"]["refused"]
        assert kind == "TypeError" and "mesh dim(s) 0 ('shard')" in message, message
        # {0, 2} hold shard 0, {1, 3} shard 1: exact means 1.0 and 2.0.
        expected = 1.0 if rank % 2 == 0 else 2.0
        for t in out["replicas"]["means"]:
            assert torch.equal(torch.tensor(t), torch.full_like(torch.tensor(t), expected)), (rank, t)
        kind, message = out["replicas"]["added"]
        assert kind == "TypeError" and "hieravg_optim.fsdp" in message, message
        assert out["replicas"]["groups"] == 1
        assert out["replicated"] == [1.5] * 3, out["replicated"]


# ------------------------------------------------------------------------------------------------
# fp32 master weights in the inner optimizer (2 ranks)
# ------------------------------------------------------------------------------------------------
def _master_weights(rank: int, world_size: int) -> dict:
    from hieravg_optim import HierarchicalAveragingOptimizer

    def param():
        return nn.Parameter(torch.full((4,), 1.0 + 2 * rank, dtype=torch.bfloat16))  # 1 and 3

    def step(wrapper, p):
        p.grad = torch.full_like(p, 0.5)
        wrapper.step()

    def without_keyword(rank):
        p = param()
        wrapper = HierarchicalAveragingOptimizer(MasterWeightAdam([p], lr=0.0), {2: 2})
        error = _error_of(lambda: step(wrapper, p))
        return error, p.tolist(), wrapper.averaging_step

    def with_keyword(rank):
        p = param()
        inner = MasterWeightAdam([p], lr=0.0)
        wrapper = HierarchicalAveragingOptimizer(
            inner, {2: 2}, tensors_to_average=lambda: [inner.state[p]["master_param"]]
        )
        step(wrapper, p)  # count 0: the masters average
        master = inner.state[p]["master_param"]
        master_after_round = (str(master.dtype), master.tolist())
        step(wrapper, p)  # count 1: the inner step writes the parameters from the masters
        return master_after_round, (str(p.dtype), p.tolist())

    def moments_only(rank):  # fp32 moments, no master: not a master copy, the parameters average
        p = param()
        wrapper = HierarchicalAveragingOptimizer(MasterWeightAdam([p], lr=0.0, master_weights=False), {2: 2})
        step(wrapper, p)
        step(wrapper, p)
        return p.tolist()

    def torch_adamw_scalar(rank):  # a bf16 scalar at 1.0 equals AdamW's float32 "step" after one step
        p, scale = param(), nn.Parameter(torch.tensor(1.0, dtype=torch.bfloat16))
        wrapper = HierarchicalAveragingOptimizer(torch.optim.AdamW([p, scale], lr=0.0), {2: 2})
        scale.grad = torch.ones_like(scale)
        step(wrapper, p)
        return p.tolist(), scale.item()

    def on_one_rank_only(rank):
        p = param()
        wrapper = HierarchicalAveragingOptimizer(MasterWeightAdam([p], lr=0.0, master_weights=rank == 0), {2: 2})
        return _error_of(lambda: step(wrapper, p))

    return run_scenarios(
        {
            "without_keyword": without_keyword,
            "with_keyword": with_keyword,
            "moments_only": moments_only,
            "torch_adamw_scalar": torch_adamw_scalar,
            "on_one_rank_only": on_one_rank_only,
        },
        rank,
    )


def test_master_weights_are_named_or_refused():
    results = run_distributed(_master_weights, 2, timeout=240)
    two = [2.0] * 4
    for rank, out in enumerate(results):
        error, p, count = out["without_keyword"]
        assert error is not None, f"rank {rank}: averaged the bf16 parameters the next step overwrites"
        kind, message = error
        assert kind == "ValueError", error
        assert "'master_param'" in message and "param_groups[0]['params'][0] (shape (4,)" in message, message
        assert "tensors_to_average" in message, message
        assert p == [1.0 + 2 * rank] * 4 and count == 0, (p, count)
        master, p = out["with_keyword"]
        assert master == ("torch.float32", two), master
        assert p == ("torch.bfloat16", two), p
        assert out["moments_only"] == two, out["moments_only"]
        assert out["torch_adamw_scalar"] == (two, 1.0), out["torch_adamw_scalar"]
    assert results[0]["on_one_rank_only"][0] == "ValueError", results[0]["on_one_rank_only"]
    kind, message = results[1]["on_one_rank_only"]
    assert kind == "RuntimeError" and "Rank 0 failed" in message and "'master_param'" in message, message

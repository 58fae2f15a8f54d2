"""Parameters added after ``initialize`` (progressive unfreezing) with the DeepSpeed adapter, on 2 real gloo ranks
(2 replicas of 1 rank, real DeepSpeed engines).

* ZeRO-0 (fp32): the client optimizer is DeepSpeed's optimizer; a backbone frozen at ``initialize``, unfrozen and
  added with ``engine.optimizer.add_param_group``, is averaged from the next round on (the adapter reads the
  optimizer's ``param_groups`` at each round): every parameter set to the rank averages to 0.5.
* ZeRO-1 and 3: DeepSpeed's ZeRO optimizers have no ``add_param_group`` (an ``AttributeError`` from DeepSpeed);
  nothing to follow.
"""

from __future__ import annotations

import pytest

from tests.harness import default_timeout, run_distributed

deepspeed = pytest.importorskip("deepspeed")

WORLD = 2
pytestmark = pytest.mark.timeout(default_timeout(300))


def _case(rank: int, stage: int) -> dict:
    import torch

    import hieravg_optim.deepspeed as hds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))  # backbone, head
    for p in model[0].parameters():
        p.requires_grad_(False)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "hierarchical_averaging": {"period_group_size": {"1": WORLD}, "ranks_per_replica": 1},
    }
    inner = torch.optim.SGD(model[1].parameters(), lr=0.0)  # lr 0: the step changes nothing, the round averages
    engine, *_ = hds.initialize(model=model, optimizer=inner, config=config)
    for p in model[0].parameters():
        p.requires_grad_(True)
    try:
        engine.optimizer.add_param_group({"params": list(model[0].parameters()), "lr": 0.0})
    except AttributeError as exc:
        return {"error": str(exc)}
    with torch.no_grad():
        for p in engine.module.parameters():
            p.fill_(float(rank))
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()  # count 0: averages
    return {"values": [sorted(set(p.detach().flatten().tolist())) for p in engine.module.parameters()]}


def _run(rank: int, world_size: int) -> dict:
    return {stage: _case(rank, stage) for stage in (0, 1, 3)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run, WORLD, timeout=240)


def test_zero0_averages_a_group_added_later(results):
    for r in results:
        assert r[0] == {"values": [[0.5]] * 4}, r[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_optimizers_have_no_add_param_group(results, stage):
    for r in results:
        assert "has no attribute 'add_param_group'" in r[stage]["error"], r[stage]

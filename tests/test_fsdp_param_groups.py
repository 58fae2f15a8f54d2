"""Parameters added after construction (progressive unfreezing), on 4 real gloo ranks (2 replicas x 2 shards).

A backbone in its own FSDP unit, left out of the optimizer at construction, added later with
``add_param_group``: its local shards are averaged from then on, with FSDP1 (``use_orig_params`` False and True)
and FSDP2. A parameter FSDP does not manage is refused by ``add_param_group``, on every rank, the group not
added. With an outer optimizer, the next round names the changed tensors and the fix, on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import default_timeout, run_distributed

WORLD = 4
LEVELS = {1: 4}  # every step, both replicas: shards set to the rank average to 1 (ranks 0, 2) and 2 (ranks 1, 3)
CONFIGS = ["fsdp1", "fsdp1_orig", "fsdp2"]
pytestmark = pytest.mark.timeout(default_timeout(300))


def _model(config: str, mesh) -> nn.Module:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from hieravg_optim.fsdp import shard_replica

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))  # backbone, head: one FSDP unit each
    if config == "fsdp2":
        return shard_replica(model, mesh, fsdp_version=2, submodules=list(model))
    return shard_replica(
        model,
        mesh,
        fsdp_version=1,
        use_orig_params=config == "fsdp1_orig",
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )


def _build(config: str, mesh, **settings):
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer

    model = _model(config, mesh)
    inner = torch.optim.SGD(model[1].parameters(), lr=0.0)  # the head only; lr 0: the step changes nothing
    return model, FSDPHierarchicalAveragingOptimizer(inner, model, mesh, LEVELS, **settings)


def _set_to_rank(opt) -> None:
    with torch.no_grad():
        for t in opt._module_shards():  # every local shard of the module, backbone included
            t.fill_(float(dist.get_rank()))


def _values(opt) -> list[list[float]]:
    return [sorted(set(t.flatten().tolist())) for t in opt._module_shards()]


def _error_of(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned to the parent
        return type(exc).__name__, str(exc)
    return None


def _run(rank: int, world_size: int) -> dict:
    from hieravg_optim import nesterov_outer
    from hieravg_optim.fsdp import init_replicate_shard_mesh

    assert world_size == WORLD
    mesh = init_replicate_shard_mesh(2, "cpu")
    out = {}
    for config in CONFIGS:
        model, opt = _build(config, mesh)
        opt.add_param_group({"params": model[0].parameters(), "lr": 0.0})  # an iterator, as usual
        _set_to_rank(opt)
        opt.step()  # count 0: averages the head and the backbone
        groups = len(opt.param_groups)
        stray = _error_of(lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]}))
        out[config] = {"values": _values(opt), "groups": groups, "after_stray": len(opt.param_groups), "stray": stray}

    model, opt = _build("fsdp1", mesh, outer_optimizers={1: nesterov_outer(lr=0.7, momentum=0.9)})
    opt.add_param_group({"params": model[0].parameters()})
    out["outer"] = _error_of(opt.step)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run, WORLD, timeout=240)


@pytest.mark.parametrize("config", CONFIGS)
def test_added_backbone_is_averaged(results, config):
    for rank, r in enumerate(results):
        mean = [rank % 2 + 1.0]  # the mean of the same-shard ranks (rank % 2 and rank % 2 + 2)
        values = r[config]["values"]  # local shards of backbone and head; FSDP2's bias shards may be empty
        assert all(v in ([], mean) for v in values) and values[0] == mean, (rank, r[config])
        assert r[config]["groups"] == 2


@pytest.mark.parametrize("config", CONFIGS)
def test_parameter_fsdp_does_not_manage_is_refused(results, config):
    for r in results:
        kind, message = r[config]["stray"]
        assert kind == "ValueError" and "shape (2,)" in message, r[config]["stray"]
        assert "not managed by FSDP" in message or "not an FSDP2 DTensor" in message, message
        assert r[config]["after_stray"] == 2  # not added


def test_outer_optimizer_names_the_added_tensors(results):
    for r in results:
        kind, message = r["outer"]
        assert kind == "RuntimeError", message
        assert "differ from the level's anchors: 2 tensors to average, but 1 anchors" in message, message
        assert "take the anchors again" in message

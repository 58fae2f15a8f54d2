"""hieravg_optim.fsdp at its edges, on real FSDP2 modules and gloo groups (2 ranks, 2 replicas of 1 shard).

* The mesh's device type follows the process group's backend: with CUDA reported as
  available (``torch.cuda.is_available`` / ``device_count`` patched, standing in for a
  1-GPU machine), a gloo run builds a CPU mesh, shards on the CPU and averages exactly.
* FSDP2 with the root module holding the parameters and the optimizer built after a
  forward: a ``TypeError`` naming the unsharded copy and the fix, on every rank; after
  ``module.reshard()`` the optimizer is built over the sharded parameters and averages exactly.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_distributed, run_scenarios

pytestmark = pytest.mark.timeout(300)

WORLD = 2


def _root_only(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 2)  # the root holds every parameter: no submodule units


def _average_rank_values(model: nn.Module, opt) -> list[list[float]]:
    """Set every local shard to the rank, step at count 0 (averages), return the local shards."""
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(float(dist.get_rank()))
    opt.step()  # no gradients: the inner step changes nothing, the round averages
    return [p.to_local().unique().tolist() for p in model.parameters()]


def _device_case(rank: int) -> dict:
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh, shard_replica

    with mock.patch("torch.cuda.is_available", return_value=True), mock.patch(
        "torch.cuda.device_count", return_value=1
    ):
        mesh = init_replicate_shard_mesh(shards_per_replica=1)
        model = shard_replica(_root_only(), mesh, fsdp_version=2)
        opt = FSDPHierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, mesh, {1: WORLD})
        shards = _average_rank_values(model, opt)
    return {"device_type": mesh.device_type, "param_devices": sorted({p.device.type for p in model.parameters()}),
            "shards": shards}  # fmt: skip


def _optimizer_after_forward_case(rank: int) -> dict:
    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh, shard_replica

    mesh = init_replicate_shard_mesh(shards_per_replica=1, device_type="cpu")
    model = shard_replica(_root_only(), mesh, fsdp_version=2)
    model(torch.randn(3, 4))  # the root does not reshard after forward
    out: dict = {"plain_after_forward": sorted({type(p).__name__ for p in model.parameters()})}
    try:
        FSDPHierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, mesh, {1: WORLD})
        out["error"] = None
    except TypeError as exc:
        out["error"] = str(exc)
    model.reshard()
    opt = FSDPHierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, mesh, {1: WORLD})
    out["shards_after_reshard"] = _average_rank_values(model, opt)
    return out


def _scenarios(rank: int, world_size: int) -> dict:
    return run_scenarios({"device": _device_case, "optimizer_after_forward": _optimizer_after_forward_case}, rank)


@pytest.fixture(scope="module")
def results():
    return run_distributed(_scenarios, WORLD, timeout=150)


def test_gloo_mesh_stays_on_cpu_with_cuda_available(results):
    for rank, r in enumerate(results):
        d = r["device"]
        assert d["device_type"] == "cpu" and d["param_devices"] == ["cpu"], (rank, d)
        assert d["shards"] == [[0.5], [0.5]], (rank, d)  # (0 + 1) / 2, weight and bias


def test_optimizer_built_after_forward_names_the_unsharded_copy(results):
    for rank, r in enumerate(results):
        o = r["optimizer_after_forward"]
        assert o["plain_after_forward"] == ["Parameter"], (rank, o)  # the input: no DTensor left
        assert o["error"] is not None and "unsharded copy of the FSDP2 parameter 'weight'" in o["error"], (rank, o)
        assert "reshard()" in o["error"] and "149205" in o["error"], o["error"]
        assert o["shards_after_reshard"] == [[0.5], [0.5]], (rank, o)


def test_backend_device_type_needs_an_initialized_group():
    from hieravg_optim.fsdp.mesh import backend_device_type

    with pytest.raises(RuntimeError, match="not initialized"):
        backend_device_type()

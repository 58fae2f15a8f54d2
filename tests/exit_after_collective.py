"""Launched by tests/test_exit.py under torchrun: one collective, then a normal interpreter exit,
with gloo's worker threads starved so that they drop the collective's tensors only at exit.

Every thread of this process is pinned to one CPU, and every thread but the main one runs at
``SCHED_IDLE``, once the setup (process groups, optimizer) is done. A worker thread then runs only
while the main thread waits: it completes the collective during ``wait()``, but drops its
reference to the tensors only when the main thread next blocks, which, with nothing else left
to wait for, is often inside interpreter finalization. Without hieravg_optim/_handover.py the
process then aborts (``terminate called without an active exception``): with torch alone every
time here, after this package's collectives often; unstarved, about 1 run in 8 of the README's
FSDP quickstart on a loaded 2-core machine.

Usage: ``exit_after_collective.py CASE [CHECKPOINT_FOLDER]`` with CASE one of :data:`CASES`.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn


def starve_other_threads() -> None:
    """Pin every thread to one CPU; all but the calling thread run only when it waits."""
    cpu = min(os.sched_getaffinity(0))
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        os.sched_setaffinity(tid, {cpu})
        if tid != me:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def optimizer(numel: int):
    from hieravg_optim import HierarchicalAveragingOptimizer

    param = nn.Parameter(torch.full((numel,), float(dist.get_rank())))
    return HierarchicalAveragingOptimizer(torch.optim.SGD([param], lr=0.0), {1: dist.get_world_size()})


def plain_torch_all_reduce() -> None:
    """The control: torch alone (hieravg_optim not imported), a temporary tensor all-reduced just before the exit."""
    starve_other_threads()
    dist.all_reduce(torch.ones(3))


def plain_torch_all_reduce_after_import() -> None:
    """The same, with hieravg_optim imported: its exit hook waits for gloo's worker threads, whoever ran the
    collective."""
    import hieravg_optim  # noqa: F401

    plain_torch_all_reduce()


def fsdp_load_checkpoint() -> None:
    """``hieravg_optim.fsdp.load_checkpoint``, whose last collective is the cross-rank agreement
    that every rank loaded (the README's FSDP quickstart ends so)."""
    from hieravg_optim.fsdp import (
        FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh, load_checkpoint, save_checkpoint, shard_replica,
    )  # fmt: skip

    mesh = init_replicate_shard_mesh(shards_per_replica=1)
    model = shard_replica(nn.Sequential(nn.Linear(4, 4)), mesh, fsdp_version=2)
    opt = FSDPHierarchicalAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, mesh, {2: 2})
    save_checkpoint(sys.argv[2], model, opt)
    starve_other_threads()
    load_checkpoint(sys.argv[2], model, opt)


def bucketed_step() -> None:
    """A step that averages small tensors through the bucket (asynchronous all-reduces of bucket views)."""
    opt = optimizer(1000)
    starve_other_threads()
    opt.step()  # count 0 averages


def in_place_step() -> None:
    """A step that averages a 4 MiB tensor in place (an all-reduce of a detached alias of the parameter)."""
    opt = optimizer(1 << 20)
    starve_other_threads()
    opt.step()


def non_contiguous() -> None:
    """A 4 MiB non-contiguous tensor: all-reduced through a temporary contiguous copy."""
    from hieravg_optim.averaging import BucketPool, average_tensors_

    t = torch.full((1024, 1024), float(dist.get_rank())).t()
    starve_other_threads()
    world = dist.get_world_size()
    average_tensors_([t], dist.group.WORLD, world, bucket_cap_bytes=25 << 20, pool=BucketPool())
    assert torch.equal(t, torch.full_like(t, (world - 1) / 2))


def agreement_error() -> None:
    """The ranks disagree on the parameters: check_agreement's all_gather_object, a RuntimeError caught here."""
    opt = optimizer(3 + dist.get_rank())
    starve_other_threads()
    try:
        opt.step()
    except RuntimeError as exc:
        assert "disagree" in str(exc), exc
    else:
        raise AssertionError("no RuntimeError for parameters of different shapes")


def deepspeed_step() -> None:
    """A ZeRO-1 step that averages: its last collective is DeepSpeed's all-gather of the updated weights
    over the replica, not issued by this package."""
    import hieravg_optim.deepspeed as hds

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "hierarchical_averaging": {"period_group_size": {"1": dist.get_world_size()}, "ranks_per_replica": 2},
    }
    engine, *_ = hds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config)
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    starve_other_threads()
    engine.step()


def peer_exits() -> None:
    """Rank 1 exits before an averaging step, so rank 0's collective fails: the tensors it handed over stay
    referenced by the failed work, and the exit hook must still return as soon as gloo's threads are idle."""
    import time

    from hieravg_optim import _handover

    opt = optimizer(1000)
    if dist.get_rank() == 1:
        os._exit(0)
    try:
        opt.step()
    except RuntimeError as exc:  # gloo: "Connection closed by peer" (DistBackendError is a RuntimeError)
        print(f"rank 0: the step failed as expected: {type(exc).__name__}", flush=True)
    else:
        raise AssertionError("the step succeeded without rank 1")
    start = time.perf_counter()
    _handover._wait_for_gloo_workers()
    print(f"rank 0: exit hook took {time.perf_counter() - start:.3f} s", flush=True)


CASES = {
    "plain_torch_all_reduce": plain_torch_all_reduce,
    "plain_torch_all_reduce_after_import": plain_torch_all_reduce_after_import,
    "fsdp_load_checkpoint": fsdp_load_checkpoint,
    "bucketed_step": bucketed_step,
    "in_place_step": in_place_step,
    "non_contiguous": non_contiguous,
    "agreement_error": agreement_error,
    "deepspeed_step": deepspeed_step,
    "peer_exits": peer_exits,
}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    world_group = dist.group.WORLD  # held to the end, as a module or an optimizer holds its groups
    CASES[sys.argv[1]]()
    print(f"rank {dist.get_rank()}: {sys.argv[1]} done", flush=True)
    dist.destroy_process_group()

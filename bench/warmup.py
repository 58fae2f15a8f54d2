"""Synchronous warm-up in the adapters: top-level parameter averaging vs a global gradient all-reduce.

Two ways to make post-local SGD's warm-up synchronous across replicas whose gradients are
reduced only within a replica (ZeRO, FSDP):

* ``param_avg``: what the adapters do (``synchronous_warmup``): after every warm-up step,
  average the fp32 master shards at the top level (and, under DeepSpeed, push them into the
  module: an all-gather within the replica under ZeRO-1/2);
* ``grad_allreduce``: all-reduce the local gradient shards across the replicas before the
  inner optimizer steps (a step pre-hook on DeepSpeed's basic optimizer, whose parameters are
  the fp32 partitions, or on the FSDP inner optimizer);
* ``local``: neither (the replicas drift apart), the baseline.

Each contender trains ``--steps`` warm-up steps on 4 gloo ranks (2 replicas x 2 shards) of a
small MLP and reports the median wall-clock seconds per step over the steps after the first.
Not part of the library and not run by the test suite::

    python bench/warmup.py --hidden 1024 --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import spawn  # noqa: E402

WORLD, SHARDS = 4, 2


def _model(hidden: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 8))  # fmt: skip


def _grad_allreduce_hook(top_group, replicas):
    import torch.distributed as dist

    def hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=top_group)
                    p.grad.div_(replicas)

    return hook


def _deepspeed(rank: int, hidden: int, steps: int, mode: str) -> list[float]:
    import torch

    import hieravg_optim.deepspeed as hds

    model = _model(hidden)
    section = {"period_group_size": {"100000": WORLD}, "warmup_steps": steps, "ranks_per_replica": SHARDS,
               "synchronous_warmup": mode == "param_avg"}  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "hierarchical_averaging": section}  # fmt: skip
    engine, _, _, _ = hds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), config=config)
    if mode == "grad_allreduce":
        top = hds.get_averaging(engine).averager.level_groups[-1]
        engine.basic_optimizer.register_step_pre_hook(_grad_allreduce_hook(top.group, WORLD // SHARDS))
    return _time_steps(rank, steps, lambda x, y: (engine.backward(((engine(x) - y) ** 2).mean()), engine.step()))


def _fsdp(rank: int, hidden: int, steps: int, mode: str) -> list[float]:
    import torch

    from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer, init_replicate_shard_mesh, shard_replica

    mesh = init_replicate_shard_mesh(SHARDS, "cpu")
    model = shard_replica(_model(hidden), mesh, fsdp_version=2)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = FSDPHierarchicalAveragingOptimizer(
        inner, model, mesh, {100000: WORLD}, warmup_steps=steps, synchronous_warmup=mode == "param_avg"
    )
    if mode == "grad_allreduce":
        # FSDP2 gradients are DTensors: all-reduce their local shards.
        top = opt.averager.level_groups[-1]

        def hook(optimizer, args, kwargs):
            import torch.distributed as dist

            for p in model.parameters():
                local = p.grad.to_local()
                dist.all_reduce(local, group=top.group)
                local.div_(WORLD // SHARDS)

        inner.register_step_pre_hook(hook)

    def step(x, y):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    return _time_steps(rank, steps, step)


def _time_steps(rank: int, steps: int, step) -> list[float]:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        dist.barrier()
        start = time.perf_counter()
        step(x, y)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _run(rank: int, world_size: int, adapter: str, hidden: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    fn = _deepspeed if adapter == "deepspeed" else _fsdp
    out = {}
    for mode in ("local", "param_avg", "grad_allreduce", "local", "param_avg", "grad_allreduce"):
        out.setdefault(mode, []).extend(fn(rank, hidden, steps, mode)[1:])
    return {mode: statistics.median(t) for mode, t in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--adapters", default="fsdp,deepspeed")
    args = parser.parse_args()
    params = 64 * args.hidden + args.hidden + args.hidden * args.hidden + args.hidden + args.hidden * 8 + 8
    report = {"parameters": params, "world_size": WORLD, "ranks_per_replica": SHARDS}
    for adapter in args.adapters.split(","):
        per_rank = spawn(_run, WORLD, adapter, args.hidden, args.steps)
        report[adapter] = {mode: max(r[mode] for r in per_rank) for mode in per_rank[0]}
        print(json.dumps({adapter: report[adapter]}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

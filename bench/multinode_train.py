"""One training run of ``bench/multinode.sh`` (launched by torchrun on each simulated node).

Real data (scikit-learn digits), a ~19M-parameter MLP (64 -> 3072 -> 3072 -> 3072 -> 10),
plain SGD, ``--steps`` steps, per-rank batch ``--batch``. Modes:

* ``ddp``: ``DistributedDataParallel`` over all ranks: a gradient all-reduce that crosses
  the slow link every step;
* ``hier``: :class:`hieravg_optim.HierarchicalAveragingOptimizer` with ``{1: L, P: W}``
  (L = ranks per node): the parameters are averaged inside a node after every step and
  across nodes every ``P`` steps;
* ``hier_node``: ``hier`` with the cross-node level node-aware (``ranks_per_node=L``);
* ``hier_delay``: ``hier`` with ``delay_steps=--delay-steps`` on the cross-node level (issue 24);
* ``hier_frag``: ``hier`` with ``fragments=--fragments`` on the cross-node level;
* ``hier_delay_frag``: both, ``delay_steps`` one below the fragment spacing ``P // --fragments``;
* ``hier_node_delay``: ``hier_node`` with ``delay_steps=--delay-steps`` on the cross-node level: the node-aware
  round moves half the ring's bytes across the link, so it can fit in the ``tau`` inner steps it overlaps;
* ``hier_node_delay_frag``: ``hier_node`` with ``fragments=--fragments`` and ``delay_steps`` one below the fragment
  spacing on the cross-node level;
* ``hier_node_int8`` / ``hier_node_topk``: ``hier_node`` with the cross-node level compressed
  (issue 25): ``{"type": "int8"}``, or top-k of density ``--topk-density`` with int8 values;
* ``hier_node_int8_delay``: ``hier_node_int8`` with ``delay_steps=--delay-steps`` (the compressed all-gather
  across nodes in the background).

The delay, fragment and compression modes need a ``hieravg_optim`` that has those settings;
without them the run stops with SystemExit naming the setting, before any process group.

Rank 0 writes JSON to ``--out``: seconds per step (each step timed on every rank, the
slowest rank's time taken), the mean over all steps, and the final training loss and
test accuracy of the mean of the replicas (computed on a copy after the last step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from digits_common import batches, load_digits_shard  # noqa: E402

from hieravg_optim import HierarchicalAveragingOptimizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import code_revision, on_level  # noqa: E402

MODES = (
    "ddp", "hier", "hier_node", "hier_delay", "hier_frag", "hier_delay_frag", "hier_node_delay",
    "hier_node_delay_frag", "hier_node_int8", "hier_node_topk", "hier_node_int8_delay",
)


def mode_settings(mode: str, args: argparse.Namespace) -> tuple[bool, dict]:
    """(node-aware cross-node level?, the cross-node level's feature settings) of a hierarchical ``mode``."""
    fragment_delay = max(0, args.period // args.fragments - 1)
    topk = {"type": "topk", "density": args.topk_density, "values": "int8"}
    return {
        "hier": (False, {}),
        "hier_node": (True, {}),
        "hier_delay": (False, {"delay_steps": args.delay_steps}),
        "hier_frag": (False, {"fragments": args.fragments}),
        "hier_delay_frag": (False, {"delay_steps": fragment_delay, "fragments": args.fragments}),
        "hier_node_delay": (True, {"delay_steps": args.delay_steps}),
        "hier_node_delay_frag": (True, {"delay_steps": fragment_delay, "fragments": args.fragments}),
        "hier_node_int8": (True, {"compress": {"type": "int8"}}),
        "hier_node_int8_delay": (True, {"compress": {"type": "int8"}, "delay_steps": args.delay_steps}),
        "hier_node_topk": (True, {"compress": topk}),
    }[mode]


def build(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--period", type=int, default=16, help="hier: steps between cross-node averaging rounds")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--delay-steps", type=int, default=8, help="hier_delay: delay_steps of the cross-node level")
    parser.add_argument("--fragments", type=int, default=4, help="hier_frag, hier_delay_frag: fragments of it")
    parser.add_argument("--topk-density", type=float, default=0.01, help="hier_node_topk: top-k density")
    parser.add_argument("--out", required=True)
    parser.add_argument("--check", action="store_true",
                        help="only check that this hieravg_optim has the mode's settings (no process group)")
    args = parser.parse_args()
    node_aware, settings = (False, {}) if args.mode == "ddp" else mode_settings(args.mode, args)
    top_settings = on_level(settings, args.period)  # SystemExit here if this build lacks a setting
    if args.check:  # the values too, against the levels (local checks of AveragingConfig.create)
        if args.mode != "ddp":
            from hieravg_optim import AveragingConfig

            AveragingConfig.create({1: 2, args.period: 4}, ranks_per_node=2 if node_aware else None, **top_settings)
        return

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    shard = load_digits_shard(rank, world)
    model = build(args.width)
    n_params = sum(p.numel() for p in model.parameters())
    inner = torch.optim.SGD(model.parameters(), lr=args.lr)
    rpn = None
    if args.mode == "ddp":
        net, opt = torch.nn.parallel.DistributedDataParallel(model), inner
        levels = None
    else:
        levels = {1: local, args.period: world}
        # Node-aware: the cross-node level reduces in the node (reduce-scatter), crosses nodes with the
        # shards (all-reduce, or the compressed exchange), all-gathers in the node; else one flat ring.
        rpn = local if node_aware else None
        net, opt = model, HierarchicalAveragingOptimizer(inner, levels, ranks_per_node=rpn, **top_settings)

    step_s = []
    losses = []
    step, epoch = 0, 0
    dist.barrier()
    t_start = time.perf_counter()
    while step < args.steps:
        for x, y in batches(shard.x_train, shard.y_train, args.batch, epoch=epoch, seed=rank):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            step_s.append(time.perf_counter() - t0)
            losses.append(loss.item())
            step += 1
            if step == args.steps:
                break
        epoch += 1
    dist.barrier()
    total = time.perf_counter() - t_start

    slowest = torch.tensor(step_s, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    # The mean of the replicas (identical under DDP), on a copy: loss on the whole training set, test accuracy.
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        sums = torch.tensor(
            [torch.nn.functional.cross_entropy(model(shard.x_train), shard.y_train, reduction="sum").item(),
             len(shard.y_train)], dtype=torch.float64)
        dist.all_reduce(sums)
        acc = (model(shard.x_test).argmax(1) == shard.y_test).float().mean().item()
    local_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(local_losses)
    result = {
        "mode": args.mode,
        "levels": levels,
        "ranks_per_node_setting": rpn,
        "cross_node_settings": settings,
        "hieravg_optim": code_revision(),
        "world_size": world,
        "ranks_per_node": local,
        "params": n_params,
        "model_bytes": n_params * 4,
        "steps": args.steps,
        "batch_per_rank": args.batch,
        "seconds_total": total,
        "seconds_per_step_mean": float(slowest.sum()) / args.steps,
        "seconds_per_step_median": statistics.median(slowest.tolist()),
        "seconds_per_step": slowest.tolist(),
        "train_loss_curve_mean_over_ranks": (local_losses / world).tolist(),
        "final_train_loss_avg_model": float(sums[0] / sums[1]),
        "final_test_accuracy_avg_model": acc,
    }
    if levels is not None:
        result["metrics"] = {str(k): v for k, v in opt.metrics().items()}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, default=str)  # default: metrics values that are not JSON types
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

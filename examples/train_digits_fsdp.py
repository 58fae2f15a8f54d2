"""Hierarchical SGD over FSDP replicas: the digits MLP on a (replicate, shard) device mesh, with torchrun.

The ranks form a mesh of ``R = W / S`` replicas by ``S`` shards. Each replica is the MLP
sharded with FSDP over its ``S`` ranks (FSDP1 ``FullyShardedDataParallel`` or FSDP2
``fully_shard``), which reduce gradients every step; across replicas,
:class:`hieravg_optim.fsdp.FSDPHierarchicalAveragingOptimizer` averages the local shards
of the ranks holding the same shard, every few steps (https://arxiv.org/abs/2010.12998).

Run (gloo on CPU; no download)::

    torchrun --nproc_per_node 4 examples/train_digits_fsdp.py --fsdp-version 2 --metrics-out runs/digits_fsdp2.json
    torchrun --nproc_per_node 4 examples/train_digits_fsdp.py --fsdp-version 1 --bf16

With 4 ranks and ``--shards-per-replica 2`` (the default) there are 2 replicas, and the
default hierarchy is ``8:4``: both replicas average every 8 steps. Rank 0 shows a progress
bar and prints the test accuracy of the final, globally averaged model. The other options
and the ``--metrics-out`` JSON keys are those of ``examples/train_digits.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_common import (  # noqa: E402
    averaging_metrics,
    build_mlp,
    evaluate,
    load_digits_shard,
    replicas_identical,
    report,
    run_metrics,
    steps_per_epoch,
    torchrun_rank_and_world_size,
    train_epochs,
)
from train_digits import make_parser as make_base_parser  # noqa: E402
from train_digits import parse_period_group_size  # noqa: E402

from hieravg_optim import AveragingConfig  # noqa: E402
from hieravg_optim.fsdp import (  # noqa: E402
    FSDPHierarchicalAveragingOptimizer,
    init_replicate_shard_mesh,
    shard_replica,
)


def default_period_group_size(world_size: int, shards: int) -> str:
    """Pairs of replicas every 4 steps and everyone every 16 when there are 4+ replicas, else everyone every 8."""
    replicas = world_size // shards
    if replicas >= 4 and replicas % 2 == 0:
        return f"4:{2 * shards},16:{world_size}"
    return f"8:{world_size}"


def make_parser() -> argparse.ArgumentParser:
    parser = make_base_parser()
    parser.description = (
        "Train an MLP on the digits with FSDP replicas and hierarchical averaging. Launch with: "
        "torchrun --nproc_per_node 4 examples/train_digits_fsdp.py --fsdp-version 2"
    )
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2, help="FSDP1 or FSDP2 (default: 2)")
    parser.add_argument(
        "--shards-per-replica",
        type=int,
        default=2,
        metavar="S",
        help="ranks per replica, over which FSDP shards; must divide the world size (default: 2)",
    )
    parser.add_argument(
        "--use-orig-params", action="store_true", help="FSDP1: use_orig_params=True (default: flat parameters)"
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 shards (FSDP mixed precision)")
    for action in parser._actions:  # the FSDP default hierarchy counts replicas, not ranks
        if action.dest == "period_group_size":
            action.help = (
                "averaging levels: every P steps, blocks of G consecutive ranks (G / S replicas) average; G a multiple "
                "of S, the last G the world size (default: 8:W, or 4:2S,16:W with 4+ replicas)"
            )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    rank, world_size = torchrun_rank_and_world_size(parser, "examples/train_digits_fsdp.py")
    shards = args.shards_per_replica
    if shards <= 0 or world_size % shards != 0:
        parser.error(f"--shards-per-replica {shards} must be a positive divisor of the world size ({world_size}).")
    levels = args.period_group_size or parse_period_group_size(default_period_group_size(world_size, shards))
    try:  # before any process group exists: one clear message from rank 0
        config = AveragingConfig.create(levels, warmup_steps=args.warmup_steps, ranks_per_replica=shards)
        config.check_world_size(world_size)
    except ValueError as e:
        parser.error(f"--period-group-size with {world_size} ranks and --shards-per-replica {shards}: {e}")

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    try:
        metrics = train(args, levels, rank, world_size)
        prefix = f"FSDP{args.fsdp_version}, {metrics['replicas']} replicas x {shards} shards: "
        report(metrics, rank, args.metrics_out, prefix)
    finally:
        dist.destroy_process_group()


def full_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The replica's full fp32 parameters (collective over the replica's shard group)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    if FSDP.fsdp_modules(model):
        with FSDP.summon_full_params(model, writeback=False):
            return [p.detach().clone() for p in model.parameters()]
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def train(args: argparse.Namespace, levels: dict[int, int], rank: int, world_size: int) -> dict:
    start = time.perf_counter()
    shards = args.shards_per_replica
    data = load_digits_shard(rank, world_size, non_iid=args.non_iid, seed=args.seed)
    steps = steps_per_epoch(data, args.batch_size, rank, world_size)
    total_steps = steps * args.epochs

    mesh = init_replicate_shard_mesh(shards, "cpu")
    fsdp_kwargs: dict = {}
    if args.fsdp_version == 1:
        from torch.distributed.fsdp import MixedPrecision

        fsdp_kwargs["use_orig_params"] = args.use_orig_params
        if args.bf16:
            fsdp_kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    elif args.bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model = build_mlp(seed=args.seed)  # the same initial weights on every rank
    linears = [m for m in model if isinstance(m, torch.nn.Linear)] if args.fsdp_version == 2 else []
    model = shard_replica(model, mesh, fsdp_version=args.fsdp_version, submodules=linears, **fsdp_kwargs)
    opt = FSDPHierarchicalAveragingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr), model, mesh, levels, warmup_steps=args.warmup_steps
    )
    loss_curve = train_epochs(
        model, opt, data, epochs=args.epochs, steps=steps, batch_size=args.batch_size, seed=args.seed,
        rank=rank, world_size=world_size, desc=f"digits FSDP{args.fsdp_version}",
    )  # fmt: skip
    averaging = averaging_metrics(opt.averager, total_steps)  # before the final averaging adds a round

    # Final global averaging of the local shards, then check by all-gather that every rank holds the same
    # full parameters (every replica, gathered over its shards).
    opt.average_now(-1)
    identical = replicas_identical(full_parameters(model))
    test_loss, test_accuracy = evaluate(model, data.x_test, data.y_test)

    return {
        "replicas": world_size // shards,
        "shards_per_replica": shards,
        "fsdp_version": args.fsdp_version,
        "use_orig_params": bool(args.use_orig_params) if args.fsdp_version == 1 else None,
        "bf16": args.bf16,
        **averaging,
        **run_metrics(
            args, world_size=world_size, steps=total_steps, loss_curve=loss_curve, test_loss=test_loss,
            test_accuracy=test_accuracy, replicas_identical=identical, seconds=time.perf_counter() - start,
        ),  # fmt: skip
    }


if __name__ == "__main__":
    main()

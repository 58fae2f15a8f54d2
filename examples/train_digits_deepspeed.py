"""Hierarchical SGD on DeepSpeed: the digits MLP, configured by a DeepSpeed JSON file.

The ``"hierarchical_averaging"`` section of the config turns it on; everything else is a
plain DeepSpeed config (ZeRO stage, bf16/fp16, optimizer, scheduler). Replicas are blocks
of ``ranks_per_replica`` consecutive ranks: within one, DeepSpeed reduces gradients every
step and ZeRO partitions; across replicas, :mod:`hieravg_optim.deepspeed` averages the fp32
master partitions on the hierarchical schedule (https://arxiv.org/abs/2010.12998).

Run on CPU (DeepSpeed picks its CPU accelerator and gloo; no download)::

    deepspeed --num_gpus 4 examples/train_digits_deepspeed.py \\
        --deepspeed_config ds_configs/zero2_fp32.json --metrics-out runs/digits_ds.json

or with torchrun::

    torchrun --nproc_per_node 4 examples/train_digits_deepspeed.py --deepspeed_config ds_configs/zero3_bf16.json

With ``--checkpoint-dir DIR --checkpoint-every N`` it saves every N engine steps (DeepSpeed's
per-replica checkpoint, ``engine.save_checkpoint``, plus each rank's position in the data), and
``--resume`` continues from the latest complete checkpoint. The deepspeed launcher does not
restart a job: when a rank dies it stops the others and exits; run the same command again with
``--resume`` (or launch with ``torchrun --max-restarts N ... --resume``).

Rank 0 shows a progress bar and prints the test accuracy of the final, globally averaged
model. ``--metrics-out`` writes the same JSON keys as ``examples/train_digits.py``.
"""

from __future__ import annotations

import argparse
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm

from checkpointing import (
    add_checkpoint_arguments,
    check_checkpoint_arguments,
    kill_drill,
    resume_latest,
    save_checkpoint,
    save_rank_state,
    warn_if_restarts_share_the_store,
)
from digits_common import (
    Progress,
    averaging_metrics,
    batches,
    build_mlp,
    evaluate,
    load_digits_shard,
    replicas_identical,
    report,
    whole_run_metrics,
)

import hieravg_optim.deepspeed as hds


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train an MLP on the digits with DeepSpeed and hierarchical averaging. Launch with: "
        "deepspeed --num_gpus 4 examples/train_digits_deepspeed.py --deepspeed_config ds_configs/zero2_fp32.json"
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over each rank's share (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="data split, init and shuffling (default: 0)")
    parser.add_argument("--non-iid", action="store_true", help="give each rank a block of the data sorted by label")
    parser.add_argument("--metrics-out", metavar="PATH", default=None, help="write the run's metrics as JSON to PATH")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    add_checkpoint_arguments(parser)
    deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    return parser


ENGINE_TAG = "engine"
"""DeepSpeed's checkpoint tag inside each step_<N> folder: <dir>/step_<N>/engine/replica_<k>/."""


def full_parameters(engine) -> list[torch.Tensor]:
    """Every module parameter in full (gathered under ZeRO-3), as fp32 copies on CPU."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().float().cpu().clone() for p in params]
    return [p.detach().float().cpu().clone() for p in params]


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not args.deepspeed_config:
        raise SystemExit("error: --deepspeed_config PATH is required, e.g. ds_configs/zero2_fp32.json")
    check_checkpoint_arguments(parser, args)
    warn_if_restarts_share_the_store()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()

    data = load_digits_shard(rank, world_size, non_iid=args.non_iid, seed=args.seed)
    model = build_mlp(seed=args.seed)  # the same initial weights on every rank
    engine, _, _, _ = hds.initialize(args=args, model=model, model_parameters=model.parameters())
    averaging = hds.get_averaging(engine)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    micro = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()

    # Every rank must take the same number of engine steps.
    smallest = torch.tensor([len(data.y_train)])
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    steps_per_epoch = int(smallest) // (micro * accumulation)
    if steps_per_epoch == 0:
        raise SystemExit(
            f"error: micro batch {micro} x accumulation {accumulation} exceeds a rank's share ({int(smallest)})"
        )
    total_steps = steps_per_epoch * args.epochs
    loss_fn = torch.nn.CrossEntropyLoss()

    # What a checkpoint must have been saved with; DeepSpeed's own checkpoint checks the rest.
    settings = {"epochs": args.epochs, "seed": args.seed, "non_iid": args.non_iid, "micro_batch_size": micro,
                "gradient_accumulation_steps": accumulation}  # fmt: skip
    progress, earlier_metrics, resumed_from = Progress(), None, None
    if args.resume:
        path, state = resume_latest(args.checkpoint_dir, rank, settings)
        if path is not None:
            # The engine's module, optimizer (fp32 masters, moments), LR scheduler and step counts, and the
            # averaging count, from this replica's folder (hieravg_optim.deepspeed keeps one per replica).
            engine.load_checkpoint(path, tag=ENGINE_TAG)
            torch.set_rng_state(state["rng"])
            progress = Progress(**state["progress"])
            earlier_metrics, resumed_from = state["averaging_metrics"], progress.step
            assert engine.global_steps == progress.step, (engine.global_steps, progress.step)
    every = args.checkpoint_every or steps_per_epoch

    def after_step(p: Progress) -> None:
        due = args.checkpoint_dir is not None and (p.step % every == 0 or p.step == total_steps)
        if not due:
            kill_drill(args, p.step, rank, world_size, in_save=False)
            return

        def write(folder: str) -> None:
            engine.save_checkpoint(folder, tag=ENGINE_TAG, save_latest=False)  # collective; folder/engine/replica_<k>/
            save_rank_state(folder, rank, {
                "rng": torch.get_rng_state(),
                "progress": {"step": p.step, "epoch_loss": p.epoch_loss, "loss_curve": list(p.loss_curve)},
                "averaging_metrics": whole_run_metrics(averaging.averager, earlier_metrics) if averaging else None,
                "settings": settings,
            })  # fmt: skip
            kill_drill(args, p.step, rank, world_size, in_save=True)

        save_checkpoint(args.checkpoint_dir, p.step, write)

    bar = tqdm(total=total_steps, initial=progress.step, disable=rank != 0, desc="digits (deepspeed)", unit="step",
               mininterval=0.5)  # fmt: skip
    for epoch in range(progress.step // steps_per_epoch, args.epochs):
        done = (progress.step - epoch * steps_per_epoch) * accumulation  # micro-batches taken before a resume
        epoch_batches = batches(data.x_train, data.y_train, micro, epoch=epoch, seed=args.seed + rank)
        for i, (x, y) in zip(range(steps_per_epoch * accumulation), epoch_batches):
            if i < done:
                continue
            loss = loss_fn(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            progress.epoch_loss += loss.item()
            if (i + 1) % accumulation:
                continue  # not an optimizer step yet
            progress.step += 1
            bar.update(1)
            if i + 1 == steps_per_epoch * accumulation:
                epoch_loss = torch.tensor([progress.epoch_loss], dtype=torch.float64)
                dist.all_reduce(epoch_loss)
                progress.loss_curve.append(epoch_loss.item() / (steps_per_epoch * accumulation * world_size))
                progress.epoch_loss = 0.0
                bar.set_postfix(loss=f"{progress.loss_curve[-1]:.4f}", epoch=epoch + 1)
            after_step(progress)
    bar.close()
    loss_curve = progress.loss_curve

    metrics: dict = {
        "world_size": world_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "non_iid": args.non_iid,
        "steps": total_steps,
        "zero_stage": engine.zero_optimization_stage(),
        "dtype": str(dtype).removeprefix("torch."),
        "micro_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "final_lr": engine.get_lr()[0],
        "loss_curve": loss_curve,
        "final_loss": loss_curve[-1],
        "deepspeed_config": args.deepspeed_config,
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
    }
    if averaging is not None:
        metrics.update(averaging_metrics(averaging.averager, total_steps, earlier_metrics))
        metrics.update({"ranks_per_replica": averaging.config.ranks_per_replica, "averaging_steps": averaging.step})
        averaging.average_now(-1)  # final global averaging: every replica holds the same weights
    else:
        metrics.update({"period_group_size": None, "rounds_per_level": {}, "ranks_per_replica": world_size})

    metrics["replicas_identical"] = replicas_identical(full_parameters(engine))
    engine.eval()
    with torch.no_grad():
        test_loss, test_accuracy = evaluate(lambda x: engine(x.to(dtype)), data.x_test, data.y_test)
    metrics.update({"test_loss": test_loss, "test_accuracy": test_accuracy, "seconds": time.perf_counter() - start,
                    "resumed_from_step": resumed_from})  # fmt: skip
    try:
        report(metrics, rank, args.metrics_out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

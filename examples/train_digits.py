"""Hierarchical SGD on real data: an MLP on scikit-learn's handwritten digits, with torchrun.

Every rank trains its own copy of the model on its own share of the training set
with AdamW (local SGD); :class:`hieravg_optim.HierarchicalAveragingOptimizer`
averages the parameters every few steps, in small groups of ranks often and over
all ranks rarely (hierarchical SGD, https://arxiv.org/abs/2010.12998).

Run (gloo on CPU; no download, the data ships with scikit-learn)::

    torchrun --nproc_per_node 4 examples/train_digits.py --metrics-out runs/digits.json

Restartable (torchrun restarts every rank when one dies; each attempt resumes from the latest
complete checkpoint, and ends as an uninterrupted run would)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node 4 --max-restarts 3 examples/train_digits.py \\
        --checkpoint-dir runs/ckpt --checkpoint-every 20 --resume

With 4 ranks the default hierarchy is ``4:2,16:4``: pairs of ranks average every
4 steps, all 4 ranks every 16 steps. Rank 0 shows a progress bar and prints the
test accuracy of the final, globally averaged model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

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
    build_mlp,
    evaluate,
    load_digits_shard,
    replicas_identical,
    report,
    run_metrics,
    steps_per_epoch,
    torchrun_rank_and_world_size,
    train_epochs,
    whole_run_metrics,
)
from hieravg_optim import AveragingConfig, HierarchicalAveragingOptimizer


def default_period_group_size(world_size: int) -> str:
    """Two levels when the world size allows it: pairs every 4 steps, everyone every 16 steps."""
    if world_size >= 4 and world_size % 2 == 0:
        return f"4:2,16:{world_size}"
    return f"8:{world_size}"


def parse_period_group_size(text: str) -> dict[int, int]:
    """``"4:2,16:4"`` -> ``{4: 2, 16: 4}``; raises ``argparse.ArgumentTypeError`` with the fix."""
    levels: dict[int, int] = {}
    for item in text.split(","):
        period, sep, group_size = item.strip().partition(":")
        if not sep or not period.strip().isdigit() or not group_size.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a list of PERIOD:GROUP_SIZE pairs of positive integers; "
                f"bad item {item.strip()!r}. Example: --period-group-size 4:2,16:4"
            )
        if int(period) in levels:
            raise argparse.ArgumentTypeError(f"{text!r} gives period {int(period)} twice.")
        levels[int(period)] = int(group_size)
    return levels


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


class _RankZeroParser(argparse.ArgumentParser):
    """Under torchrun every rank parses the arguments; only rank 0 prints the usage error.

    The other ranks wait (up to a minute) before they exit: torchrun stops every rank as soon as one
    exits, and a rank 1 that exited first could stop rank 0 (still importing torch on a loaded
    machine) before it printed the message. Rank 0's exit stops them at once.
    """

    def error(self, message: str):  # type: ignore[override]
        if os.environ.get("RANK", "0") == "0":
            super().error(message)
        time.sleep(60)
        sys.exit(2)


def make_parser() -> argparse.ArgumentParser:
    parser = _RankZeroParser(
        description="Train an MLP on the digits with hierarchical parameter averaging. "
        "Launch with: torchrun --nproc_per_node 4 examples/train_digits.py",
    )
    parser.add_argument(
        "--period-group-size",
        type=parse_period_group_size,
        default=None,
        metavar="P:G,...",
        help="averaging levels: every P steps, blocks of G consecutive ranks average; periods increasing, the last "
        "G is the world size (default: 4:2,16:W for an even world size W >= 4, else 8:W)",
    )
    parser.add_argument(
        "--warmup-steps", type=_non_negative_int, default=0, help="steps before averaging starts (default: 0)"
    )
    parser.add_argument("--epochs", type=_positive_int, default=20, help="passes over each rank's share (default: 20)")
    parser.add_argument("--lr", type=_positive_float, default=2e-3, help="AdamW learning rate (default: 2e-3)")
    parser.add_argument("--batch-size", type=_positive_int, default=32, help="per-rank batch size (default: 32)")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="data split, init and shuffling (default: 0)")
    parser.add_argument(
        "--non-iid", action="store_true", help="give each rank a block of the training set sorted by label"
    )
    parser.add_argument("--metrics-out", metavar="PATH", default=None, help="write the run's metrics as JSON to PATH")
    add_checkpoint_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    rank, world_size = torchrun_rank_and_world_size(parser, "examples/train_digits.py")
    check_checkpoint_arguments(parser, args)

    # Check the hierarchy against the world size before any process group exists, so a bad value gives
    # one clear message (from rank 0) instead of a traceback per rank.
    levels = args.period_group_size or parse_period_group_size(default_period_group_size(world_size))
    try:
        with warnings.catch_warnings():  # the wrapper warns (once per rank) about legal but odd settings
            warnings.simplefilter("ignore")
            AveragingConfig.create(levels, warmup_steps=args.warmup_steps).check_world_size(world_size)
    except ValueError as e:
        parser.error(f"--period-group-size {_format_levels(levels)} with {world_size} ranks: {e}")

    warn_if_restarts_share_the_store()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    dist.init_process_group("gloo")
    try:
        report(train(args, levels, rank, world_size), rank, args.metrics_out)
    finally:
        dist.destroy_process_group()


def _format_levels(levels: dict[int, int]) -> str:
    return ",".join(f"{p}:{g}" for p, g in levels.items())


# The settings a checkpoint must have been saved with: a resumed run with other values would not continue it.
RESUME_SETTINGS = ("period_group_size", "warmup_steps", "epochs", "lr", "batch_size", "seed", "non_iid")


def train(args: argparse.Namespace, levels: dict[int, int], rank: int, world_size: int) -> dict:
    start = time.perf_counter()
    data = load_digits_shard(rank, world_size, non_iid=args.non_iid, seed=args.seed)
    steps = steps_per_epoch(data, args.batch_size, rank, world_size)
    total_steps = steps * args.epochs

    model = build_mlp(seed=args.seed)  # the same initial weights on every rank
    opt = HierarchicalAveragingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        period_group_size_dict=levels,
        warmup_steps=args.warmup_steps,
    )
    settings = {k: getattr(args, k) for k in RESUME_SETTINGS} | {"period_group_size": levels}
    progress, earlier_metrics, resumed_from = Progress(), None, None
    if args.resume:
        _, state = resume_latest(args.checkpoint_dir, rank, settings)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])  # the inner AdamW state and the averaging count
            torch.set_rng_state(state["rng"])
            progress = Progress(**state["progress"])
            earlier_metrics, resumed_from = state["averaging_metrics"], progress.step

    every = args.checkpoint_every or steps

    def after_step(p: Progress) -> None:
        due = args.checkpoint_dir is not None and (p.step % every == 0 or p.step == total_steps)
        if not due:
            kill_drill(args, p.step, rank, world_size, in_save=False)
            return

        def write(folder: str) -> None:
            save_rank_state(folder, rank, {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state(),
                "progress": {"step": p.step, "epoch_loss": p.epoch_loss, "loss_curve": list(p.loss_curve)},
                "averaging_metrics": whole_run_metrics(opt.averager, earlier_metrics),
                "settings": settings,
            })  # fmt: skip
            kill_drill(args, p.step, rank, world_size, in_save=True)

        save_checkpoint(args.checkpoint_dir, p.step, write)

    loss_curve = train_epochs(
        model, opt, data, epochs=args.epochs, steps=steps, batch_size=args.batch_size, seed=args.seed,
        rank=rank, world_size=world_size, desc="digits", progress=progress, after_step=after_step,
    )  # fmt: skip
    averaging = averaging_metrics(opt.averager, total_steps, earlier_metrics)  # before the final averaging's round

    # Final global averaging, then check by all-gather that every rank holds the same parameters.
    opt.average_now(-1)
    identical = replicas_identical(opt.tensors_to_average())
    test_loss, test_accuracy = evaluate(model, data.x_test, data.y_test)

    return {
        **averaging,
        **run_metrics(
            args, world_size=world_size, steps=total_steps, loss_curve=loss_curve, test_loss=test_loss,
            test_accuracy=test_accuracy, replicas_identical=identical, seconds=time.perf_counter() - start,
        ),  # fmt: skip
        "averaging_step": opt.averager.step,
        "resumed_from_step": resumed_from,
    }


if __name__ == "__main__":
    main()

"""DiLoCo-style hierarchical training of a character-level language model on the Python standard library, with torchrun.

Every rank trains its own replica of a small byte-level transformer on its own source files of
the standard library (non-IID by file; see ``examples/chars_common.py``) with AdamW, the inner
optimizer. :class:`hieravg_optim.HierarchicalAveragingOptimizer` averages the parameters in groups
of ranks often and over all ranks rarely (hierarchical SGD, https://arxiv.org/abs/2010.12998); with
``--outer top`` the top level treats ``anchor - mean`` as a pseudo-gradient and takes a Nesterov
SGD step on it (DiLoCo, https://arxiv.org/abs/2311.08105), with ``--outer both`` every level does
(HALoS, https://arxiv.org/abs/2506.04531).

Run (gloo on CPU, no download; about 2 minutes for 8 ranks on 2 cores)::

    torchrun --nproc_per_node 8 examples/train_chars_diloco.py --outer top --metrics-out runs/chars.json --plot runs/chars.png

With 8 ranks the default hierarchy is ``4:4,32:8``: groups of 4 ranks every 4 steps, all 8 ranks
every 32 steps. The default 513 steps end on a top-level round (counts 0, 32, ..., 512). After every
top-level round, when the replicas are identical, rank 0 evaluates the model's validation loss
(mean next-byte cross-entropy in nats on held-out files, the windows shared among the ranks).
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings

import torch
import torch.distributed as dist
from tqdm import tqdm

from chars_common import TinyTransformerLM, corpus_fingerprint, lm_loss, load_char_shard, sample_batch, validation_loss
from digits_common import replicas_identical, torchrun_rank_and_world_size, write_metrics
from hieravg_optim import AveragingConfig, HierarchicalAveragingOptimizer, level_at, nesterov_outer, rounds_per_level
from train_digits import (
    _format_levels,
    _non_negative_int,
    _positive_float,
    _positive_int,
    _RankZeroParser,
    parse_period_group_size,
)


def default_period_group_size(world_size: int) -> str:
    """Groups of 4 every 4 steps and everyone every 32 steps when the world size allows it, else one level."""
    if world_size > 4 and world_size % 4 == 0:
        return f"4:4,32:{world_size}"
    if world_size > 2 and world_size % 2 == 0:
        return f"4:2,32:{world_size}"
    return f"32:{world_size}"


def _momentum(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1) (Nesterov needs momentum > 0), got {value}")
    return value


def make_parser() -> argparse.ArgumentParser:
    parser = _RankZeroParser(
        description="Train a byte-level transformer on the Python standard library's sources with hierarchical "
        "averaging and outer Nesterov steps (DiLoCo). Launch with: "
        "torchrun --nproc_per_node 8 examples/train_chars_diloco.py",
    )
    parser.add_argument(
        "--period-group-size",
        type=parse_period_group_size,
        default=None,
        metavar="P:G,...",
        help="averaging levels: every P steps, blocks of G consecutive ranks average; periods increasing, the last "
        "G is the world size (default: 4:4,32:W for W > 4 divisible by 4, 4:2,32:W for other even W > 2, else 32:W)",
    )
    parser.add_argument(
        "--outer",
        choices=("none", "top", "both"),
        default="top",
        help="which levels take an outer Nesterov step on the pseudo-gradient: none (plain averaging), the top "
        "level only (DiLoCo), or every level (default: top)",
    )
    parser.add_argument("--outer-lr", type=_positive_float, default=0.7, help="outer learning rate (default: 0.7)")
    parser.add_argument("--outer-momentum", type=_momentum, default=0.9, help="outer Nesterov momentum (default: 0.9)")
    parser.add_argument("--steps", type=_positive_int, default=513, help="inner optimizer steps (default: 513)")
    parser.add_argument("--lr", type=_positive_float, default=6e-3, help="inner AdamW learning rate (default: 6e-3)")
    parser.add_argument("--batch-size", type=_positive_int, default=16, help="windows per rank and step (default: 16)")
    parser.add_argument("--context", type=_positive_int, default=64, help="bytes per window (default: 64)")
    parser.add_argument("--d-model", type=_positive_int, default=64, help="transformer width (default: 64)")
    parser.add_argument("--layers", type=_positive_int, default=2, help="transformer blocks (default: 2)")
    parser.add_argument("--val-windows", type=_positive_int, default=256, help="validation windows (default: 256)")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="init and batch sampling (default: 0)")
    parser.add_argument(
        "--metrics-out", "--out-json", dest="metrics_out", metavar="PATH", default=None,
        help="write the run's metrics (curves, rounds, settings) as JSON to PATH",
    )  # fmt: skip
    parser.add_argument("--plot", metavar="PNG", default=None, help="plot the loss curves to PNG (matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    rank, world_size = torchrun_rank_and_world_size(parser, "examples/train_chars_diloco.py")
    levels = args.period_group_size or parse_period_group_size(default_period_group_size(world_size))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            AveragingConfig.create(levels).check_world_size(world_size)
    except ValueError as e:
        parser.error(f"--period-group-size {_format_levels(levels)} with {world_size} ranks: {e}")

    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    dist.init_process_group("gloo")
    try:
        metrics = train(args, levels, rank, world_size)
        if rank == 0:
            print(
                f"validation loss {metrics['initial_val_loss']:.4f} -> {metrics['final_val_loss']:.4f} nats/byte  "
                f"outer {args.outer} (lr {args.outer_lr}, momentum {args.outer_momentum})  "
                f"averaging rounds per period {metrics['rounds_per_level']}  "
                f"replicas identical {metrics['replicas_identical']}  ({metrics['seconds']:.1f} s)",
                flush=True,
            )
            if args.metrics_out:
                write_metrics(args.metrics_out, metrics)
            if args.plot:
                plot(metrics, args.plot)
        if not metrics["replicas_identical"]:
            raise SystemExit("replicas differ after a top-level round")
    finally:
        dist.destroy_process_group()


def outer_periods(outer: str, levels: dict[int, int]) -> list[int]:
    """The periods of the levels ``outer`` names: "none", "top" (the largest period) or "both" (every level)."""
    return {"none": [], "top": [max(levels)], "both": sorted(levels)}[outer]


def train(args: argparse.Namespace, levels: dict[int, int], rank: int, world_size: int) -> dict:
    start = time.perf_counter()
    shard = load_char_shard(rank, world_size, context=args.context, val_windows=args.val_windows)
    model = TinyTransformerLM(d_model=args.d_model, layers=args.layers, context=args.context, seed=args.seed)
    opt = HierarchicalAveragingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        period_group_size_dict=levels,
        outer_optimizers={
            period: nesterov_outer(lr=args.outer_lr, momentum=args.outer_momentum)
            for period in outer_periods(args.outer, levels)
        },
    )
    top = len(levels) - 1
    gen = torch.Generator().manual_seed(args.seed * 100_003 + rank)  # each rank its own batches

    # Validation after every top-level round: then every replica holds the same model.
    val_curve = [(0, validation_loss(model, shard))]
    train_curve: list[tuple[int, float]] = []
    identical_after_rounds = True
    interval_loss, interval_steps = 0.0, 0
    bar = tqdm(total=args.steps, disable=rank != 0, desc="chars", unit="step", mininterval=0.5)
    for count in range(args.steps):
        x, y = sample_batch(shard.train, args.batch_size, args.context, gen)
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()  # the inner AdamW step, then the averaging round (and outer step) the schedule says
        interval_loss += loss.item()
        interval_steps += 1
        bar.update(1)
        if level_at(count, levels, 0) == top:
            mean_loss = torch.tensor([interval_loss / interval_steps], dtype=torch.float64)
            dist.all_reduce(mean_loss)
            train_curve.append((count + 1, mean_loss.item() / world_size))
            identical_after_rounds &= replicas_identical(opt.tensors_to_average())
            val_curve.append((count + 1, validation_loss(model, shard)))
            bar.set_postfix(val=f"{val_curve[-1][1]:.3f}", train=f"{train_curve[-1][1]:.3f}")
            interval_loss, interval_steps = 0.0, 0
    bar.close()

    averager_metrics = opt.metrics()
    rounds = {str(p): m["rounds"] for p, m in averager_metrics.items()}
    expected = rounds_per_level(0, args.steps, levels, 0)
    final_round = level_at(args.steps - 1, levels, 0) != top
    if final_round:  # the run did not end on a top-level round: one more, so that there is one model
        opt.average_now(-1)
        val_curve.append((args.steps, validation_loss(model, shard)))
    identical = identical_after_rounds and replicas_identical(opt.tensors_to_average())
    return {
        "world_size": world_size,
        "period_group_size": {str(p): g for p, g in levels.items()},
        "outer": args.outer,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "outer_periods": outer_periods(args.outer, levels),
        "steps": args.steps,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "context": args.context,
        "d_model": args.d_model,
        "layers": args.layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": args.seed,
        "corpus": corpus_fingerprint(),
        "train_files_rank0": list(shard.train_files) if rank == 0 else None,
        "rounds_per_level": rounds,
        "expected_rounds_per_level": {str(p): n for p, n in zip(levels, expected)},
        "final_extra_top_round": final_round,
        "pseudo_grad_norm_per_level": {str(p): m.get("pseudo_grad_norm") for p, m in averager_metrics.items()},
        "outer_bytes_per_level": {str(p): m.get("outer_bytes") for p, m in averager_metrics.items()},
        "val_curve": val_curve,
        "train_curve": train_curve,
        "initial_val_loss": val_curve[0][1],
        "final_val_loss": val_curve[-1][1],
        "replicas_identical": identical,
        "torch_version": torch.__version__,
        "seconds": time.perf_counter() - start,
    }


def plot(metrics: dict, path: str) -> None:
    """Validation and training loss against the step, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(*zip(*metrics["val_curve"]), marker="o", ms=3, label="validation (after each top-level round)")
    if metrics["train_curve"]:
        ax.plot(*zip(*metrics["train_curve"]), label="training (mean over ranks and the steps since the last round)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy, nats per byte")
    low = min(v for _, v in metrics["val_curve"] + metrics["train_curve"] if math.isfinite(v))
    ax.set_ylim(max(0.0, low - 0.2), min(6.0, metrics["initial_val_loss"] + 0.2))
    ax.set_title(
        f"stdlib bytes, {metrics['world_size']} ranks, levels {metrics['period_group_size']}, outer {metrics['outer']}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

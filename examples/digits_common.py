"""Shared pieces of the digits examples: data, model, evaluation, metrics JSON.

The data is scikit-learn's bundled handwritten digits (1,797 8x8 images, 10
classes): real data that needs no download. Every rank loads the same split and
takes its own share of the training set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

from hieravg_optim import HierarchicalAverager, rounds_per_level

__all__ = [
    "DigitsShard",
    "Progress",
    "averaging_metrics",
    "batches",
    "build_mlp",
    "evaluate",
    "load_digits_shard",
    "replicas_identical",
    "report",
    "run_metrics",
    "steps_per_epoch",
    "torchrun_rank_and_world_size",
    "train_epochs",
    "whole_run_metrics",
    "write_metrics",
]


@dataclass(frozen=True)
class DigitsShard:
    """This rank's training share and the common test set (features standardised on the training set)."""

    x_train: torch.Tensor  # (n_train_rank, 64) float32
    y_train: torch.Tensor  # (n_train_rank,) int64
    x_test: torch.Tensor  # (n_test, 64) float32
    y_test: torch.Tensor  # (n_test,) int64


def load_digits_shard(rank: int, world_size: int, *, non_iid: bool = False, seed: int = 0) -> DigitsShard:
    """Split the digits 75/25 into train/test (stratified, fixed seed), then give rank ``rank`` its share.

    IID: a seeded shuffle dealt round-robin. Non-IID: the training set sorted by
    label, then cut into ``world_size`` contiguous blocks, so each rank sees few classes.
    """
    data = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        data.data, data.target, test_size=0.25, random_state=seed, stratify=data.target
    )
    mean = x_tr.mean(axis=0)
    std = x_tr.std(axis=0)
    std[std == 0] = 1.0  # pixels constant in training (e.g. always 0): only centre them, never divide by ~0
    x_train = torch.tensor((x_tr - mean) / std, dtype=torch.float32)
    x_test = torch.tensor((x_te - mean) / std, dtype=torch.float32)
    y_train = torch.tensor(y_tr, dtype=torch.int64)
    y_test = torch.tensor(y_te, dtype=torch.int64)
    if non_iid:
        order = torch.argsort(y_train, stable=True)
        share = torch.tensor_split(order, world_size)[rank]
    else:
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(seed))
        share = order[rank::world_size]
    return DigitsShard(x_train[share], y_train[share], x_test, y_test)


def build_mlp(hidden: int = 128, seed: int = 0) -> torch.nn.Module:
    """A 64 -> hidden -> hidden -> 10 MLP with the same initial weights on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, *, epoch: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches of one epoch; the last, smaller batch is dropped."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    for start in range(0, len(order) - batch_size + 1, batch_size):
        idx = order[start : start + batch_size]
        yield x[idx], y[idx]


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of ``model`` on ``(x, y)``."""
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float(), y).item()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return loss, accuracy


def replicas_identical(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
    """True when every rank of ``group`` holds bitwise the same ``tensors``.

    .. warning:: Collective: every rank of ``group`` must call it with tensors of the same shapes.
    """
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def torchrun_rank_and_world_size(parser: argparse.ArgumentParser, script: str) -> tuple[int, int]:
    """This process's ``RANK`` and ``WORLD_SIZE`` as torchrun sets them; a usage error through ``parser`` if unset."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error(f"RANK/WORLD_SIZE are not set: launch with torchrun --nproc_per_node N {script}")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def write_metrics(path: str | os.PathLike, metrics: dict) -> None:
    """Write ``metrics`` as indented JSON, creating the parent folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(metrics, f, indent=2, sort_keys=True)
        f.write("\n")


def steps_per_epoch(data: DigitsShard, batch_size: int, rank: int, world_size: int) -> int:
    """Optimizer steps per epoch, the same on every rank: the smallest share // ``batch_size``.

    Every rank must step the same number of times, or averaging collectives would wait forever.
    Exits with status 2 and a message (from rank 0) when a batch is larger than the smallest share.

    .. warning:: Collective over the default process group (one all-reduce).
    """
    smallest = torch.tensor([len(data.y_train)])
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    steps = int(smallest) // batch_size
    if steps == 0:
        if rank == 0:
            print(
                f"error: --batch-size {batch_size} is larger than the smallest rank's share of the training "
                f"set ({int(smallest)} samples with {world_size} ranks): use --batch-size {int(smallest)} or less.",
                file=sys.stderr,
            )
        raise SystemExit(2)
    return steps


@dataclass
class Progress:
    """Where training stands on this rank; what a checkpoint saves so that a resumed run continues it exactly."""

    step: int = 0
    """Optimizer steps done. With the epoch length it fixes the position in the data: epoch
    ``step // steps``, and the batches of that epoch already taken (:func:`batches` is a
    function of the seed and the epoch)."""
    epoch_loss: float = 0.0
    """Sum of this rank's training losses over the steps of the unfinished epoch."""
    loss_curve: list[float] = field(default_factory=list)
    """Mean training loss of each finished epoch, over its steps and all ranks."""


def train_epochs(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: DigitsShard,
    *,
    epochs: int,
    steps: int,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    desc: str,
    progress: Progress | None = None,
    after_step: Callable[[Progress], None] | None = None,
) -> list[float]:
    """Train ``epochs`` x ``steps`` optimizer steps on this rank's share; rank 0 shows a progress bar.

    Args:
        progress: Where to start (a resumed run's checkpoint); updated in place. Default: step 0.
        after_step: Called after every optimizer step (after the epoch's loss is reduced, when the
            step ends an epoch), e.g. to save a checkpoint; on every rank, at the same steps.

    Returns:
        The loss curve: per epoch, the mean training loss over the epoch's steps and all ranks.

    .. warning:: Collective over the default process group (one all-reduce per epoch, and ``opt``'s own).
    """
    loss_fn = torch.nn.CrossEntropyLoss()
    progress = progress if progress is not None else Progress()
    bar = tqdm(total=epochs * steps, initial=progress.step, disable=rank != 0, desc=desc, unit="step", mininterval=0.5)
    for epoch in range(progress.step // steps, epochs):
        done = progress.step - epoch * steps  # batches of this epoch taken before a resume
        epoch_batches = batches(data.x_train, data.y_train, batch_size, epoch=epoch, seed=seed + rank)
        for i, (x, y) in zip(range(steps), epoch_batches):
            if i < done:
                continue
            opt.zero_grad()
            loss = loss_fn(model(x).float(), y)
            loss.backward()
            opt.step()
            progress.step += 1
            progress.epoch_loss += loss.item()
            bar.update(1)
            if i == steps - 1:
                epoch_loss = torch.tensor([progress.epoch_loss], dtype=torch.float64)
                dist.all_reduce(epoch_loss)
                progress.loss_curve.append(epoch_loss.item() / (steps * world_size))
                progress.epoch_loss = 0.0
                bar.set_postfix(loss=f"{progress.loss_curve[-1]:.4f}", epoch=epoch + 1)
            if after_step is not None:
                after_step(progress)
    bar.close()
    return progress.loss_curve


def whole_run_metrics(averager: HierarchicalAverager, earlier: dict | None = None) -> dict[int, dict]:
    """``averager.metrics()`` with the counters of ``earlier`` added (rounds, bytes, seconds).

    ``earlier``: what this function returned when the checkpoint a resumed run started from was
    saved (the averager counts only since its construction). Local, no collective.
    """
    metrics = averager.metrics()
    for period, before in (earlier or {}).items():
        for key in ("rounds", "payload_bytes", "bytes_sent", "seconds"):
            metrics[period][key] += before[key]
    return metrics


def averaging_metrics(averager: HierarchicalAverager, total_steps: int, earlier: dict | None = None) -> dict:
    """The metrics-JSON keys every digits example writes about the averaging, JSON keys as strings.

    ``period_group_size``, ``warmup_steps``, ``rounds_per_level`` (counted by the averager, plus
    ``earlier``'s in a resumed run: see :func:`whole_run_metrics`), ``expected_rounds_per_level``
    (from the schedule over ``total_steps`` steps) and ``bytes_sent_per_level``. Read them before
    any final extra averaging, which adds a round.
    """
    levels = averager.levels
    expected = rounds_per_level(0, total_steps, levels, averager.warmup_steps)
    if averager.config.synchronous_warmup:  # every warm-up step averages at the top level
        expected[-1] += min(averager.warmup_steps, total_steps)
    metrics = whole_run_metrics(averager, earlier)
    return {
        "period_group_size": {str(lv.period): lv.group_size for lv in levels},
        "warmup_steps": averager.warmup_steps,
        "rounds_per_level": {str(period): m["rounds"] for period, m in metrics.items()},
        "expected_rounds_per_level": {str(lv.period): n for lv, n in zip(levels, expected)},
        "bytes_sent_per_level": {str(period): m["bytes_sent"] for period, m in metrics.items()},
    }


def run_metrics(
    args, *, world_size: int, steps: int, loss_curve: list[float], test_loss: float, test_accuracy: float,
    replicas_identical: bool, seconds: float,
) -> dict:  # fmt: skip
    """The metrics-JSON keys the torchrun examples share: the run's settings and its results."""
    return {
        "world_size": world_size,
        "epochs": args.epochs,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "non_iid": args.non_iid,
        "steps": steps,
        "loss_curve": loss_curve,
        "final_loss": loss_curve[-1],
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
        "replicas_identical": replicas_identical,
        "torch_version": torch.__version__,
        "seconds": seconds,
    }


def report(metrics: dict, rank: int, metrics_out: str | None, prefix: str = "") -> None:
    """Rank 0 prints the result line (after ``prefix``) and writes ``metrics_out``; every rank exits
    with an error if the replicas differ after the final global averaging."""
    if rank == 0:
        print(
            f"{prefix}test accuracy {metrics['test_accuracy']:.4f}  final train loss {metrics['final_loss']:.4f}  "
            f"averaging rounds per period {metrics['rounds_per_level']}  "
            f"replicas identical {metrics['replicas_identical']}  ({metrics['seconds']:.1f} s)",
            flush=True,
        )
        if metrics_out:
            write_metrics(metrics_out, metrics)
    if not metrics["replicas_identical"]:
        raise SystemExit("replicas differ after the final global averaging")

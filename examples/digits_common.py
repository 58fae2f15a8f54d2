"""Shared pieces of the digits examples: data, model, evaluation, metrics JSON.

The data is scikit-learn's bundled handwritten digits (1,797 8x8 images, 10
classes): real data that needs no download. Every rank loads the same split and
takes its own share of the training set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

__all__ = [
    "DigitsShard",
    "batches",
    "build_mlp",
    "evaluate",
    "load_digits_shard",
    "replicas_identical",
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


def write_metrics(path: str | os.PathLike, metrics: dict) -> None:
    """Write ``metrics`` as indented JSON, creating the parent folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(metrics, f, indent=2, sort_keys=True)
        f.write("\n")

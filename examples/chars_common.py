"""Shared pieces of the character-level language model runs: stdlib source text, a tiny transformer, evaluation.

The text is the Python standard library's own source: the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]`` (the folder of the ``os`` module), which ship with every
Python and need no download. The file list is sorted by name, so every machine with the same
Python version gets the same data. Another minor version (3.11 -> 3.12) adds, removes and edits
files, and so changes the data and every loss; a patch release (3.11.7 -> 3.11.9) may edit some.
The version, the file and byte counts and a SHA-256 of the files are recorded with each run
(:func:`corpus_fingerprint`): equal fingerprints mean equal data.

The split is non-IID by file: every tenth file (by sorted name) is held out for validation; the
other files are dealt to the ranks round-robin, and each rank trains only on its own files. The
tokens are bytes (a vocabulary of 256).
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import sysconfig
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "CharShard",
    "TinyTransformerLM",
    "VALIDATION_EVERY",
    "averaged_copy",
    "corpus_fingerprint",
    "load_char_shard",
    "sample_batch",
    "stdlib_files",
    "validation_loss",
]

VALIDATION_EVERY = 10
"""Files ``0, 10, 20, ...`` of the sorted list are the validation set."""

SEPARATOR = b"\n\x00\n"
"""Between two files of a stream: byte 0 never occurs in the sources, so the model sees file boundaries."""


def stdlib_files() -> list[str]:
    """The top-level ``*.py`` files of this Python's standard library, sorted by name (no subpackages)."""
    folder = sysconfig.get_paths()["stdlib"]
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".py"))


def corpus_fingerprint() -> dict:
    """What fixes the data: the Python version, the number of files and bytes, and a SHA-256 of them."""
    digest = hashlib.sha256()
    size = 0
    files = stdlib_files()
    for path in files:
        data = open(path, "rb").read()
        size += len(data)
        digest.update(os.path.basename(path).encode() + b"\0" + data)
    return {"python": platform.python_version(), "files": len(files), "bytes": size, "sha256": digest.hexdigest()[:16]}


def _stream(paths: list[str]) -> torch.Tensor:
    chunks = [open(p, "rb").read() for p in paths]
    return torch.frombuffer(bytearray(SEPARATOR.join(chunks)), dtype=torch.uint8).long()


@dataclass(frozen=True)
class CharShard:
    """This rank's training bytes and the validation windows it evaluates."""

    train: torch.Tensor
    """(n_train_rank,) int64 byte values: this rank's files, joined by :data:`SEPARATOR`."""
    train_files: tuple[str, ...]
    """The file names of this rank's share."""
    val_windows: torch.Tensor
    """(n_windows_rank, context + 1) int64: this rank's share of the fixed validation windows."""
    val_windows_total: int
    """Validation windows over all ranks (each rank evaluates its share; the losses are summed)."""


def load_char_shard(
    rank: int, world_size: int, *, context: int, val_windows: int = 256
) -> CharShard:  # fmt: skip
    """Rank ``rank``'s training files and its share of ``val_windows`` validation windows.

    Training: files ``i`` not held out, dealt round-robin (file ``j`` of the training list to rank
    ``j % world_size``). Validation: ``val_windows`` windows of ``context + 1`` bytes at evenly
    spaced offsets of the held-out stream, dealt round-robin to the ranks.

    Raises:
        ValueError: ``world_size`` exceeds the number of training files.
    """
    files = stdlib_files()
    held_out = files[::VALIDATION_EVERY]
    training = [f for i, f in enumerate(files) if i % VALIDATION_EVERY]
    if world_size > len(training):
        raise ValueError(
            f"world size {world_size} is larger than the number of training files ({len(training)}): "
            "use fewer ranks"
        )
    mine = training[rank::world_size]
    val = _stream(held_out)
    starts = torch.linspace(0, len(val) - context - 1, val_windows).long()
    windows = torch.stack([val[s : s + context + 1] for s in starts.tolist()])
    return CharShard(
        train=_stream(mine),
        train_files=tuple(os.path.basename(f) for f in mine),
        val_windows=windows[rank::world_size],
        val_windows_total=val_windows,
    )


def sample_batch(stream: torch.Tensor, batch_size: int, context: int, gen: torch.Generator):
    """``batch_size`` random windows of ``stream``: inputs and next-byte targets, both ``(batch_size, context)``."""
    starts = torch.randint(0, len(stream) - context - 1, (batch_size,), generator=gen)
    windows = torch.stack([stream[s : s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


class _Block(torch.nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.norm2 = torch.nn.LayerNorm(d_model)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(), torch.nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformerLM(torch.nn.Module):
    """A pre-norm causal transformer over bytes: embedding + learned positions, ``layers`` blocks, a linear head.

    Input ``(batch, t)`` int64 bytes with ``t <= context``; output ``(batch, t, 256)`` logits.
    ``seed`` fixes the initial weights, the same on every rank.
    """

    def __init__(self, *, d_model: int = 64, layers: int = 2, heads: int = 4, context: int = 64, seed: int = 0) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} must be divisible by heads {heads}")
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(256, d_model)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(context, d_model))
        self.blocks = torch.nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-byte cross-entropy in nats (``reduction`` as in ``F.cross_entropy``)."""
    return F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1), reduction=reduction)


@torch.no_grad()
def validation_loss(model: torch.nn.Module, shard: CharShard, group: dist.ProcessGroup | None = None) -> float:
    """Mean next-byte cross-entropy (nats) of ``model`` over all ranks' validation windows.

    Each rank evaluates its own windows with its own ``model``; pass the same model on every rank
    (after a top-level round, or :func:`averaged_copy`) for the loss of that model.

    .. warning:: Collective over ``group``: one all-reduce; every rank must call it.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for chunk in shard.val_windows.split(32):
        total[0] += lm_loss(model, chunk[:, :-1], chunk[:, 1:], reduction="sum").item()
        total[1] += chunk[:, 1:].numel()
    model.train(was_training)
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1]) if total[1] else math.nan


@torch.no_grad()
def averaged_copy(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> torch.nn.Module:
    """A copy of ``model`` holding the mean of the replicas' parameters; ``model`` itself is unchanged.

    .. warning:: Collective over ``group``: one all-reduce of the flattened parameters.
    """
    import copy

    avg = copy.deepcopy(model)
    flat = torch.cat([p.detach().reshape(-1) for p in avg.parameters()])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for p in avg.parameters():
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return avg

"""Atomic, multi-rank checkpoints for the digits examples: save every N steps, resume from the latest complete one.

Layout under the checkpoint folder (one filesystem that every rank sees, e.g. a single node's
disk or a shared mount)::

    step_00000016/            a complete checkpoint: published only after every rank had written
        manifest.json         written last: the step, the world size, size and sha256 of every file
        rank_0.pt ...         whatever the example writes (its own state per rank, DeepSpeed's folders)
    step_00000024.partial/    a save in progress, or one interrupted by a dead rank: never loaded

A save is a collective (:func:`save_checkpoint`): every rank writes into
``step_<N>.partial/``; after a barrier, rank 0 fsyncs and hashes every file, writes
``manifest.json`` (temporary file, fsync, ``os.replace``), then renames the folder to
``step_<N>`` (one atomic ``rename``) and fsyncs the parent. A rank killed at any point of a save
leaves at most a ``.partial`` folder; the checkpoints published before it are untouched.

:func:`latest_complete` (collective: rank 0 decides, the other ranks receive its answer) picks
the newest ``step_<N>`` whose manifest is readable and whose files all have the recorded size
and sha256, and names every newer folder it skipped and why (a save that did not finish, a
missing manifest, a truncated or changed file).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "MANIFEST",
    "LatestCheckpoint",
    "add_checkpoint_arguments",
    "check_checkpoint_arguments",
    "checkpoint_path",
    "find_latest_complete",
    "kill_drill",
    "latest_complete",
    "load_rank_state",
    "resume_latest",
    "save_checkpoint",
    "save_rank_state",
    "warn_if_restarts_share_the_store",
    "write_file_atomic",
]

MANIFEST = "manifest.json"
"""Name of the completion marker inside a checkpoint folder; written last, by rank 0."""

PARTIAL_SUFFIX = ".partial"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_(\d+)\.partial$")
_CHUNK_BYTES = 1 << 20


def checkpoint_path(root: str | os.PathLike, step: int) -> str:
    """The folder of the checkpoint taken after optimizer step ``step`` (a count of steps)."""
    return os.path.join(os.fspath(root), f"step_{step:08d}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never a part.

    Writes ``path.tmp``, fsyncs it, ``os.replace``s it over ``path`` and fsyncs the folder.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def save_rank_state(folder: str, rank: int, state: dict) -> str:
    """``torch.save`` this rank's ``state`` to ``folder/rank_<rank>.pt``, atomically; returns the path."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = os.path.join(folder, f"rank_{rank}.pt")
    write_file_atomic(path, buffer.getvalue())
    return path


def load_rank_state(folder: str, rank: int) -> dict:
    """Read what :func:`save_rank_state` wrote for ``rank`` (tensors and plain Python values only)."""
    return torch.load(os.path.join(folder, f"rank_{rank}.pt"), weights_only=True)


def _files(folder: str) -> list[str]:
    """Every regular file under ``folder`` except the manifest, as sorted '/'-separated relative paths."""
    out = []
    for parent, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), folder).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _hash_and_sync(path: str) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of ``path``, after flushing it to disk with fsync."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def _seal_and_publish(partial: str, final: str, step: int, world_size: int) -> None:
    """Rank 0's part of a save: fsync and hash every file, write the manifest last, rename into place."""
    files = {}
    for rel in _files(partial):
        size, sha256 = _hash_and_sync(os.path.join(partial, rel))
        files[rel] = {"bytes": size, "sha256": sha256}
    for parent, _, _ in os.walk(partial):
        _fsync_dir(parent)
    manifest = {"format": 1, "step": step, "world_size": world_size, "files": files}
    write_file_atomic(os.path.join(partial, MANIFEST), (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    replaced = None
    if os.path.exists(final):  # a checkpoint of the same step from an earlier attempt, complete or torn
        replaced = f"{final}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(partial, final)
    _fsync_dir(os.path.dirname(final))
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _raise_if_any_failed(error: BaseException | None, what: str, group: dist.ProcessGroup | None) -> None:
    """Every rank raises if one rank's ``what`` failed: the others must not wait for it in a barrier."""
    world_size = dist.get_world_size(group)
    failed = torch.zeros(world_size, dtype=torch.int64)
    failed[dist.get_rank(group)] = int(error is not None)
    dist.all_reduce(failed, group=group)
    if error is not None:
        raise error
    if failed.any():
        ranks = failed.nonzero().flatten().tolist()
        raise RuntimeError(f"rank(s) {ranks} failed {what}; see their error. Nothing was published.")


def save_checkpoint(
    root: str | os.PathLike, step: int, write: Callable[[str], None], group: dist.ProcessGroup | None = None
) -> str:
    """Save one checkpoint atomically: every rank writes, then rank 0 publishes ``step_<step>``.

    Args:
        root: The checkpoint folder, the same path on every rank, on one filesystem all ranks see.
        step: Optimizer steps done (names the folder ``step_<step:08d>``).
        write: Called on every rank with the folder to write into (``step_<step>.partial``); it
            writes this rank's files there, e.g. with :func:`save_rank_state` or DeepSpeed's
            ``engine.save_checkpoint``.
        group: The process group of the job (default: the whole world).

    Returns:
        The published folder.

    Raises:
        RuntimeError: on every rank, if another rank's ``write`` or rank 0's publishing failed
            (the failed rank re-raises its own error); no checkpoint is published then.

    .. warning:: Collective over ``group``: every rank must call it with the same ``root`` and ``step``.
    """
    rank = dist.get_rank(group)
    final = checkpoint_path(root, step)
    partial = final + PARTIAL_SUFFIX
    error: BaseException | None = None
    if rank == 0:
        try:
            os.makedirs(os.fspath(root), exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by an attempt that died in this save
            os.makedirs(partial)
        except OSError as e:
            error = e
    _raise_if_any_failed(error, f"to create {partial}", group)
    try:
        write(partial)
    except Exception as e:  # noqa: BLE001 - re-raised on this rank, reported on the others
        error = e
    _raise_if_any_failed(error, f"to write their part of {partial}", group)
    if rank == 0:
        try:
            _seal_and_publish(partial, final, step, dist.get_world_size(group))
        except OSError as e:
            error = e
    _raise_if_any_failed(error, f"to publish {final}", group)
    return final


def _verify(folder: str, step: int, world_size: int) -> str | None:
    """Why the checkpoint in ``folder`` cannot be loaded, or None if it is complete and intact."""
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        return f"no {MANIFEST}: the save did not complete"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        saved_step, saved_world = int(manifest["step"]), int(manifest["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if saved_step != step:
        return f"{MANIFEST} is for step {saved_step}, the folder is named for step {step}"
    if saved_world != world_size:
        raise ValueError(
            f"The checkpoint {folder} was saved by {saved_world} ranks; this job has {world_size}. Resume with "
            f"{saved_world} ranks, or give another --checkpoint-dir."
        )
    if not files:
        return f"{MANIFEST} lists no files"
    for rel, expected in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            return f"{rel} has {size} bytes, {MANIFEST} says {expected['bytes']} (truncated or overwritten)"
        if _hash_and_sync(path)[1] != expected["sha256"]:
            return f"{rel} does not match the sha256 in {MANIFEST} (changed after the save)"
    return None


@dataclass(frozen=True)
class LatestCheckpoint:
    """What :func:`find_latest_complete` found."""

    path: str | None
    """The newest complete checkpoint folder, or None."""
    step: int
    """Its optimizer step count; 0 when there is none."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """Newer folders that were not used: (path, reason), newest first."""


def find_latest_complete(root: str | os.PathLike, world_size: int) -> LatestCheckpoint:
    """The newest complete, intact checkpoint under ``root``; no collective (reads files only).

    Raises:
        ValueError: if the newest complete checkpoint was saved by another number of ranks.
    """
    root = os.fspath(root)
    candidates: list[tuple[int, str, str | None]] = []  # (step, path, reason to skip it without reading)
    names = os.listdir(root) if os.path.isdir(root) else []
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if match := _STEP_DIR.match(name):
            candidates.append((int(match.group(1)), path, None))
        elif match := _PARTIAL_DIR.match(name):
            candidates.append((int(match.group(1)), path, "a save that did not finish (not published)"))
    skipped = []
    for step, path, reason in sorted(candidates, key=lambda c: (c[0], c[2] is None), reverse=True):
        reason = reason or _verify(path, step, world_size)
        if reason is None:
            return LatestCheckpoint(path, step, skipped)
        skipped.append((path, reason))
    return LatestCheckpoint(None, 0, skipped)


def latest_complete(root: str | os.PathLike, group: dist.ProcessGroup | None = None) -> LatestCheckpoint:
    """:func:`find_latest_complete` on rank 0, the same answer on every rank.

    Raises:
        ValueError: on every rank, if the newest complete checkpoint was saved by another number of ranks.

    .. warning:: Collective over ``group`` (one broadcast of a small object).
    """
    answer: list[object] = [None]
    if dist.get_rank(group) == 0:
        try:
            answer[0] = find_latest_complete(root, dist.get_world_size(group))
        except ValueError as e:
            answer[0] = str(e)
    dist.broadcast_object_list(answer, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if isinstance(answer[0], str):
        raise ValueError(answer[0])
    return answer[0]  # type: ignore[return-value]


def resume_latest(root: str | os.PathLike, rank: int, settings: dict) -> tuple[str | None, dict | None]:
    """``--resume``: this rank's state from the latest complete checkpoint under ``root``, or (None, None).

    Rank 0 prints each newer folder it skipped, and why, and the one it continues from. The
    saved state must hold ``settings`` (what the run was started with) under ``"settings"``.

    Exits (``SystemExit`` with a message, on every rank) if the latest complete checkpoint was saved
    by another number of ranks or with other ``settings``.

    .. warning:: Collective over the default process group.
    """
    try:
        found = latest_complete(root)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if rank == 0:
        for path, reason in found.skipped:
            print(f"resume: skipping {path}: {reason}", file=sys.stderr, flush=True)
        if found.path is None:
            print(f"resume: no complete checkpoint under {os.fspath(root)}; starting at step 0", file=sys.stderr)
    if found.path is None:
        return None, None
    state = load_rank_state(found.path, rank)
    saved = state.get("settings")
    if saved != settings:
        changed = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v} if saved else settings
        raise SystemExit(
            f"error: {found.path} was saved with other settings, as (saved, now): {changed}. Resume with the "
            "settings it was saved with, or give another --checkpoint-dir."
        )
    if rank == 0:
        print(f"resume: continuing from {found.path} (step {found.step})", file=sys.stderr, flush=True)
    return found.path, state


# ------------------------------------------------------------------------------------------------
# Command-line flags and the fault drill, shared by the examples
# ------------------------------------------------------------------------------------------------
def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--checkpoint-dir``, ``--checkpoint-every``, ``--resume`` and ``--kill-at-step`` to ``parser``."""
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", default=None,
        help="save checkpoints under DIR (one filesystem all ranks see): step_<N>/ folders, each published "
        "atomically once every rank has written",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-every", metavar="N", type=int, default=None,
        help="save after every N optimizer steps, and after the last (default with --checkpoint-dir: once per epoch)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="continue from the latest complete checkpoint under --checkpoint-dir (start at step 0 if there is "
        "none); torn or unfinished ones are skipped and named",
    )  # fmt: skip
    parser.add_argument(
        "--kill-at-step", metavar="N", type=int, default=None,
        help="fault drill, under torchrun only: on the first attempt (TORCHELASTIC_RESTART_COUNT=0) the last rank "
        "kills itself with SIGKILL after optimizer step N, in the middle of the save if a checkpoint is due then",
    )  # fmt: skip


def check_checkpoint_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` (exit code 2) for a checkpoint flag without ``--checkpoint-dir`` or a value below 1."""
    if args.checkpoint_dir is None:
        for flag, value in [("--checkpoint-every", args.checkpoint_every), ("--kill-at-step", args.kill_at_step)]:
            if value is not None:
                parser.error(f"{flag} {value} needs --checkpoint-dir DIR")
        if args.resume:
            parser.error("--resume needs --checkpoint-dir DIR (the folder the checkpoints were saved to)")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every must be a positive number of steps, got {args.checkpoint_every}")
    if args.kill_at_step is not None:
        if args.kill_at_step < 1:
            parser.error(f"--kill-at-step must be a positive step, got {args.kill_at_step}")
        if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
            parser.error(
                f"--kill-at-step {args.kill_at_step} needs torchrun (it reads TORCHELASTIC_RESTART_COUNT to kill on "
                "the first attempt only): torchrun --max-restarts 1 ... --resume"
            )


def kill_drill(args: argparse.Namespace, step: int, rank: int, world_size: int, *, in_save: bool) -> None:
    """The ``--kill-at-step`` fault drill: SIGKILL the last rank after ``step``, on the first attempt only."""
    if args.kill_at_step != step or rank != world_size - 1:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
        return
    where = "in the middle of the checkpoint save" if in_save else "between steps"
    print(f"fault drill: rank {rank} kills itself (SIGKILL) after step {step}, {where}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def warn_if_restarts_share_the_store() -> None:
    """Rank 0 warns when torchrun may restart the job while sharing its rendezvous store with the workers.

    torchrun (torch 2.4 and later) hands its own TCP store to the workers; the process-group keys
    of the first attempt stay in it, and a restarted worker can read a dead peer's address and fail
    in ``init_process_group`` ("Gloo connectFullMesh failed ... Connection refused";
    https://github.com/pytorch/pytorch/issues/135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    gives every attempt a fresh store.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restarts > 0 and shared and os.environ.get("RANK", "0") == "0":
        print(
            f"warning: torchrun --max-restarts {restarts} shares its rendezvous store with the workers, and a "
            "restarted worker can read the addresses of the first attempt and fail to connect (pytorch/pytorch#135712):"
            " launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment.",
            file=sys.stderr,
            flush=True,
        )

"""Per-replica DeepSpeed checkpoints: the folders, the per-rank outer state files, atomic saves.

Replicas differ between averagings, so each one keeps its own DeepSpeed files, inside the
checkpoint's tag folder where frameworks look for it (HF ``Trainer``: ``<dir>/global_step*``;
Lightning: ``<dir>/checkpoint``): ``<dir>/<tag>/replica_<k>/`` (:func:`replica_checkpoint_dir`),
with ``<dir>/latest`` naming the tag, and the averaging state in the ``client_state`` under
:data:`CHECKPOINT_KEY`. Checkpoints of the earlier layout, ``<dir>/replica_<k>/<tag>/`` with a
``latest`` per replica, still load. The outer optimizer state (anchors and outer optimizer, one ZeRO
partition per rank) goes into one file per rank next to DeepSpeed's per-rank files in the replica's
folder, :func:`outer_state_file`: DeepSpeed writes the ``client_state`` of ZeRO 0-2 from the first rank
of the data-parallel group only, and every rank reads that one. The engine's ``save_checkpoint`` and
``load_checkpoint`` are wrapped to use them in :mod:`hieravg_optim.deepspeed.hooks`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..replica import replica_dir

__all__ = [
    "CHECKPOINT_KEY",
    "outer_state_file",
    "replica_checkpoint_dir",
    "save_outer_state",
    "with_outer_state",
    "write_latest",
]

CHECKPOINT_KEY = "hierarchical_averaging"
"""Key of the averaging state in the ``client_state`` of DeepSpeed checkpoints."""

OUTER_SAVED = "outer_state_per_rank"
"""Key in the saved averaging state: the periods whose outer state each rank saved in :func:`outer_state_file`."""
IN_FLIGHT_SAVED = "in_flight_per_rank"
"""Key in the saved averaging state: the periods whose round in flight each rank saved in :func:`outer_state_file`."""
OUTER_KEY, IN_FLIGHT_KEY = "outer", "in_flight"


def replica_checkpoint_dir(save_dir: str | os.PathLike, replica_index: int, tag: str | None = None) -> str:
    """Where replica ``replica_index`` keeps its DeepSpeed files under ``save_dir``.

    Args:
        save_dir: The folder given to ``save_checkpoint`` / ``load_checkpoint``.
        replica_index: The replica, ``k``.
        tag: The checkpoint's tag: ``<save_dir>/<tag>/replica_<k>``, the folder of DeepSpeed's files
            (``mp_rank_00_model_states.pt``, ``zero_pp_rank_*``). ``None``: the earlier layout's folder,
            ``<save_dir>/replica_<k>``, which holds DeepSpeed's tag folders and its ``latest``.
    """
    if tag is None:
        return replica_dir(save_dir, replica_index)
    return replica_dir(os.path.join(os.fspath(save_dir), str(tag)), replica_index)


def outer_state_file(tag_dir: str | os.PathLike, dp_rank: int) -> str:
    """The file of one rank's outer optimizer state (anchors, outer optimizer) in the folder of DeepSpeed's files.

    ``tag_dir`` is that folder: ``<dir>/<tag>/replica_<k>`` (:func:`replica_checkpoint_dir`), or
    ``<dir>/replica_<k>/<tag>`` in the earlier layout.

    ``dp_rank`` is the rank in the replica (DeepSpeed's data-parallel rank), as in DeepSpeed's
    ``zero_pp_rank_<dp_rank>_mp_rank_00_optim_states.pt`` next to it.
    """
    return os.path.join(os.fspath(tag_dir), f"hierarchical_averaging_outer_dp_rank_{dp_rank}.pt")


def _save_atomically(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename: a crash leaves no partial file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_latest(save_dir: str | os.PathLike, tag: str) -> None:
    """Write ``<save_dir>/latest`` naming ``tag``, as DeepSpeed does, atomically (a temporary file, then a rename)."""
    path = os.path.join(os.fspath(save_dir), "latest")
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fd:
            fd.write(tag)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_outer_state(averaging: dict[str, Any], tag_dir: str, dp_rank: int) -> None:
    """Move the per-rank tensor entries of ``averaging`` (a state dict, changed in place) into this rank's file.

    Those entries hold lists of tensors shaped like this rank's averaged tensors (its ZeRO partition): ``"outer"``
    (anchors and outer optimizer state) and ``"in_flight"`` (the rounds in flight, ``delay_steps``). Writes
    :func:`outer_state_file` in ``tag_dir`` atomically (a temporary file, then a rename) and puts the saved periods
    under :data:`OUTER_SAVED` and :data:`IN_FLIGHT_SAVED` instead. Nothing is written without them. Local.
    """
    entries = {key: averaging.pop(key, None) for key in (OUTER_KEY, IN_FLIGHT_KEY)}
    if not any(entries.values()):
        return
    os.makedirs(tag_dir, exist_ok=True)
    _save_atomically(
        {**entries, "step": averaging.get("step"), "rank": dist.get_rank()}, outer_state_file(tag_dir, dp_rank)
    )
    for key, marker in ((OUTER_KEY, OUTER_SAVED), (IN_FLIGHT_KEY, IN_FLIGHT_SAVED)):
        if entries[key]:
            averaging[marker] = sorted(int(p) for p in entries[key])


def with_outer_state(
    saved: Mapping[str, Any], tag_dir: str, dp_rank: int, map_location: torch.device
) -> dict[str, Any]:
    """The saved averaging state, with this rank's outer state read from :func:`outer_state_file` if it was saved.

    Args:
        saved: The averaging state of the checkpoint's ``client_state``.
        tag_dir: The checkpoint's tag folder.
        dp_rank: This rank's rank in the replica.
        map_location: Where the anchors go (``outer_state_device``, else with the master weights).

    Raises:
        FileNotFoundError: naming the file, if the averaging state says the ranks saved their outer state
            but this rank's file is missing (never silently fresh anchors on one rank).
        ValueError: if the file was saved at another averaging step than the checkpoint.
    """
    saved = dict(saved)
    periods = saved.pop(OUTER_SAVED, None)
    in_flight = saved.pop(IN_FLIGHT_SAVED, None)
    if not periods and not in_flight:
        return saved
    periods = periods or in_flight
    path = outer_state_file(tag_dir, dp_rank)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"The checkpoint in {tag_dir} was saved with the outer optimizer state of periods {periods} in one file "
            f"per rank, but this rank's file {path} is missing. Restore the whole checkpoint folder, with the "
            "file of every rank."
        )
    loaded = torch.load(path, map_location=map_location, weights_only=True)
    if loaded.get("step") != saved.get("step"):
        raise ValueError(
            f"{path} holds the outer optimizer state of averaging step {loaded.get('step')}, but the checkpoint in "
            f"{tag_dir} was saved at step {saved.get('step')}: the folder mixes two saves. Restore it whole."
        )
    for key in (OUTER_KEY, IN_FLIGHT_KEY):
        if loaded.get(key):
            saved[key] = loaded[key]
    return saved

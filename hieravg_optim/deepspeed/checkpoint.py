"""Per-replica DeepSpeed checkpoints: each replica saves to and loads from its own folder.

Replicas differ between averagings, so each one keeps its DeepSpeed checkpoint in
``<dir>/replica_<k>/``, with the averaging state in the ``client_state`` under
:data:`CHECKPOINT_KEY`. The outer optimizer state (anchors and outer optimizer, one ZeRO
partition per rank) goes into one file per rank next to DeepSpeed's per-rank files,
``<dir>/replica_<k>/<tag>/`` :func:`outer_state_file`: DeepSpeed writes the ``client_state`` of
ZeRO 0-2 from the first rank of the data-parallel group only, and every rank reads that one.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..agreement import agree_across_ranks
from ..replica import replica_dir

if TYPE_CHECKING:
    from .engine import DeepSpeedAveraging

__all__ = ["CHECKPOINT_KEY", "outer_state_file", "replica_checkpoint_dir", "wrap_checkpoints"]

CHECKPOINT_KEY = "hierarchical_averaging"
"""Key of the averaging state in the ``client_state`` of DeepSpeed checkpoints."""


_OUTER_SAVED = "outer_state_per_rank"
"""Key in the saved averaging state: the periods whose outer state each rank saved in :func:`outer_state_file`."""


def replica_checkpoint_dir(save_dir: str | os.PathLike, replica_index: int) -> str:
    """Where replica ``replica_index`` keeps its DeepSpeed checkpoints under ``save_dir``: ``replica_<k>``."""
    return replica_dir(save_dir, replica_index)


def outer_state_file(tag_dir: str | os.PathLike, dp_rank: int) -> str:
    """The file of one rank's outer optimizer state (anchors, outer optimizer) in a checkpoint's tag folder.

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


def wrap_checkpoints(engine: Any, state: DeepSpeedAveraging) -> None:
    """Make ``engine.save_checkpoint`` / ``load_checkpoint`` keep each replica in its own folder.

    Both keep DeepSpeed's signatures. ``save_checkpoint`` writes to
    ``replica_checkpoint_dir(save_dir, replica)`` with the averaging state in the client state,
    and ``latest`` for every replica (DeepSpeed writes it on global rank 0 only). With outer
    optimizers, every rank first writes its anchors and outer optimizer state to
    :func:`outer_state_file` in the tag's folder (atomically: a temporary file, then a rename), so
    that they are there before ``latest`` names the tag.
    ``load_checkpoint`` reads the replica's folder and restores the averaging step count, and
    each rank its own outer state.

    .. warning::
        Both wrapped methods are collective over the default process group.

    Raises:
        RuntimeError: from ``load_checkpoint``, on every rank, if some replicas found a checkpoint and
            others did not, or if a rank could not restore its outer state (its file missing although
            the checkpoint's averaging state says it was saved, or anchors of another shape: the other
            ranks raise ``RuntimeError`` naming it, that rank its own error).
    """
    original_save = engine.save_checkpoint
    original_load = engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        folder = replica_checkpoint_dir(save_dir, state.replica_index)
        os.makedirs(folder, exist_ok=True)
        client = dict(client_state or {})
        averaging = dict(state.state_dict())
        outer = averaging.pop("outer", None)
        if outer:
            # Before DeepSpeed's save, which ends by naming the tag in "latest".
            saved_tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
            tag_dir = os.path.join(folder, saved_tag)
            os.makedirs(tag_dir, exist_ok=True)
            _save_atomically(
                {"outer": outer, "step": averaging.get("step"), "rank": dist.get_rank()},
                outer_state_file(tag_dir, state.mpu.get_data_parallel_rank()),
            )
            averaging[_OUTER_SAVED] = sorted(int(p) for p in outer)
        client[CHECKPOINT_KEY] = averaging
        out = original_save(
            folder,
            tag=tag,
            client_state=client,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        if save_latest and state.replica_index > 0 and state.mpu.get_data_parallel_rank() == 0:
            # DeepSpeed writes "latest" on global rank 0 only, i.e. for replica 0.
            saved_tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
            with open(os.path.join(folder, "latest"), "w") as fd:
                fd.write(saved_tag)
        dist.barrier()
        return out

    def load_checkpoint(load_dir, tag=None, *args: Any, **kwargs: Any):
        folder = replica_checkpoint_dir(load_dir, state.replica_index)
        load_path, client_state = original_load(folder, tag, *args, **kwargs)
        error: BaseException | None = None
        if load_path is not None:
            client_state = dict(client_state or {})
            saved = client_state.pop(CHECKPOINT_KEY, None)
            if saved is None:
                warnings.warn(
                    f"The checkpoint {load_path} has no hierarchical averaging state; the averaging schedule resumes "
                    f"at the engine's global step {engine.global_steps}.",
                    UserWarning,
                    stacklevel=2,
                )
                saved = {"step": engine.global_steps}
            try:
                try:
                    state.load_state_dict(_with_outer_state(state, saved, os.path.dirname(load_path)))
                except ValueError as exc:
                    # Local: raised on every rank by the agreement below, before any other collective.
                    raise ValueError(
                        f"Loading the averaging state of the checkpoint {load_path} (this rank's outer optimizer state "
                        f"in {outer_state_file(os.path.dirname(load_path), state.mpu.get_data_parallel_rank())}): "
                        f"{exc} Resume with the model, trainable parameters, ZeRO stage and ranks_per_replica that "
                        "saved it. The averaging state is unchanged (DeepSpeed has loaded the engine's weights)."
                    ) from exc
                if state.averager.needs_anchors:
                    # A checkpoint without outer state (saved without outer optimizers), past the warm-up: anchors
                    # at the loaded weights; the first round averages them over its group.
                    state.take_anchors()
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement below
                error = exc
        # DeepSpeed only logs a warning for a missing checkpoint: a replica without one (resuming with more
        # replicas than were saved) would silently start from fresh weights while the others resume. One
        # collective checks that, and that every rank restored its own outer state.
        agree_across_ranks(
            f"whether their replica found a checkpoint under {os.fspath(load_dir)}/replica_<k> (True: found)",
            load_path is not None,
            None,
            error=error,
            fix="Every replica loads its own folder: resume with the world size and ranks_per_replica that saved "
            "the checkpoint, or on none of the replicas.",
        )
        return load_path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def _with_outer_state(state: DeepSpeedAveraging, saved: Mapping[str, Any], tag_dir: str) -> dict[str, Any]:
    """The saved averaging state, with this rank's outer state read from :func:`outer_state_file` if it was saved.

    Raises:
        FileNotFoundError: naming the file, if the averaging state says the ranks saved their outer state
            but this rank's file is missing (never silently fresh anchors on one rank).
        ValueError: if the file was saved at another averaging step than the checkpoint.
    """
    saved = dict(saved)
    periods = saved.pop(_OUTER_SAVED, None)
    if not periods:
        return saved
    path = outer_state_file(tag_dir, state.mpu.get_data_parallel_rank())
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"The checkpoint in {tag_dir} was saved with the outer optimizer state of periods {periods} in one file "
            f"per rank, but this rank's file {path} is missing. Restore the whole checkpoint folder, with the "
            "file of every rank."
        )
    loaded = torch.load(path, map_location=state._outer_state_location(), weights_only=True)
    if loaded.get("step") != saved.get("step"):
        raise ValueError(
            f"{path} holds the outer optimizer state of averaging step {loaded.get('step')}, but the checkpoint in "
            f"{tag_dir} was saved at step {saved.get('step')}: the folder mixes two saves. Restore it whole."
        )
    saved["outer"] = loaded["outer"]
    return saved

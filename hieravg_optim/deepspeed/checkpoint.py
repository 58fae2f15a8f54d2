"""Per-replica DeepSpeed checkpoints: each replica saves to and loads from its own folder.

Replicas differ between averagings, so each one keeps its DeepSpeed checkpoint in
``<dir>/replica_<k>/``, with the averaging state in the ``client_state`` under
:data:`CHECKPOINT_KEY`.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..agreement import agree_across_ranks

if TYPE_CHECKING:
    from .engine import DeepSpeedAveraging

__all__ = ["CHECKPOINT_KEY", "replica_checkpoint_dir", "wrap_checkpoints"]

CHECKPOINT_KEY = "hierarchical_averaging"
"""Key of the averaging state in the ``client_state`` of DeepSpeed checkpoints."""


def replica_checkpoint_dir(save_dir: str | os.PathLike, replica_index: int) -> str:
    """Where replica ``replica_index`` keeps its DeepSpeed checkpoints under ``save_dir``."""
    return os.path.join(os.fspath(save_dir), f"replica_{replica_index}")


def wrap_checkpoints(engine: Any, state: DeepSpeedAveraging) -> None:
    """Make ``engine.save_checkpoint`` / ``load_checkpoint`` keep each replica in its own folder.

    Both keep DeepSpeed's signatures. ``save_checkpoint`` writes to
    ``replica_checkpoint_dir(save_dir, replica)`` with the averaging state in the client state,
    and ``latest`` for every replica (DeepSpeed writes it on global rank 0 only).
    ``load_checkpoint`` reads the replica's folder and restores the averaging step count.

    .. warning::
        Both wrapped methods are collective over the default process group.

    Raises:
        RuntimeError: from ``load_checkpoint``, on every rank, if some replicas found a checkpoint and
            others did not.
    """
    original_save = engine.save_checkpoint
    original_load = engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        folder = replica_checkpoint_dir(save_dir, state.replica_index)
        os.makedirs(folder, exist_ok=True)
        client = dict(client_state or {})
        client[CHECKPOINT_KEY] = state.state_dict()
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
        # DeepSpeed only logs a warning for a missing checkpoint: a replica without one (resuming with more
        # replicas than were saved) would silently start from fresh weights while the others resume.
        agree_across_ranks(
            f"whether their replica found a checkpoint under {os.fspath(load_dir)}/replica_<k> (True: found)",
            load_path is not None,
            None,
            fix="Every replica loads its own folder: resume with the world size and ranks_per_replica that saved "
            "the checkpoint, or on none of the replicas.",
        )
        if load_path is None:
            return load_path, client_state
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
        state.load_state_dict(saved)
        return load_path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint



"""Per-replica FSDP checkpoints with ``torch.distributed.checkpoint`` (DCP).

Replicas differ between averagings, and DCP deduplicates identical keys across ranks, so
each replica is saved to its own folder ``replica_<r>`` over its ``"shard"`` process group.
Model and optimizer go through ``get_state_dict`` / ``set_state_dict``; the averaging state
(step count, levels) is saved beside them.

Delayed rounds in flight are saved per rank too, as one object per shard index, ``in_flight.shard_<k>``.

The outer optimizers' anchors, and each outer-state tensor shaped like its anchor (SGD's
momentum buffer, Adam's moments), are local shards that differ across the ranks of a replica.
As plain tensors under one key DCP would keep one rank's copy, so they are saved as DTensors
with the layout of the shards they anchor (:meth:`FSDPHierarchicalAveragingOptimizer.shard_layouts`),
under ``outer.dtensors``. The rest of each rank's outer state (hyperparameters, step counts, any
tensor of another shape) is saved as one object per shard index, ``outer.shard_<k>``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, LoadPlan
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._flat_param import FlatParameter

from .._compat import DTensor, Shard
from ..agreement import agree_across_ranks
from ..replica import replica_dir
from .mesh import SHARD_DIM
from ..tensors import unique_params
from .optimizer import FSDPHierarchicalAveragingOptimizer, ShardLayout

__all__ = ["load_checkpoint", "save_checkpoint"]


def _replica_folder(path: str | os.PathLike, optimizer: FSDPHierarchicalAveragingOptimizer) -> str:
    return replica_dir(path, optimizer.replica_index)


def _optimizer_holds_flat_params(optimizer: FSDPHierarchicalAveragingOptimizer) -> bool:
    return any(isinstance(p, FlatParameter) for _, _, p in unique_params(optimizer.optimizer.param_groups))


def _checkpoint_state(
    module: nn.Module, optimizer: FSDPHierarchicalAveragingOptimizer, *, outer: bool = True
) -> dict[str, Any]:
    """What one rank saves: model and optimizer state (DCP state dicts), the averaging state and, with
    ``outer``, the outer optimizers' anchors and state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    averaging = optimizer.averager.state_dict()
    in_flight = averaging.pop(_IN_FLIGHT, None)
    outer_state = averaging.pop(_OUTER, None)
    state: dict[str, Any] = {"hierarchical_averaging": averaging}
    if outer and outer_state:
        state[_OUTER] = _outer_to_checkpoint(outer_state, optimizer)
    if outer and in_flight:
        state[_IN_FLIGHT] = {_shard_key(optimizer): _to_blob(in_flight)}
    # Before the first step the inner optimizer has no state; torch's helpers would fill it with a zero-lr step
    # that leaves Adam's "step" at 1. This makes the same state without a step (and the next real step drops it).
    optimizer.initialize_state()
    if _optimizer_holds_flat_params(optimizer):
        # FSDP1 with use_orig_params=False. torch 2.13's FSDP.optim_state_dict broadcasts from global rank 0
        # (_optim_utils._map_param_key_to_optim_keys), which is not in the shard group of replicas 1, 2, ...,
        # so get_state_dict fails there. The optimizer's state of each local flat shard (FSDP1 pads the
        # shards to equal sizes) is saved instead as a DTensor sharded over the "shard" dimension.
        state["model"] = get_model_state_dict(module)
        state["optim_flat"] = _flat_optimizer_state(optimizer)
    else:
        state["model"], state["optim"] = get_state_dict(module, optimizer.optimizer)
    return state


def _replica_group(optimizer: FSDPHierarchicalAveragingOptimizer) -> dist.ProcessGroup:
    """The group of DCP's collectives within the replica: the averager's (with the averaging's timeout), else
    the mesh's ``"shard"`` group of this rank alone."""
    group = optimizer.averager.replica_group
    return group if group is not None else optimizer.mesh[SHARD_DIM].get_group()


def _flat_optimizer_state(optimizer: FSDPHierarchicalAveragingOptimizer) -> dict[str, Any]:
    inner = optimizer.optimizer
    raw = inner.state_dict()
    shard_mesh = optimizer.mesh[SHARD_DIM]
    flat_state: dict[str, dict[str, Any]] = {}
    for index, entries in raw["state"].items():
        flat_state[str(index)] = {
            name: DTensor.from_local(value, shard_mesh, [Shard(0)], run_check=False)
            if torch.is_tensor(value) and value.dim() >= 1
            else value
            for name, value in entries.items()
        }
    return {"state": flat_state, "param_groups": raw["param_groups"]}


def _load_flat_optimizer_state(optimizer: FSDPHierarchicalAveragingOptimizer, saved: Mapping[str, Any]) -> None:
    state = {
        int(index): {name: v.to_local() if isinstance(v, DTensor) else v for name, v in entries.items()}
        for index, entries in saved["state"].items()
    }
    optimizer.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


class _ExactLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, minus its pre-2.4 key-format guess: loads exactly the entries asked for."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        return create_default_local_load_plan(self.state_dict, self.metadata, strict=True)


def save_checkpoint(
    path: str | os.PathLike, module: nn.Module, optimizer: FSDPHierarchicalAveragingOptimizer
) -> None:
    """Save model, optimizer and averaging state with ``torch.distributed.checkpoint`` (DCP).

    Each replica writes its own sharded checkpoint to ``path/replica_<r>`` over its
    ``"shard"`` group: replicas differ between averagings, and DCP would keep one copy of
    identically named shards. Model and optimizer go through
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` (FSDP1 with
    ``use_orig_params=False``: the model does, and the optimizer's local flat-shard state is
    saved as DTensors over the shard dimension, see the limitations in the README); the averaging state is
    :meth:`HierarchicalAverager.state_dict` (the step count and levels).

    Outer optimizers (``outer_optimizers``): each level's anchors, and every outer-state tensor shaped
    like its anchor (momentum buffers, Adam's moments), are saved as DTensors with the layout of the
    local shards they anchor (:meth:`FSDPHierarchicalAveragingOptimizer.shard_layouts`: FSDP2, the
    parameter's device mesh and placements; FSDP1, ``Shard(0)`` over the ``"shard"`` mesh), under
    ``outer.dtensors``: the ranks of a replica hold different shards, and plain tensors under one key
    would be deduplicated by DCP to one rank's copy. The rest of a rank's outer state (the outer
    optimizer's ``param_groups``, step counts, tensors of other shapes) is one object under
    ``outer.shard_<k>``, ``k`` being the rank's shard index. Anchors on another device than the mesh's
    (``outer_state_device="cpu"``) are saved from there, without a copy.

    Delayed rounds in flight (``delay_steps``): :meth:`HierarchicalAverager.state_dict` waits for their
    collectives (no tensor changes), and each rank's rounds (the all-reduced copies and the snapshot of its
    local shards, their pieces and counts) are one object under ``in_flight.shard_<k>``, written by that rank
    only; :func:`load_checkpoint` restores them (the same mesh shape), and they are applied at their counts.

    .. warning:: Collective over the default process group: every rank must call this.

    Args:
        path: Folder shared by all ranks (created if missing).
        module: The sharded module the optimizer was built for.
        optimizer: The averaging optimizer.
    """
    from torch.distributed.checkpoint import save

    state = _checkpoint_state(module, optimizer)
    save(state, checkpoint_id=_replica_folder(path, optimizer), process_group=_replica_group(optimizer))
    dist.barrier(group=optimizer.averager.timed_process_group)


def load_checkpoint(
    path: str | os.PathLike, module: nn.Module, optimizer: FSDPHierarchicalAveragingOptimizer
) -> None:
    """Load what :func:`save_checkpoint` wrote, in place, with the same FSDP wrapping.

    Replica ``r`` loads ``path/replica_<r>``: as many replicas as were saved, or fewer. FSDP2 may change the
    shards per replica (DCP reshards, exactly; not with outer optimizers); FSDP1 keeps them (``docs/fsdp.md``).

    The next :meth:`~FSDPHierarchicalAveragingOptimizer.step` checks that every rank resumed at the same count.
    The outer optimizers' anchors and state are restored as the checkpoint holds them (read from its
    metadata), also into an optimizer that has not taken its anchors yet; a checkpoint without them
    leaves the outer optimizers to :meth:`HierarchicalAverager.load_state_dict`.

    .. warning:: Collective over the default process group: every rank must call this.

    Raises:
        FileNotFoundError: if ``path/replica_<r>`` does not exist (e.g. fewer replicas were saved).
        ValueError: on the failing ranks, if the checkpoint's outer state was saved with another number of
            shards per replica, or for other tensors (another model, or other parameters trainable).
        RuntimeError: on the other ranks, naming the rank that failed to load (instead of waiting for it).
    """
    error: BaseException | None = None
    try:
        _load_replica(path, module, optimizer)
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        error = exc
    # Replaces a barrier: a replica that failed (its folder missing: fewer replicas were saved) raises its
    # error, every other rank a RuntimeError naming it, instead of waiting in the next collective.
    agree_across_ranks(
        "the checkpoint load",
        None,
        optimizer.averager.timed_process_group,
        error=error,
        fix="Resume with the mesh shape that saved the checkpoint.",
    )


def _load_replica(
    path: str | os.PathLike, module: nn.Module, optimizer: FSDPHierarchicalAveragingOptimizer
) -> None:
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    folder = _replica_folder(path, optimizer)
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"No checkpoint for replica {optimizer.replica_index} at {folder}: resume with the mesh shape "
            "(replicas, shards) that saved it."
        )
    state = _checkpoint_state(module, optimizer, outer=False)
    shard_group = _replica_group(optimizer)
    metadata = FileSystemReader(folder).read_metadata()
    outer_template = None
    if any(key.startswith(f"{_OUTER}.") for key in metadata.state_dict_metadata):  # the same on the whole replica
        error: ValueError | None = None
        try:
            outer_template = _outer_load_template(metadata, optimizer, folder)
        except ValueError as exc:
            error = exc
        # Before DCP's collectives: a rank whose shard index or shapes do not match raises its error, the other
        # ranks of its replica a RuntimeError naming it, instead of waiting for it in load().
        agree_across_ranks(
            "the outer optimizer state of the checkpoint",
            None,
            shard_group,
            error=error,
            fix="Resume with the mesh shape, model and trainable parameters that saved the checkpoint.",
        )
        state[_OUTER] = outer_template
    if any(key.startswith(f"{_IN_FLIGHT}.") for key in metadata.state_dict_metadata):
        # Rounds in flight at the save: this rank's own entry (its shard's copies and snapshot), by shard index.
        error = None
        try:
            state[_IN_FLIGHT] = {_in_flight_key(metadata, optimizer, folder): b""}
        except ValueError as exc:
            error = exc
        agree_across_ranks(  # before DCP's collectives, as for the outer state
            "the rounds in flight of the checkpoint", None, shard_group, error=error,
            fix="Resume with the mesh shape that saved the checkpoint.",
        )  # fmt: skip
    # A rank whose local shard of a parameter is empty (FSDP1 with uneven shards) has no entry for it while the
    # checkpoint has one; DefaultLoadPlanner then guesses "a checkpoint older than torch 2.4" and flattens
    # differently, silently skipping entries. _ExactLoadPlanner loads exactly this rank's entries, and still
    # raises for an entry missing from the checkpoint.
    load(
        state,
        checkpoint_id=folder,
        planner=_ExactLoadPlanner(),
        process_group=shard_group,
    )
    if "optim" in state:
        set_state_dict(module, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(module, state["model"])
        _load_flat_optimizer_state(optimizer, state["optim_flat"])
    averaging = dict(state["hierarchical_averaging"])
    if outer_template is not None:
        averaging[_OUTER] = _outer_from_checkpoint(state[_OUTER], optimizer)
    if _IN_FLIGHT in state:
        blob = state[_IN_FLIGHT][_shard_key(optimizer)]
        device = next((t.device for t in optimizer.tensors_to_average()), torch.device("cpu"))
        averaging[_IN_FLIGHT] = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)
    try:
        optimizer.averager.load_state_dict(averaging, optimizer.tensors_to_average())
    except ValueError as exc:  # local; raised on every rank by load_checkpoint's agreement
        raise ValueError(
            f"Loading the averaging state of the checkpoint at {folder}: {exc} Resume with the model, mesh shape and "
            "trainable parameters that saved it."
        ) from exc


# -- rounds in flight -------------------------------------------------------------------------------------------------
_IN_FLIGHT = "in_flight"


def _to_blob(obj: object) -> bytes:
    blob = io.BytesIO()
    torch.save(obj, blob)
    return blob.getvalue()


def _in_flight_key(metadata: Metadata, optimizer: FSDPHierarchicalAveragingOptimizer, folder: str) -> str:
    """This rank's key of the checkpoint's rounds in flight (``shard_<k>``), read from its metadata.

    Raises:
        ValueError: if the checkpoint has no entry for this rank's shard index (another number of shards).
    """
    saved = sorted(k[len(_IN_FLIGHT) + 1 :] for k in metadata.state_dict_metadata if k.startswith(f"{_IN_FLIGHT}."))
    mine = _shard_key(optimizer)
    if mine not in saved:
        raise ValueError(
            f"The checkpoint at {folder} was saved with delayed rounds in flight, for shard indexes {saved}, but this "
            f"rank holds {mine}: a round in flight holds this rank's shard of the averaged tensors, so resume with "
            "the mesh shape (replicas, shards per replica) that saved it."
        )
    return mine


# -- outer optimizers: anchors and state ------------------------------------------------------------------------------
_OUTER = "outer"
_DTENSORS = "dtensors"
_LISTS = "tensor_lists"
"""Key in a level's saved object: ``{name: count}`` of its other lists of tensors saved as DTensors, beside the
anchors (a compressed level's ``"residuals"``)."""


def _shard_key(optimizer: FSDPHierarchicalAveragingOptimizer) -> str:
    return f"shard_{optimizer.mesh.get_local_rank(SHARD_DIM)}"


def _as_dtensor(local: torch.Tensor, layout: ShardLayout) -> DTensor:
    """``local`` as the shard of a DTensor with ``layout``, sharing its storage (no copy, no collective)."""
    mesh = layout.mesh
    if local.device.type != mesh.device_type:
        # Anchors kept on another device (outer_state_device="cpu" with an accelerator mesh): DTensor.from_local
        # would copy them onto the mesh's device. A mesh of the same ranks on their own device type, without
        # process groups (DCP only reads its coordinates), keeps them where they are.
        mesh = DeviceMesh(local.device.type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)
    with torch.no_grad():
        return DTensor.from_local(
            local.detach(), mesh, layout.placements, run_check=False, shape=layout.shape, stride=layout.stride
        )


def _outer_to_checkpoint(outer: Mapping[int, Mapping[str, Any]], optimizer: FSDPHierarchicalAveragingOptimizer) -> dict:
    """The averager's ``state_dict()["outer"]`` as DCP saves it without losing any rank's shard.

    ``{"dtensors": {"<period>/anchor/<i>": DTensor, "<period>/state/<i>/<name>": DTensor,
    "<period>/<key>/<i>": DTensor}, "shard_<k>": bytes}``: anchors, outer-state tensors shaped like their anchor,
    and every other list of tensors shaped like the anchors (``"residuals"``, ``compress``), as DTensors with the
    anchored tensors' layouts;
    everything else (the outer optimizer's ``param_groups``, step counts, tensors of other shapes) in one
    ``torch.save`` blob under this rank's shard index ``k``, written by this rank only.
    """
    layouts = optimizer.shard_layouts()
    dtensors: dict[str, DTensor] = {}
    rest: dict[int, dict[str, Any]] = {}
    for period, level in outer.items():
        anchors = list(level["anchors"])
        if len(anchors) != len(layouts):
            raise RuntimeError(
                f"The outer optimizer of period {period} holds {len(anchors)} anchors, but this rank averages "
                f"{len(layouts)} local shards: the averaged parameters changed (requires_grad?) since the anchors "
                "were taken. Keep the same parameters trainable through a run."
            )
        for i, (anchor, layout) in enumerate(zip(anchors, layouts)):
            dtensors[f"{period}/anchor/{i}"] = _as_dtensor(anchor, layout)
        saved = level["optimizer"]
        kept_state: dict[Any, dict[str, Any]] = {}
        for index, entries in saved.get("state", {}).items():
            kept: dict[str, Any] = {}
            for name, value in entries.items():
                if _shaped_like_anchor(value, index, anchors):
                    dtensors[f"{period}/state/{index}/{name}"] = _as_dtensor(value, layouts[index])
                else:
                    kept[name] = value
            kept_state[index] = kept
        # Other lists of tensors shaped like the anchors (a compressed level's error-feedback residuals): sharded
        # like them too, under their key's name.
        lists = {
            k: list(v) for k, v in level.items() if k not in ("anchors", "optimizer") and _like_anchors(v, anchors)
        }
        for key, tensors in lists.items():
            for i, (t, layout) in enumerate(zip(tensors, layouts)):
                dtensors[f"{period}/{key}/{i}"] = _as_dtensor(t, layout)
        rest[period] = {
            **{k: v for k, v in level.items() if k not in ("anchors", "optimizer", *lists)},
            "optimizer": {**{k: v for k, v in saved.items() if k != "state"}, "state": kept_state},
            "anchors": len(anchors),
            _LISTS: {k: len(v) for k, v in lists.items()},
        }
    blob = io.BytesIO()
    torch.save(rest, blob)
    return {_DTENSORS: dtensors, _shard_key(optimizer): blob.getvalue()}


def _like_anchors(value: object, anchors: list[torch.Tensor]) -> bool:
    """Whether ``value`` is a list of tensors of the anchors' number and shapes."""
    return (
        isinstance(value, (list, tuple))
        and len(value) == len(anchors)
        and all(torch.is_tensor(v) and v.shape == a.shape for v, a in zip(value, anchors))
    )


def _shaped_like_anchor(value: object, index: object, anchors: list[torch.Tensor]) -> bool:
    return (
        isinstance(index, int)
        and 0 <= index < len(anchors)
        and torch.is_tensor(value)
        and value.dim() > 0
        and value.shape == anchors[index].shape
    )


def _outer_load_template(
    metadata: Metadata, optimizer: FSDPHierarchicalAveragingOptimizer, folder: str
) -> dict[str, Any]:
    """What this rank loads of the checkpoint's outer state, read from its metadata (which has some).

    Raises:
        ValueError: if the checkpoint has outer state but none for this rank's shard index (saved with
            another number of shards per replica), or its anchors differ from this rank's tensors in number,
            full shape or dtype (anchors are float32). Local: read from the metadata, before DCP's load.
    """
    prefix = f"{_OUTER}.{_DTENSORS}."
    keys = metadata.state_dict_metadata
    shard_keys = sorted(k[len(_OUTER) + 1 :] for k in keys if k.startswith(f"{_OUTER}.shard_"))
    mine = _shard_key(optimizer)
    if mine not in shard_keys:
        raise ValueError(
            f"The checkpoint at {folder} holds outer optimizer state for shard indexes {shard_keys}, but this rank "
            f"holds {mine}: resume with the number of shards per replica that saved it."
        )
    layouts = optimizer.shard_layouts()
    local = optimizer.tensors_to_average()
    dtensors: dict[str, DTensor] = {}
    anchors: dict[str, list[int]] = {}
    for fqn, md in keys.items():
        if not fqn.startswith(prefix):
            continue
        key = fqn[len(prefix) :]
        index = int(key.split("/")[2])
        if not isinstance(md, TensorStorageMetadata) or index >= len(layouts) or tuple(md.size) != tuple(
            layouts[index].shape
        ):
            raise ValueError(
                f"The checkpoint at {folder} holds the outer optimizer entry {key!r} of shape "
                f"{tuple(getattr(md, 'size', ()))}, but this rank averages {len(layouts)} tensors"
                + (f", tensor {index} of full shape {tuple(layouts[index].shape)}" if index < len(layouts) else "")
                + ": load the checkpoint of the same model and sharding, with the same parameters trainable."
            )
        if key.split("/")[1] == "anchor":
            anchors.setdefault(key.split("/")[0], []).append(index)
            if md.properties.dtype != torch.float32:
                raise ValueError(
                    f"The checkpoint at {folder} holds the anchor {key!r} in {md.properties.dtype}, but anchors are "
                    "float32 copies of the averaged shards (as save_checkpoint writes them): load a checkpoint "
                    "save_checkpoint wrote, unchanged."
                )
        # Loaded where the anchors live (outer_state_device="cpu": on the CPU, no copy on the accelerator).
        device = optimizer.averager.outer_state_device or local[index].device
        template = torch.zeros(local[index].shape, dtype=md.properties.dtype, device=device)
        dtensors[key] = _as_dtensor(template, layouts[index])
    for period, indexes in anchors.items():
        if sorted(indexes) != list(range(len(layouts))):
            raise ValueError(
                f"The checkpoint at {folder} holds {len(indexes)} anchors for the outer optimizer of period {period}, "
                f"but this rank averages {len(layouts)} tensors: load the checkpoint of the same model and sharding, "
                "with the same parameters trainable."
            )
    return {_DTENSORS: dtensors, mine: b""}


def _outer_from_checkpoint(loaded: Mapping[str, Any], optimizer: FSDPHierarchicalAveragingOptimizer) -> dict:
    """The averager's ``state_dict()["outer"]`` back from what :func:`_outer_to_checkpoint` saved."""
    rest = torch.load(io.BytesIO(loaded[_shard_key(optimizer)]), weights_only=False)
    dtensors = loaded[_DTENSORS]
    outer: dict[int, dict[str, Any]] = {}
    for period, level in rest.items():
        count = level.pop("anchors")
        level["anchors"] = [dtensors[f"{period}/anchor/{i}"].to_local() for i in range(count)]
        for key, n in level.pop(_LISTS, {}).items():
            level[key] = [dtensors[f"{period}/{key}/{i}"].to_local() for i in range(n)]
        state = level["optimizer"]["state"]
        for key, value in dtensors.items():
            p, kind, *name = key.split("/")
            if p == str(period) and kind == "state":
                state.setdefault(int(name[0]), {})[name[1]] = value.to_local()
        outer[period] = level
    return outer

"""Checks on the tensors the wrapper averages: the same tensor on every rank, and the one the next step reads.

:class:`~hieravg_optim.HierarchicalAveragingOptimizer` averages each parameter of its
``param_groups`` in place. That is right only if every rank of an averaging subgroup holds
the same tensor (not another shard of it) and the next step reads it (not an fp32 master
copy the inner optimizer writes it from). These functions find the cases where it is not:

* :func:`check_dtensor_layout`: a DTensor split (``Shard``, ``Partial``) over ranks of one
  of this rank's averaging subgroups; local, read from the DTensor's mesh;
* :func:`rebound_param_error`: ``param_groups`` holding tensors the wrapper was not given
  (e.g. DeepSpeed's flat ZeRO partitions, after DeepSpeed took the wrapper as its client
  optimizer);
* :func:`master_copy` / :func:`master_copy_error`: an fp32 state tensor equal to a
  float16 / bfloat16 parameter after the step (apex / Transformer Engine ``FusedAdam`` with
  ``master_weights=True``);
* :func:`state_shape_error`: an optimizer state dict saved for parameters of other shapes.

None of them runs a collective: the wrapper raises their errors on every rank of the
subgroup through :func:`hieravg_optim.agreement.check_agreement`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._compat import is_dtensor
from .config import AveragingConfig
from .groups import averaging_subgroup_ranks
from .schedule import AveragingLevel
from .tensors import local_tensor, unique_params

if TYPE_CHECKING:  # annotations only: importing DTensor costs 0.7 s
    from ._compat import DTensor

__all__ = [
    "add_checked_param_group",
    "check_dtensor_layout",
    "master_copy",
    "master_copy_error",
    "own_subgroups",
    "state_shape_error",
    "rebound_param_error",
    "unique_params",
]

_HALF = (torch.float16, torch.bfloat16)

_FSDP_FIX = (
    "Use hieravg_optim.fsdp instead: shard each replica over its own ranks with shard_replica(module, mesh) and "
    "wrap the optimizer with FSDPHierarchicalAveragingOptimizer, which averages each shard only among the ranks "
    "holding that same shard."
)


def _same_shard_ranks(t: DTensor) -> tuple[list[int], set[int]] | None:
    """The mesh dims that split ``t`` across ranks, and the ranks of its mesh holding the same local tensor.

    ``None`` if this rank is not on ``t``'s mesh. A dim splits ``t`` unless its placement is ``Replicate``
    (``Shard`` and ``Partial`` do): the ranks holding this rank's local tensor are those with this rank's
    coordinate on every splitting dim.
    """
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    split = [d for d, placement in enumerate(t.placements) if not placement.is_replicate()]
    index = tuple(coordinate[d] if d in split else slice(None) for d in range(mesh.ndim))
    return split, {int(r) for r in mesh.mesh[index].flatten().tolist()}


def check_dtensor_layout(
    params: Sequence[tuple[int, int, torch.Tensor]], subgroups: Sequence[tuple[AveragingLevel, Sequence[int]]]
) -> None:
    """Raise if a DTensor of ``params`` has another shard on a rank of one of this rank's averaging ``subgroups``.

    Local, no collective: a DTensor's mesh tells which ranks hold which shard.

    Raises:
        TypeError: naming the parameter, its mesh dims and placements, the ranks and the fix.
    """
    cache: dict[tuple[int, tuple], tuple[list[int], set[int]] | None] = {}
    for g, i, p in params:
        if not is_dtensor(p):
            continue
        key = (id(p.device_mesh), tuple(p.placements))
        if key not in cache:
            cache[key] = _same_shard_ranks(p)
        layout = cache[key]
        if layout is None or not layout[0]:
            continue
        split, same = layout
        mesh_ranks = {int(r) for r in p.device_mesh.mesh.flatten().tolist()}
        for level, ranks in subgroups:
            others = sorted((mesh_ranks - same) & set(ranks))
            if others:
                names = p.device_mesh.mesh_dim_names
                dims = [f"{d} ({names[d]!r})" if names else str(d) for d in split]
                raise TypeError(
                    f"Parameter param_groups[{g}]['params'][{i}] (global shape {tuple(p.shape)}, local shape "
                    f"{tuple(p.to_local().shape)}) is a DTensor split over mesh dim(s) {', '.join(dims)} with "
                    f"placements {tuple(p.placements)}: ranks {others} hold other shards of it, but they are in "
                    f"rank {dist.get_rank()}'s averaging subgroup {list(ranks)} (period {level.period}, group size "
                    f"{level.group_size}). Averaging local shards there would mix different parts of the parameter. "
                    + _FSDP_FIX
                )


def add_checked_param_group(
    optimizer: torch.optim.Optimizer,
    param_group: dict[str, Any],
    subgroups: Sequence[tuple[AveragingLevel, Sequence[int]]],
) -> list[torch.Tensor]:
    """``optimizer.add_param_group(param_group)``, undone if :func:`check_dtensor_layout` refuses a new parameter.

    Returns:
        The parameters added.

    Raises:
        TypeError: from :func:`check_dtensor_layout`; the group is then not added.
    """
    before = len(optimizer.param_groups)
    optimizer.add_param_group(param_group)
    added = [(g, i, p) for g, i, p in unique_params(optimizer.param_groups) if g >= before]
    try:
        check_dtensor_layout(added, subgroups)
    except TypeError:
        del optimizer.param_groups[before:]
        raise
    return [p for _, _, p in added]


def own_subgroups(
    config: AveragingConfig, process_group: dist.ProcessGroup | None
) -> list[tuple[AveragingLevel, tuple[int, ...]]]:
    """This rank's averaging subgroup at each level, as global ranks, without creating any group.

    Empty if ``config`` does not fit the process group (the averager then raises) or this rank is not in it.
    """
    pg = process_group if process_group is not None else dist.group.WORLD
    try:
        global_ranks = dist.get_process_group_ranks(pg)
        with warnings.catch_warnings():  # the averager checks again, and warns once, at the caller
            warnings.simplefilter("ignore")
            config.check_world_size(len(global_ranks))
    except (ValueError, RuntimeError):
        return []
    me = dist.get_rank()
    out = []
    for level in config.levels:
        for local in averaging_subgroup_ranks(len(global_ranks), level.group_size, config.ranks_per_replica):
            ranks = tuple(sorted(global_ranks[i] for i in local))
            if me in ranks:
                out.append((level, ranks))
    return out


def master_copy(optimizer: torch.optim.Optimizer) -> tuple[int, int, torch.Tensor, object] | None:
    """The first optimizer state tensor that looks like an fp32 master copy of a float16 / bfloat16 parameter.

    A master copy: a float32 state tensor of the parameter's shape whose values, rounded to the parameter's
    dtype, equal the parameter right after a step (apex's and Transformer Engine's ``FusedAdam`` with
    ``master_weights=True``). Adam's moments never equal the weights, so they do not match; an all-zero
    parameter is skipped (its moments may be zero too), and so is a one-element parameter (a scalar weight
    of 1.0 would match Adam's ``"step"`` after one step). Costs one rounded copy of each such tensor.

    Returns:
        ``(group index, index in group, parameter, state key)``, or ``None``.
    """
    state = optimizer.state
    for g, i, p in unique_params(optimizer.param_groups):
        if p.dtype not in _HALF:
            continue
        entries = state.get(p) if hasattr(state, "get") else None
        if not entries:
            continue
        local = local_tensor(p)
        if p.numel() < 2 or local.numel() == 0 or not bool(local.any()):
            continue
        for key, value in entries.items():
            if not torch.is_tensor(value) or value.dtype != torch.float32 or value.shape != p.shape:
                continue
            value = local_tensor(value)
            if value.shape == local.shape and value.to(device=local.device, dtype=local.dtype).equal(local):
                return g, i, p, key
    return None


def rebound_param_error(
    param_groups: Sequence[Mapping[str, Any]], given: Mapping[int, torch.Tensor], owner: str
) -> RuntimeError | None:
    """The error for the first parameter of ``param_groups`` that is not one of ``given`` (by id), or ``None``.

    Costs one dict lookup per parameter.

    Args:
        param_groups: The inner optimizer's parameter groups.
        given: The parameters the wrapper was constructed over or given through its ``add_param_group``,
            by ``id``.
        owner: The wrapper's class name, for the message.
    """
    for g, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) in given:
                continue
            flat = (
                " A 1-D tensor there is the flat fp32 partition of a DeepSpeed ZeRO / BF16 optimizer "
                "that took this wrapper as its client optimizer: it holds a different part of the model "
                "on each rank. Pass the inner optimizer to hieravg_optim.deepspeed.initialize with a "
                '"hierarchical_averaging" section instead; the section does the averaging.'
                if p.dim() == 1
                else ""
            )
            return RuntimeError(
                f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}, dtype {p.dtype}) is not one of "
                f"the {len(given)} parameters this {owner} was constructed over or given "
                f"through its add_param_group: something rebound the inner optimizer's param_groups "
                f"behind the wrapper, so averaging them may mix different tensors across ranks.{flat} "
                "Otherwise add parameter groups through the wrapper's add_param_group, never to the "
                "inner optimizer or by assigning param_groups."
            )
    return None


def master_copy_error(optimizer: torch.optim.Optimizer, owner: str) -> ValueError | None:
    """The error for the first fp32 master copy :func:`master_copy` finds in ``optimizer``'s state, or ``None``.

    Args:
        optimizer: The inner optimizer, after a step.
        owner: The wrapper's class name, for the message.
    """
    found = master_copy(optimizer)
    if found is None:
        return None
    g, i, p, key = found
    return ValueError(
        f"The inner optimizer {type(optimizer).__name__} keeps an fp32 copy of parameter "
        f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}, dtype {p.dtype}) in its state "
        f"under {key!r}, equal to the parameter after the step: a master weight, from which its next "
        "step writes the parameter. Averaging the parameter would be undone by that step. Pass "
        "tensors_to_average=lambda: [...] returning the master copies (e.g. "
        f"[inner.state[p][{key!r}] for p in params]) to {owner}. (If that state "
        "tensor is not a master weight, pass tensors_to_average returning the parameters.)"
    )


def state_shape_error(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> ValueError | None:
    """Why ``state_dict`` (an inner optimizer state dict) was saved for parameters of other shapes, or ``None``.

    ``torch.optim.Optimizer.load_state_dict`` checks only the number of parameters per group, so a state dict of
    another model (a layer resized) loads, and the next step fails inside the optimizer. Checked here, for torch's
    own optimizers (``torch.optim``, not ``LBFGS``, whose state is one flat vector): every state tensor that is
    not a scalar must broadcast to its parameter's shape (equal for Adam's moments or a momentum buffer;
    Adafactor's factors broadcast). Other optimizers keep state of their own shapes (quantisation tables, blocks)
    and are not checked. Local, no collective; changes nothing.
    """
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or isinstance(optimizer, torch.optim.LBFGS):
        return None
    saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, Sequence) or not isinstance(state, Mapping):
        return None  # torch's load_state_dict names a malformed state dict
    for g, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        for i, (key, p) in enumerate(zip(saved.get("params", ()), group["params"])):
            for name, value in (state.get(key) or {}).items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape == p.shape:
                    continue
                try:
                    fits = torch.broadcast_shapes(value.shape, p.shape) == p.shape
                except RuntimeError:
                    fits = False
                if not fits:
                    return ValueError(
                        f"The optimizer state dict was saved for parameters of other shapes: state {name!r} of "
                        f"parameter {i} of param_groups[{g}] (key {key!r}) has shape {tuple(value.shape)}, the "
                        f"parameter {tuple(p.shape)}. Load the state dict of the same model (same layer sizes), or "
                        "leave the optimizer state out to start it afresh."
                    )
    return None

"""The patches of a DeepSpeed engine: the step hook, per-replica checkpoints, ZeRO-3's trace check.

:func:`attach` hooks a :class:`~hieravg_optim.deepspeed.DeepSpeedAveraging` into its engine:
its ``after_engine_step`` runs after every engine optimizer step (and a direct step of the engine's
optimizer, outside ``engine.step()``, raises: :func:`refuse_direct_optimizer_steps`), ``save_checkpoint`` /
``load_checkpoint`` keep each replica in its own folder (:func:`wrap_checkpoints`, the files of
:mod:`hieravg_optim.deepspeed.checkpoint`) and, under ZeRO-3, the trace checks compare the
ranks of one replica (:func:`keep_trace_checks_in_replica`). Written against DeepSpeed 0.19.8.
"""

from __future__ import annotations

import contextvars
import inspect
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .._compat import process_group_timeout
from ..agreement import agree_across_ranks
from ..faults import named_collective
from .checkpoint import (
    CHECKPOINT_KEY,
    outer_state_file,
    replica_checkpoint_dir,
    save_outer_state,
    with_outer_state,
    write_latest,
)
from .engine import DeepSpeedAveraging

__all__ = ["attach", "get_averaging", "keep_trace_checks_in_replica", "refuse_direct_optimizer_steps", "wrap_checkpoints"]

_ATTRIBUTE = "hierarchical_averaging"
"""The engine attribute holding its :class:`DeepSpeedAveraging`."""


def get_averaging(engine: Any) -> DeepSpeedAveraging | None:
    """The :class:`DeepSpeedAveraging` of an engine built by :func:`initialize`, or ``None``."""
    return engine.__dict__.get(_ATTRIBUTE)


def attach(engine: Any, state: DeepSpeedAveraging) -> None:
    """Attach ``state`` to ``engine`` as ``engine.hierarchical_averaging``, and hook it into the engine.

    ``state.after_engine_step()`` then runs after every engine optimizer step (``_take_model_step``),
    ``save_checkpoint`` / ``load_checkpoint`` keep each replica in its own folder (see
    :func:`wrap_checkpoints`) and, under ZeRO-3, the trace checks run within the replica (see
    :func:`keep_trace_checks_in_replica`).

    Raises:
        NotImplementedError: if the engine lacks a method this adapter wraps (a DeepSpeed other than 0.19).
    """
    for name in ("_take_model_step", "save_checkpoint", "load_checkpoint"):
        if not callable(getattr(type(engine), name, None)):
            import deepspeed

            raise NotImplementedError(
                f"DeepSpeedEngine.{name} is missing in DeepSpeed {deepspeed.__version__}; hieravg_optim.deepspeed "
                "is written for DeepSpeed 0.19. Use HierarchicalAveragingOptimizer with plain DDP instead."
            )
    original_take_model_step = engine._take_model_step
    in_engine_step = [False]

    def _take_model_step(*args: Any, **kwargs: Any) -> Any:
        in_engine_step[0] = True
        try:
            out = original_take_model_step(*args, **kwargs)
        finally:
            in_engine_step[0] = False
        state.after_engine_step()
        return out

    wrap_checkpoints(engine, state)
    engine._take_model_step = _take_model_step
    refuse_direct_optimizer_steps(engine, in_engine_step)
    engine.__dict__[_ATTRIBUTE] = state
    if state.kind == "zero3":
        keep_trace_checks_in_replica(engine, state.mpu.get_data_parallel_group())


def refuse_direct_optimizer_steps(engine: Any, in_engine_step: list[bool]) -> None:
    """Make ``engine.optimizer.step()`` raise when called outside ``engine.step()``.

    The averaging runs after the engine's optimizer step; a caller that steps DeepSpeed's optimizer
    itself would train with no averaging and no count, without a word. Lightning Fabric 2.6's
    ``DeepSpeedStrategy`` does so: its optimizer wrapper calls ``engine.step()`` only for an engine that
    passes its ``Optimizable`` check (``param_groups``, ``defaults``, ``state``), which DeepSpeed 0.19's
    engine does not, and else steps ``engine.optimizer`` directly. The error is local, raised at the same
    call on every rank that runs the same loop.
    """
    optimizer = engine.optimizer
    if optimizer is None:
        return
    original_step = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        if not in_engine_step[0]:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() was called directly on a DeepSpeed engine with hierarchical "
                "averaging; the averaging runs in engine.step(), after the optimizer step. Call engine.step() "
                "instead (under Lightning Fabric's DeepSpeedStrategy: fabric.strategy.model.step() instead of "
                "optimizer.step(); the engine then also steps the LR scheduler given to fabric.setup)."
            )
        return original_step(*args, **kwargs)

    optimizer.step = step


def wrap_checkpoints(engine: Any, state: DeepSpeedAveraging) -> None:
    """Make ``engine.save_checkpoint`` / ``load_checkpoint`` keep each replica in its own folder.

    Both keep DeepSpeed's signatures. ``save_checkpoint`` writes to
    ``replica_checkpoint_dir(save_dir, replica)`` with the averaging state in the client state,
    and ``latest`` for every replica (DeepSpeed writes it on global rank 0 only). With outer
    optimizers, every rank first writes its anchors and outer optimizer state to
    :func:`~hieravg_optim.deepspeed.checkpoint.outer_state_file` in the tag's folder (atomically: a
    temporary file, then a rename), so that they are there before ``latest`` names the tag.
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
    check_tag = engine._checkpoint_tag_validation
    # The tag DeepSpeed sees, replica_<k>, differs between replicas by design: the tag given is checked instead.
    engine._checkpoint_tag_validation = lambda tag: None
    replica_tag = os.path.basename(replica_checkpoint_dir("", state.replica_index))
    world = list(range(dist.get_world_size()))
    group = state.averager.timed_process_group
    timeout = process_group_timeout(group)
    timeout_s = None if timeout is None else timeout.total_seconds()

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        saved_tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        check_tag(saved_tag)  # collective over the world, as in DeepSpeed's save_checkpoint
        folder = replica_checkpoint_dir(save_dir, state.replica_index, saved_tag)
        os.makedirs(folder, exist_ok=True)
        client = dict(client_state or {})
        averaging = dict(state.state_dict())
        # Before DeepSpeed's save, and before "latest" names the tag.
        save_outer_state(averaging, folder, state.mpu.get_data_parallel_rank())
        client[CHECKPOINT_KEY] = averaging
        out = original_save(
            os.path.join(os.fspath(save_dir), saved_tag),
            tag=replica_tag,
            client_state=client,
            save_latest=False,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        with named_collective(
            f"the barrier after saving the checkpoint under {os.fspath(save_dir)}", world, timeout_s=timeout_s
        ):
            dist.barrier(group=group)
        if save_latest:
            if dist.get_rank() == 0:
                write_latest(save_dir, saved_tag)
            with named_collective(
                f"the barrier after naming {saved_tag} in {os.fspath(save_dir)}/latest", world, timeout_s=timeout_s
            ):
                dist.barrier(group=group)
        return out

    def load_checkpoint(load_dir, tag=None, *args: Any, **kwargs: Any):
        folder, folder_tag = _replica_to_load(load_dir, tag, state.replica_index, replica_tag)
        module_only = _load_module_only(original_load, tag, args, kwargs)
        error: BaseException | None = None
        staged: tuple[dict[str, Any], Any] | None = None
        try:
            load_path, client_state = original_load(folder, folder_tag, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. a truncated file of this replica: raised on every rank below
            load_path, client_state, error = None, None, exc
        if load_path is not None:
            client_state = dict(client_state or {})
            saved = client_state.pop(CHECKPOINT_KEY, None)
            if module_only:
                # DeepSpeed keeps the engine's global_steps and its optimizer: the averaging state is the
                # optimizer's kind, so it is not loaded either, and the count stays the engine's step.
                saved = {"step": engine.global_steps}
            elif saved is None:
                warnings.warn(
                    f"The checkpoint {load_path} has no hierarchical averaging state; the averaging schedule resumes "
                    f"at the engine's global step {engine.global_steps}.",
                    UserWarning,
                    stacklevel=2,
                )
                saved = {"step": engine.global_steps}
            tag_dir = os.path.dirname(load_path)
            dp_rank = state.mpu.get_data_parallel_rank()
            try:
                try:
                    loaded = with_outer_state(saved, tag_dir, dp_rank, state.outer_state_location())
                    staged = (loaded, state.check_state(loaded))
                except ValueError as exc:
                    # Local: raised on every rank by the agreement below, before any other collective.
                    raise ValueError(
                        f"Loading the averaging state of the checkpoint {load_path} (this rank's outer optimizer state "
                        f"in {outer_state_file(tag_dir, dp_rank)}): "
                        f"{exc} Resume with the model, trainable parameters, ZeRO stage and ranks_per_replica that "
                        "saved it. The averaging state is unchanged (DeepSpeed has loaded the engine's weights)."
                    ) from exc
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement below
                error, staged = exc, None
        # DeepSpeed only logs a warning for a missing checkpoint: a replica without one (resuming with more
        # replicas than were saved) would silently start from fresh weights while the others resume. One
        # collective checks that, and that every rank could restore its averaging state, before any rank
        # changes it: a load that fails on one rank leaves the averaging state of every rank as it was.
        agree_across_ranks(
            f"whether their replica found a checkpoint under {os.fspath(load_dir)} (True: found)",
            load_path is not None,
            state.averager.timed_process_group,
            error=error,
            fix="Every replica loads its own folder: resume with the world size and ranks_per_replica that saved "
            "the checkpoint, or on none of the replicas.",
        )
        if staged is not None:
            loaded, parsed = staged
            state.commit_state(loaded, parsed)
            if state.averager.needs_anchors:
                # A checkpoint without outer state (saved without outer optimizers, or loaded with
                # load_module_only), past the warm-up: anchors at the loaded weights; the first round averages
                # them over its group.
                state.take_anchors()
        return load_path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def _load_module_only(original_load: Callable[..., Any], tag: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """The ``load_module_only`` argument of a call of DeepSpeed's ``load_checkpoint(load_dir, tag, ...)``."""
    try:
        bound = inspect.signature(original_load).bind("", tag, *args, **kwargs)
    except TypeError:  # DeepSpeed raises its own error for the call
        return False
    return bool(bound.arguments.get("load_module_only", False))


def _replica_to_load(load_dir: Any, tag: Any, replica_index: int, replica_tag: str) -> tuple[str, str | None]:
    """``(folder, tag)`` for DeepSpeed's ``load_checkpoint`` of this replica: ``(<load_dir>/<tag>, replica_<k>)``,
    ``tag`` read from ``<load_dir>/latest`` if ``None``; else the earlier layout's ``(<load_dir>/replica_<k>, tag)``."""
    named = tag
    if named is None:
        latest = os.path.join(os.fspath(load_dir), "latest")
        if os.path.isfile(latest):
            with open(latest) as fd:
                named = fd.read().strip()
    if named is not None and os.path.isdir(replica_checkpoint_dir(load_dir, replica_index, str(named))):
        return os.path.join(os.fspath(load_dir), str(named)), replica_tag
    # The earlier layout; with the tag given only (else DeepSpeed reads the replica folder's own latest, and finds
    # nothing when this replica's folder is missing: the agreement after the load then raises on every rank).
    return replica_checkpoint_dir(load_dir, replica_index), tag


_TRACE_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("hieravg_zero3_trace_group", default=None)
"""The replica group while a replica engine's ZeRO-3 coordinator checks its trace; ``None`` otherwise."""


def _assert_ints_same_in_replica(original: Callable[[list[int]], None]) -> Callable[[list[int]], None]:
    """DeepSpeed's ``assert_ints_same_as_other_ranks``, over the replica group while one is set."""

    def assert_ints_same(ints: list[int]) -> None:
        group = _TRACE_GROUP.get()
        if group is None:
            return original(ints)
        lists: list[Any] = [None] * dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        with named_collective("ZeRO-3's check of the forward trace within the replica", ranks):
            dist.all_gather_object(lists, list(ints), group=group)
        if any(other != lists[0] for other in lists):
            raise RuntimeError(
                "ZeRO-3: the ranks of one replica recorded different module or parameter orders in their "
                f"forward passes (ranks {ranks}: {lists}); the ranks of a replica must run the same modules "
                "in the same order."
            )
        return None

    assert_ints_same._hieravg_original = original  # type: ignore[attr-defined]
    return assert_ints_same


def keep_trace_checks_in_replica(engine: Any, group: dist.ProcessGroup) -> None:
    """Make the ZeRO-3 engine's trace checks compare the ranks of ``group`` (its replica), not the world.

    DeepSpeed's ZeRO-3 parameter coordinator records the order in which the forward pass uses the
    submodules and, in ``reset_step`` (at the start of every forward until the trace is complete),
    checks that every rank recorded the same order with ``assert_ints_same_as_other_ranks``, a
    broadcast from global rank 0 over the whole world. Parameters are partitioned and gathered
    within the replica only, so the order must agree within it; replicas may differ (a forward whose
    branch depends on the replica's data or index), and with the world-wide check they fail with
    "Detected a disagreement ... between rank0 and rank<k>". After this call, the checks issued from
    this engine's ``reset_step`` all-gather the orders over ``group`` instead and raise a
    ``RuntimeError`` on every rank of the replica when they differ. Other engines in the process are
    unaffected. DeepSpeed's debugging checks (``safe_mode`` all-gathers, ``enable_sanity_checks``)
    still compare the whole world.

    .. warning::
        The checks become collectives over ``group``: every rank of it runs the same forwards, as
        ZeRO-3 requires anyway.
    """
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    current = ppc.assert_ints_same_as_other_ranks
    if not hasattr(current, "_hieravg_original"):
        ppc.assert_ints_same_as_other_ranks = _assert_ints_same_in_replica(current)
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    reset_step = coordinator.reset_step

    def reset_step_in_replica(*args: Any, **kwargs: Any) -> Any:
        token = _TRACE_GROUP.set(group)
        try:
            return reset_step(*args, **kwargs)
        finally:
            _TRACE_GROUP.reset(token)

    coordinator.reset_step = reset_step_in_replica

"""Non-finite values (NaN, infinity): the check, the ``nonfinite`` policy of a round, the repair of the inner state.

* :func:`has_nonfinite`: whether a list of tensors holds one; local, read once;
* :func:`skip_nonfinite`: ``nonfinite="raise"`` or ``"skip_replica"`` applied to the ranks of a round's group
  that the agreement found non-finite: raise on every rank, or the number of finite replicas to divide by;
* :func:`zero_nonfinite_state` / :func:`repair_skipped_replica_state`: the inner optimizer's state of a
  replica that a round gave the finite replicas' mean.

The ranks agree on each rank's flag in the round's agreement collective
(:func:`hieravg_optim.agreement.check_agreement`), after the replica's vote (:mod:`hieravg_optim.replica`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # types only: agreement re-exports has_nonfinite, so this module imports nothing of the package
    from .config import AveragingConfig
    from .groups import LevelGroup

__all__ = ["has_nonfinite", "repair_skipped_replica_state", "skip_nonfinite", "zero_nonfinite_state"]

logger = logging.getLogger(__package__ + ".optimizer")
"""The logger of the averaging rounds' warnings, ``hieravg_optim.optimizer`` as for the metrics."""


def has_nonfinite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any element of ``tensors`` is a NaN or an infinity; local, no collective.

    Exact, and read once: one reduction of every tensor, propagating NaN and infinities, checked together per
    (device, dtype) with one host synchronisation per group (one in all for a model of one dtype on one
    device). On CPU the reduction is the sum (``Tensor.sum``, float16 summed in float32), the cheapest read
    there (15-25% faster than the 2-norm's squares on a free core, as fast where the memory is the bottleneck,
    ``bench/nonfinite.py``); elsewhere the 2-norm, one
    ``torch._foreach_norm`` call per group (one fused pass on CUDA, as in ``torch.nn.utils.clip_grad_norm_``;
    float16 in float32). Either is non-finite whenever an element is (NaN plus anything is NaN, an infinity
    plus a finite value an infinity, two opposite infinities NaN); it can also be non-finite for finite
    elements whose sum (magnitudes near 3.4e38 in float32) or squares (beyond about 1.8e19) overflow, so
    only a tensor whose reduction is non-finite is then checked element by element, which tells the two
    apart. Complex tensors are checked as their real view, float8 ones as a float32 copy (torch has no sum or
    norm kernel for them). Extra memory: one scalar per tensor (plus, only
    for a tensor whose reduction is non-finite, a bool tensor of its size). Cost measured in
    ``bench/nonfinite.py`` and ``bench/averaging.py`` (``docs/faults.md``).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() and (t.is_floating_point() or t.is_complex()):
            t = torch.view_as_real(t) if t.is_complex() else t
            if t.element_size() == 1:  # float8: no sum or norm kernel; read as float32 (exact), a copy
                t = t.float()
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), members in groups.items():
        wide = torch.float32 if dtype == torch.float16 else None  # float16 sums and norms overflow at 65504
        with torch.no_grad():
            if device.type == "cpu":
                reduced = [t.sum(dtype=wide) for t in members]
            else:
                reduced = list(torch._foreach_norm(members, 2, dtype=wide))
            finite = torch.isfinite(torch.stack(reduced))
        if bool(finite.all()):
            continue
        # A non-finite reduction: a non-finite element, or finite elements whose sum or squares overflowed.
        if any(not bool(torch.isfinite(t).all()) for t, ok in zip(members, finite.tolist()) if not ok):
            return True
    return False


def skip_nonfinite(
    config: AveragingConfig,
    process_group: dist.ProcessGroup,
    lg: LevelGroup,
    bad: list[int],
    round_name: str,
    *,
    anchors: bool,
) -> int:
    """Apply ``config.nonfinite`` to the ranks ``bad`` of ``lg`` whose tensors are non-finite.

    Every rank of the group gets the same ``bad`` (from :func:`hieravg_optim.agreement.check_agreement`), so
    every rank raises, or every rank goes on to the same collective. Returns the number of finite replicas to
    divide by; a non-finite rank then adds zeros to the sum (``average_tensors_(contribute_zeros=True)``).
    ``anchors``: the round also checked the level's anchors (not yet averaged over the group), named in the
    messages.
    """
    rpr = config.ranks_per_replica
    replicas = sorted({dist.get_group_rank(process_group, r) // rpr for r in bad})
    named = f"rank{'s' if len(bad) > 1 else ''} {bad} (replica{'s' if len(replicas) > 1 else ''} {replicas})"
    if anchors:
        named = f"{named} (or in the anchors of the outer optimizer, taken there and not yet averaged)"
    if config.compress and lg.level in config.levels and config.level_compress(config.levels.index(lg.level)):
        named = (
            f"{named} (or in the delta encoded at this compressed level, anchor - theta + ef_decay * residual, "
            "which overflows float32 for large finite tensors)"
        )
    finite = lg.size - len(bad)
    if config.nonfinite == "raise" or finite == 0:
        cause = (
            "every replica of the group holds non-finite values, so there is no finite replica to average"
            if finite == 0
            else 'averaging would spread them to every replica of the group (nonfinite="raise")'
        )
        raise RuntimeError(
            f"Non-finite values (NaN or infinity) in the tensors of {named} before {round_name}, in the group of "
            f"ranks {list(lg.ranks)}: {cause}. Every rank of the group raises. Lower the learning rate or clip "
            'the gradients, resume from an earlier checkpoint, or pass nonfinite="skip_replica" to average the '
            "finite replicas only and give the others that mean."
        )
    if dist.get_rank() == lg.ranks[0]:
        logger.warning(
            "%s: non-finite values in %s; averaging the %d finite replicas of the group of ranks %s, and giving "
            "the others their mean (nonfinite=\"skip_replica\")",
            round_name,
            named,
            finite,
            list(lg.ranks),
        )
    return finite


def zero_nonfinite_state(inner: torch.optim.Optimizer) -> list[str]:
    """Set every NaN and infinity in ``inner``'s state tensors to 0, in place; local, no collective.

    For a replica whose averaged tensors ``nonfinite="skip_replica"`` has just replaced by the
    finite replicas' mean: a NaN gradient that reached the inner step leaves NaN in its state too
    (SGD's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq``), and the next inner step
    would write it back into the parameters, so that the replica is skipped again at every round.
    The state restarts at 0 at those elements only (as a fresh optimizer's moments do); finite
    elements and the ``"step"`` counts are left as they are. Every floating-point and complex
    tensor of ``inner.state`` is checked (:func:`has_nonfinite`), one read.

    Returns:
        The entries changed, as ``"state[i][name]"`` (``i`` the parameter's index in ``param_groups``,
        else its position in ``state``), in order; empty if the state was finite.
    """
    index = {id(p): i for i, p in enumerate(p for group in inner.param_groups for p in group["params"])}
    changed = []
    with torch.no_grad():
        for position, (param, entry) in enumerate(inner.state.items()):
            if not isinstance(entry, Mapping):
                continue
            for name, value in entry.items():
                if torch.is_tensor(value) and (value.is_floating_point() or value.is_complex()) and has_nonfinite([value]):
                    torch.nan_to_num_(value, nan=0.0, posinf=0.0, neginf=0.0)
                    changed.append(f"state[{index.get(id(param), position)}][{name!r}]")
    return changed


def repair_skipped_replica_state(inner: object, count: int) -> list[str]:
    """:func:`zero_nonfinite_state` on ``inner`` after the round at ``count`` replaced this replica's tensors.

    Logs a warning naming the changed entries through the ``hieravg_optim.optimizer`` logger. A no-op
    for an ``inner`` that is not a ``torch.optim.Optimizer``. Local, no collective.

    Returns:
        The entries changed (see :func:`zero_nonfinite_state`).
    """
    if not isinstance(inner, torch.optim.Optimizer):
        return []
    changed = zero_nonfinite_state(inner)
    if changed:
        logger.warning(
            "rank %s: the averaging round at step %d gave this replica the finite replicas' mean "
            "(nonfinite=\"skip_replica\"); its inner optimizer's state held non-finite values too, set to 0 in %s",
            torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            count,
            ", ".join(changed),
        )
    return changed

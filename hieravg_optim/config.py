"""One validated configuration object for hierarchical averaging.

The core works on a tuple of :class:`~hieravg_optim.schedule.AveragingLevel`.
At the API edge it also accepts torch's seed-style mapping ``{period: group_size}``
(the ``period_group_size_dict`` of ``HierarchicalModelAverager``); JSON objects,
whose keys are strings, are accepted too, so ``{"4": 8, "32": 16}`` works.

Every check here is local: it raises on every rank, before any collective.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from .comm_dtype import CommDtype, parse_comm_dtype
from .schedule import AveragingLevel

__all__ = [
    "NONFINITE_POLICIES",
    "AveragingConfig",
    "check_collective_timeout_s",
    "check_nonfinite",
    "is_int",
    "parse_levels",
    "resolve_ranks_per_node",
    "warn_at_caller",
]

NONFINITE_POLICIES = ("raise", "skip_replica", "ignore")
"""The values of ``nonfinite``: what an averaging round does when a replica holds a NaN or an infinity."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _in_package(filename: str) -> bool:
    """Whether ``filename`` is a module of this package or of its subpackages (the adapters)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside this package: the user's call.

    A fixed ``stacklevel`` is wrong as soon as the same check is reached through
    different call depths (the wrapper, the averager, the DeepSpeed adapter).
    """
    frame = sys._getframe(1)
    level = 2
    while frame is not None and _in_package(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (a Python or numpy integer), ``bool`` excluded."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_float(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range: rejected as infinite
        return math.inf


def _as_int(value: object, what: str) -> int:
    """``value`` as an int if it is an integer or a JSON key spelling one, else ``ValueError``."""
    if is_int(value):
        return int(value)  # type: ignore[arg-type]
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    raise ValueError(f"{what} must be a positive integer, got {value!r} ({type(value).__name__}).")


def resolve_ranks_per_node(value: int | str | None) -> int | None:
    """``ranks_per_node`` as an int or ``None``; ``"auto"`` reads ``LOCAL_WORLD_SIZE``, else ``LOCAL_SIZE``.

    Raises:
        ValueError: for ``"auto"`` when neither variable holds a positive integer, or another string.
    """
    if not isinstance(value, str):
        return int(value) if is_int(value) else value  # type: ignore[return-value]  # checked in __post_init__
    if value != "auto":
        raise ValueError(f'ranks_per_node must be a positive integer, "auto" or None, got {value!r}.')
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):  # torchrun, deepspeed launcher
        found = os.environ.get(var)
        if found is not None and found.isdigit() and int(found) > 0:
            return int(found)
    raise ValueError(
        'ranks_per_node="auto" reads the ranks of one node from LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE '
        "(deepspeed launcher), but neither is set: pass ranks_per_node as a number of ranks."
    )


def parse_levels(
    period_group_size: Mapping[int | str, int] | Iterable[AveragingLevel | tuple[int, int]],
) -> tuple[AveragingLevel, ...]:
    """Turn ``{period: group_size}`` (or a sequence of levels or pairs) into levels.

    The order is the order given; :class:`AveragingConfig` checks that the periods
    strictly increase. Keys may be ints or, as in JSON, strings of digits.

    Raises:
        ValueError: if it is empty, or a period or group size is not an integer.
        TypeError: if ``period_group_size`` is neither a mapping nor an iterable of pairs.
    """
    if isinstance(period_group_size, Mapping):
        pairs = list(period_group_size.items())
    elif isinstance(period_group_size, Iterable) and not isinstance(period_group_size, (str, bytes)):
        pairs = []
        for item in period_group_size:
            if isinstance(item, AveragingLevel):
                pairs.append((item.period, item.group_size))
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                pairs.append((item[0], item[1]))
            else:
                raise TypeError(
                    f"period_group_size items must be AveragingLevel or (period, group_size) pairs, got {item!r}."
                )
    else:
        raise TypeError(
            "period_group_size must be a mapping {period: group_size}, e.g. {4: 8, 32: 16}, "
            f"got {type(period_group_size).__name__}."
        )
    if not pairs:
        raise ValueError(
            "period_group_size must not be empty: give at least one {period: group_size}, "
            "the last group size being the size of the process group."
        )
    levels = []
    for period, group_size in pairs:
        period_int = _as_int(period, f"Period {period!r} in period_group_size")
        if not is_int(group_size):
            raise ValueError(
                f"Group size {group_size!r} of period {period!r} in period_group_size must be a positive integer "
                f"(a number of ranks), got {type(group_size).__name__}."
            )
        levels.append(AveragingLevel(period=period_int, group_size=int(group_size)))
    return tuple(levels)


MAX_COLLECTIVE_TIMEOUT_S = 1e9
"""The largest ``collective_timeout_s``, in seconds (about 31.7 years). Larger ones overflow in gloo, whose
deadlines count nanoseconds: with torch 2.13, 9.2e9 s hung the first all-reduce and 9.3e9 s timed it out at once."""


def check_collective_timeout_s(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is ``None`` or a positive, finite number of seconds, at most
    :data:`MAX_COLLECTIVE_TIMEOUT_S` (a larger one overflows in the backend: a hang, or a timeout at once)."""
    if value is not None and (
        not _is_real(value) or not 0 < _as_float(value) <= MAX_COLLECTIVE_TIMEOUT_S or not math.isfinite(_as_float(value))
    ):
        raise ValueError(
            f"collective_timeout_s must be a positive, finite number of seconds, at most {MAX_COLLECTIVE_TIMEOUT_S:g} "
            f"(larger ones overflow in the backend), or None (the process group's timeout), got {value!r} "
            f"({type(value).__name__}). Pass e.g. collective_timeout_s=300 to let a dead or hung peer be reported "
            "after 5 minutes."
        )


def check_nonfinite(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is one of :data:`NONFINITE_POLICIES`."""
    if not isinstance(value, str) or value not in NONFINITE_POLICIES:
        raise ValueError(
            f"nonfinite must be one of {list(NONFINITE_POLICIES)}, got {value!r}: \"raise\" (the default) raises on "
            "every rank of the group, \"skip_replica\" averages only the finite replicas, \"ignore\" does not check."
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class AveragingConfig:
    """The validated settings of :class:`~hieravg_optim.HierarchicalAveragingOptimizer`.

    Build it with :meth:`create`, which accepts torch's ``{period: group_size}``
    mapping. Fields are checked in ``__post_init__``; the checks that need the size
    of the process group are in :meth:`check_world_size`.
    """

    levels: tuple[AveragingLevel, ...]
    """The hierarchy, periods strictly increasing; the last level spans the whole process group."""

    warmup_steps: int = 0
    """Step counts below this never average (post-local SGD's warm-up), in optimizer steps."""

    ranks_per_replica: int = 1
    """Consecutive ranks that together hold one replica (1: every rank holds the full model).

    Those ranks reduce gradients every step (DDP, ZeRO, FSDP) and may each hold a
    different shard. A level of group size G averages among the G / ranks_per_replica
    ranks of its block that hold the same shard index."""

    bucket_cap_mb: float = 25.0
    """Upper bound of one communication bucket, in MB (10**6 bytes), per wire dtype."""

    comm_dtype: tuple[str | None, ...] = ()
    """The wire dtype name of each level, in level order (``None``: each tensor's own dtype); ``()`` when
    every level sends each tensor in its own dtype. Given as one value or ``{period: dtype}``, see
    :func:`hieravg_optim.comm_dtype.parse_comm_dtype`."""

    ranks_per_node: int | None = None
    """Consecutive ranks that share a node (fast links), or ``None`` for a flat all-reduce at every level.

    When set, a level whose groups span several nodes averages node-aware: reduce-scatter inside each
    node, all-reduce of the shards across nodes, all-gather inside the node."""

    synchronous_warmup: bool = False
    """Average at the top level (all replicas) after every warm-up step (counts ``0 .. warmup_steps - 1``).

    Post-local SGD (https://arxiv.org/abs/1808.07217) warms up with fully synchronous
    training. ``False`` (torch's ``HierarchicalModelAverager``): warm-up steps never average,
    and something else keeps the replicas in step (DDP's post-local SGD hook all-reduces the
    gradients globally). ``True``: the replicas, starting from the same weights, end every
    warm-up step with the same weights; with SGD (with or without momentum) this is exactly
    synchronous SGD over all ranks. The DeepSpeed and FSDP adapters turn it on by default."""
    collective_timeout_s: float | None = None
    """Timeout of the averaging subgroups' collectives, in seconds; ``None``: the process group's timeout.

    A peer that died is usually reported at once (its connections close); one that hangs (stopped,
    swapped out, deadlocked) only after this timeout. With a timeout given, the top level gets its own
    group too, even where it spans the whole process group."""

    nonfinite: Literal["raise", "skip_replica", "ignore"] = "raise"
    """What a round does when a replica's tensors hold a NaN or an infinity: ``"raise"`` on every rank
    of the group, naming the replicas; ``"skip_replica"``: average the finite replicas only and give the
    others that mean; ``"ignore"``: no check (the non-finite values spread to every replica). A sharded replica
    (``ranks_per_replica > 1``) is non-finite when any of its shards is, in every shard's group."""

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("levels must not be empty.")
        if self.ranks_per_node is not None and (not is_int(self.ranks_per_node) or self.ranks_per_node <= 0):
            raise ValueError(
                f"ranks_per_node must be a positive integer (ranks of one node), \"auto\" or None, got "
                f"{self.ranks_per_node!r}."
            )
        previous = 0
        for level in self.levels:
            if not is_int(level.period) or level.period <= 0:
                raise ValueError(
                    f"Period {level.period!r} in period_group_size must be a positive integer (in optimizer steps)."
                )
            if level.period <= previous:
                periods = [lv.period for lv in self.levels]
                raise ValueError(
                    f"Periods in period_group_size must be strictly increasing, got {periods}: "
                    f"period {level.period} follows {previous}. List them from the most to the least frequent."
                )
            previous = level.period
            if not is_int(level.group_size) or level.group_size <= 0:
                raise ValueError(
                    f"Group size {level.group_size!r} of period {level.period} must be a positive integer (ranks)."
                )
        comm = self.comm_dtype
        if isinstance(comm, tuple) and len(comm) in (0, len(self.levels)):  # per level, as stored
            comm = dict(zip((lv.period for lv in self.levels), comm))
        object.__setattr__(self, "comm_dtype", parse_comm_dtype(comm, self.levels))
        if not is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer (steps), got {self.warmup_steps!r}.")
        if not is_int(self.ranks_per_replica) or self.ranks_per_replica <= 0:
            raise ValueError(
                f"ranks_per_replica must be a positive integer (ranks), got {self.ranks_per_replica!r}."
            )
        if (
            isinstance(self.bucket_cap_mb, bool)
            or not isinstance(self.bucket_cap_mb, numbers.Real)
            or not self.bucket_cap_mb > 0
            or not math.isfinite(self.bucket_cap_mb)
        ):
            raise ValueError(f"bucket_cap_mb must be a positive, finite number of MB, got {self.bucket_cap_mb!r}.")
        if not isinstance(self.synchronous_warmup, bool):
            raise ValueError(
                f"synchronous_warmup must be True or False, got {self.synchronous_warmup!r} "
                f"({type(self.synchronous_warmup).__name__})."
            )
        check_collective_timeout_s(self.collective_timeout_s)
        check_nonfinite(self.nonfinite)

    @classmethod
    def create(
        cls,
        period_group_size: Mapping[int | str, int] | Iterable[AveragingLevel | tuple[int, int]],
        *,
        warmup_steps: int = 0,
        ranks_per_replica: int = 1,
        bucket_cap_mb: float = 25.0,
        synchronous_warmup: bool = False,
        collective_timeout_s: float | None = None,
        nonfinite: str = "raise",
        comm_dtype: CommDtype = None,
        ranks_per_node: int | str | None = None,
    ) -> AveragingConfig:
        """Build a config from torch's ``{period: group_size}`` mapping.

        ``comm_dtype`` is one wire dtype or ``{period: dtype}`` (see :attr:`comm_dtype`);
        ``ranks_per_node="auto"`` reads ``LOCAL_WORLD_SIZE`` (torchrun), else ``LOCAL_SIZE``
        (the ``deepspeed`` launcher).

        Raises:
            ValueError: naming the offending value, for every invalid setting.
        """
        check_collective_timeout_s(collective_timeout_s)  # named as given, before the conversion to float
        # Plain Python numbers (numpy integers, an int bucket size): the ranks compare the config by
        # its repr, so warmup_steps=np.int64(8) on one rank and 8 on another must not differ.
        return cls(
            levels=parse_levels(period_group_size),
            warmup_steps=int(warmup_steps) if is_int(warmup_steps) else warmup_steps,
            ranks_per_replica=int(ranks_per_replica) if is_int(ranks_per_replica) else ranks_per_replica,
            bucket_cap_mb=_as_float(bucket_cap_mb) if _is_real(bucket_cap_mb) else bucket_cap_mb,
            synchronous_warmup=synchronous_warmup,
            collective_timeout_s=(
                _as_float(collective_timeout_s) if _is_real(collective_timeout_s) else collective_timeout_s
            ),
            nonfinite=nonfinite,  # type: ignore[arg-type]
            comm_dtype=comm_dtype,  # type: ignore[arg-type]  # normalized in __post_init__
            ranks_per_node=resolve_ranks_per_node(ranks_per_node),
        )

    def _check_ranks_per_node(self, world_size: int) -> None:
        n, s = self.ranks_per_node, self.ranks_per_replica
        if n is None:
            return
        if world_size % n != 0 or n % s != 0:
            raise ValueError(
                f"ranks_per_node={n} must divide the size of the process group ({world_size}) and be a multiple of "
                f"ranks_per_replica={s}: nodes are blocks of ranks_per_node consecutive ranks holding whole replicas. "
                "Set it to the ranks of one node (LOCAL_WORLD_SIZE), or to None for a flat all-reduce."
            )
        for level in self.levels:
            if level.group_size > n and level.group_size % n != 0:
                raise ValueError(
                    f"ranks_per_node={n} must divide group size {level.group_size} of period {level.period}: a level "
                    "spanning several nodes averages whole nodes node-aware. Change the group size to a multiple of "
                    f"{n}, or set ranks_per_node=None for a flat all-reduce."
                )

    @property
    def bucket_cap_bytes(self) -> int:
        """:attr:`bucket_cap_mb` in bytes."""
        return int(self.bucket_cap_mb * 1_000_000)

    def check_world_size(self, world_size: int) -> None:
        """Check the levels against the size of the overall process group.

        Raises:
            ValueError: if a group size does not divide ``world_size``, is not a multiple of
                :attr:`ranks_per_replica`, or the last group size is not ``world_size``.

        Warns:
            UserWarning: (attributed to the first caller outside hieravg_optim) when the largest period is 1, as torch
                does, or when a level's groups do not nest in the next level's groups.
        """
        s = self.ranks_per_replica
        if world_size % s != 0:
            raise ValueError(
                f"ranks_per_replica={s} must divide the size of the process group ({world_size}): "
                "every replica is a block of ranks_per_replica consecutive ranks."
            )
        for level in self.levels:
            if world_size % level.group_size != 0:
                raise ValueError(
                    f"Group size {level.group_size} of period {level.period} must divide the size of the "
                    f"process group ({world_size})."
                )
            if level.group_size % s != 0:
                raise ValueError(
                    f"Group size {level.group_size} of period {level.period} must be a multiple of "
                    f"ranks_per_replica={s}: a level averages whole replicas."
                )
        self._check_ranks_per_node(world_size)
        last = self.levels[-1].group_size
        if last != world_size:
            raise ValueError(
                f"The last group size in period_group_size ({last}, period {self.levels[-1].period}) must be "
                f"equal to the size of the process group ({world_size}): the top level averages all replicas."
            )
        if self.levels[-1].period == 1:
            warn_at_caller(
                "The largest period in period_group_size is 1: averaging parameters every step costs at least "
                "as much as all-reducing gradients. Use plain DDP / ZeRO / FSDP instead.",
            )
        for lower, upper in zip(self.levels, self.levels[1:]):
            if upper.group_size % lower.group_size != 0:
                warn_at_caller(
                    f"Group size {lower.group_size} (period {lower.period}) does not divide group size "
                    f"{upper.group_size} (period {upper.period}): the levels' groups do not nest, so this is "
                    "not a hierarchy. It is legal, as in torch, but rarely intended.",
                )
        if world_size == s:
            warn_at_caller(
                f"ranks_per_replica={s} is the size of the process group: there is a single replica, so "
                "hierarchical averaging never averages anything. Lower ranks_per_replica (e.g. to the ranks of "
                "one node).",
            )
            return
        for level in self.levels[:-1]:
            if level.group_size == s:
                warn_at_caller(
                    f"Level with period {level.period} has group size {level.group_size} == ranks_per_replica: "
                    "its groups hold a single replica, so it never averages anything. Remove it.",
                )

"""The settings of hierarchical averaging: one validated, kw-only, frozen object.

:class:`AveragingConfig` holds every value setting; each field's docstring is its reference. Each
entry point builds one with :meth:`AveragingConfig.create`, the one place where user forms become
canonical; ``__post_init__`` checks each field once, through the table :data:`FIELD_CHECKS`. Every
check here is local: it raises on every rank, before any collective.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch

from ._validation import (
    FieldCheck,
    as_float,
    as_real,
    is_bool,
    is_int,
    is_positive_int,
    is_real,
    plain_number,
    resolve_ranks_per_node,
    check_world_size,
    setting_error,
    warn_at_caller,
)
from .comm_dtype import COMM_DTYPES, CommDtype, parse_comm_dtype
from .compression.codecs import Codec
from .compression.settings import CompressSpec, check_compress, check_ef_decay, parse_compress, parse_ef_decay
from .delay_settings import PerLevel, check_delay_settings, parse_delay_setting
from .outer import PLAIN_OUTER, OuterFactory, check_outer_optimizers, check_outer_state_device, probe_factory
from .schedule import AveragingLevel, parse_levels

__all__ = [
    "FIELD_CHECKS",
    "MAX_COLLECTIVE_TIMEOUT_S",
    "NONFINITE_POLICIES",
    "AveragingConfig",
    "FieldCheck",
    "check_collective_timeout_s",
    "check_log_metrics_every",
    "check_nonfinite",
    "check_setting",
    "is_int",
    "parse_levels",
    "resolve_ranks_per_node",
    "warn_at_caller",
]

NONFINITE_POLICIES = ("raise", "skip_replica", "ignore")
"""The values of ``nonfinite``: what an averaging round does when a replica holds a NaN or an infinity."""

MAX_COLLECTIVE_TIMEOUT_S = 1e9
"""The largest ``collective_timeout_s``, in seconds (about 31.7 years). Larger ones overflow in gloo, whose
deadlines count nanoseconds (torch 2.13: 9.2e9 s hung the first all-reduce, 9.3e9 s timed it out at once)."""

FIELD_CHECKS: dict[str, FieldCheck] = {
    "warmup_steps": FieldCheck(
        lambda v: is_int(v) and v >= 0, "a non-negative integer (steps)", json="a non-negative integer (optimizer steps)"
    ),
    "synchronous_warmup": FieldCheck(is_bool, "True or False", json="true or false", show_type=True),
    "ranks_per_replica": FieldCheck(
        is_positive_int, "a positive integer (ranks)", json='a positive integer (ranks), "auto" or "local_world_size" (the ranks of one node)'
    ),
    "ranks_per_node": FieldCheck(
        lambda v: v is None or is_positive_int(v),
        'a positive integer (ranks of one node), "auto" or None',
        json='a positive integer (ranks of one node), "auto" or null',
    ),
    "bucket_cap_mb": FieldCheck(
        lambda v: is_real(v) and 0 < v < math.inf, "a positive, finite number of MB", json="a positive number (MB)"
    ),
    "average_frozen": FieldCheck(is_bool, "True or False", json="true or false", show_type=True),
    "collective_timeout_s": FieldCheck(
        lambda v: v is None or (is_real(v) and 0 < as_float(v) <= MAX_COLLECTIVE_TIMEOUT_S),
        f"a positive, finite number of seconds, at most {MAX_COLLECTIVE_TIMEOUT_S:g} (larger ones overflow in the "
        "backend), or None (the process group's timeout)",
        json=f"a positive number of seconds, at most {MAX_COLLECTIVE_TIMEOUT_S:g}, or null for the default group's",
        show_type=True,
        tail=". Pass e.g. collective_timeout_s=300 to let a dead or hung peer be reported after 5 minutes.",
    ),
    "nonfinite": FieldCheck(
        lambda v: isinstance(v, str) and v in NONFINITE_POLICIES,
        f"one of {list(NONFINITE_POLICIES)}",
        tail=': "raise" (the default) raises on every rank of the group, "skip_replica" averages only the finite '
        'replicas, "ignore" does not check.',
    ),
    "log_metrics_every": FieldCheck(
        lambda v: v is None or is_positive_int(v),
        "a positive integer number of steps or None",
        json="a positive integer number of steps or null",
        tail=". Pass e.g. log_metrics_every=100 to log the averaging metrics every 100 steps.",
    ),
}
"""The check of each field checked alone: run by ``__post_init__``, rendered for Python or for the DeepSpeed
section (:func:`~hieravg_optim._validation.in_section`). The others are checked against the levels."""


def check_setting(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` passes the check of field ``name`` in :data:`FIELD_CHECKS`."""
    FIELD_CHECKS[name](name, value)


check_collective_timeout_s = functools.partial(check_setting, "collective_timeout_s")
check_nonfinite = functools.partial(check_setting, "nonfinite")
check_log_metrics_every = functools.partial(check_setting, "log_metrics_every")
_DEVICE_JSON = 'a torch device name such as "cpu", or null (with the master weights)'


def _outer_state_device(value: object) -> torch.device | None:
    """:func:`~hieravg_optim.outer.check_outer_state_device`, its errors naming the setting for the JSON section."""
    try:
        return check_outer_state_device(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise setting_error("outer_state_device", value, json=_DEVICE_JSON, message=str(exc), kind=TypeError) from None
    except ValueError as exc:
        try:
            torch.device(value)  # type: ignore[arg-type]
            json = None  # a device, but not one this machine has
        except RuntimeError:
            json = _DEVICE_JSON
        raise setting_error("outer_state_device", value, json=json, message=str(exc)) from None


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each factory's probe result per ``(period, group size)``: a config rebuilt with other settings
(``dataclasses.replace``, :meth:`AveragingConfig.updated`, DeepSpeed's resolved ``ranks_per_replica``)
probes no factory twice."""


def _probe_once(period: int, factory: OuterFactory, group_size: int) -> object:
    try:
        seen = _PROBED.setdefault(factory, {})
    except TypeError:  # a factory that cannot be referenced weakly is probed each time
        return probe_factory(period, factory, group_size)
    if (period, group_size) not in seen:
        seen[(period, group_size)] = probe_factory(period, factory, group_size)
    return seen[(period, group_size)]


@dataclass(kw_only=True, slots=True, frozen=True)
class AveragingConfig:
    """Every value setting of hierarchical averaging, validated: the one reference for each of them.

    Build it with :meth:`create`, which takes the user forms. The core wrapper, the FSDP wrapper and
    the DeepSpeed section (whose keys are these field names) all forward to it. Fields are checked in
    ``__post_init__``; the checks that need the size of the process group in :meth:`check_world_size`.
    Runtime objects (optimizer, process group, buffers, module, mesh) are the entry points' arguments.
    """

    levels: tuple[AveragingLevel, ...]
    """The hierarchy, periods strictly increasing; the last level spans the whole process group.
    Given as ``period_group_size`` (``{period: group_size}``, torch's ``HierarchicalModelAverager``):
    every ``period`` optimizer steps, blocks of ``group_size`` consecutive ranks average."""

    warmup_steps: int = 0
    """Step counts below this never average (post-local SGD's warm-up), in optimizer steps. Default 0."""

    synchronous_warmup: bool = False
    """Average at the top level (all replicas) after every warm-up step (counts ``0 .. warmup_steps - 1``).

    Post-local SGD (https://arxiv.org/abs/1808.07217) warms up with fully synchronous training.
    ``False`` (the default of :class:`~hieravg_optim.HierarchicalAveragingOptimizer`, as torch's
    ``HierarchicalModelAverager``): warm-up steps never average, and something else keeps the
    replicas in step (under DDP, the post-local SGD hook all-reduces the gradients globally).
    ``True`` (the default of the FSDP wrapper and the DeepSpeed section, where gradients are reduced
    within a replica only, so nothing else would): the replicas, starting from the same weights, end
    every warm-up step with the same weights; with SGD this is exactly synchronous SGD over all ranks.
    Collective over the top-level subgroup at every warm-up step."""

    ranks_per_replica: int = 1
    """Consecutive ranks that together hold one replica (1, the default: every rank holds the full model).

    Those ranks reduce gradients every step (DDP, ZeRO, FSDP) and may each hold a different shard. A
    level of group size G averages among the G / ranks_per_replica ranks of its block that hold the same
    shard index. FSDP takes it from the mesh; the DeepSpeed section also takes ``"auto"`` (the ranks of one
    node, ``LOCAL_WORLD_SIZE``, its default)."""

    ranks_per_node: int | None = None
    """Consecutive ranks that share a node (fast links); ``None`` (default): a flat all-reduce at every level.

    Given as a number, or ``"auto"`` (``LOCAL_WORLD_SIZE``, else ``LOCAL_SIZE``). A level whose groups span
    several nodes then averages node-aware: reduce-scatter inside each node, all-reduce of the shards across
    nodes, all-gather inside the node, so each node sends the model over the slow link about once per round.
    Must divide every group size larger than it, and be a multiple of ``ranks_per_replica``."""

    bucket_cap_mb: float = 25.0
    """Upper bound of one communication bucket, in MB (10**6 bytes), per wire dtype. Default 25, as DDP's
    ``bucket_cap_mb``; tensors are averaged in place through reusable buckets of this size."""

    comm_dtype: tuple[str | None, ...] = ()
    """The wire dtype name of each level, in level order; ``()`` (default): each tensor's own dtype, as torch,
    except float16 and float8, sent as float32 (their sums would overflow).

    Given as one name (``"float32"``, ``"bf16"``, ``"fp16"``, ``"float64"``, or a ``torch.dtype``) or
    ``{period: dtype}``, e.g. ``{32: "bf16"}`` to halve the bytes of fp32 weights on the slowest level.
    Tensors keep their dtype; only the copy on the wire is rounded. See :mod:`hieravg_optim.comm_dtype`."""

    delay_steps: tuple[int, ...] = ()
    """The delay ``tau`` of each level's rounds, in optimizer steps, in level order; ``()`` (default): 0 at every
    level, each round applied at the count it starts (today's synchronous round).

    Given as one non-negative integer or ``{period: steps}``, e.g. ``{32: 4}``. A level's round (or fragment round)
    that starts at count ``t`` checks and agrees synchronously as usual, copies the tensors (the *snapshot*, sharded
    like them), and all-reduces the copy in the background (asynchronous collectives over its own process groups)
    while the next ``tau`` inner steps run; it is applied at count ``t + tau``, before that count's own round, on
    every rank of the group (see :attr:`delay_correction`, :attr:`delay_mixing` and ``docs/semantics.md``). Must
    be below the level's period and below its fragment spacing (:attr:`fragments`); warm-up rounds (counts below
    ``warmup_steps``) stay synchronous. Memory per level while a round is in flight: one copy of the round's
    tensors (two with the ``"eager"`` correction; the second, the snapshot, on :attr:`outer_state_device` when it
    is set). Streaming DiLoCo's overlapping (https://arxiv.org/abs/2501.18512), Eager updates
    (https://arxiv.org/abs/2502.12996), torchft's ``fragment_sync_delay``."""

    fragments: tuple[int, ...] = ()
    """The number of fragments ``F`` of each level, in level order; ``()`` (default): 1 at every level.

    Given as one positive integer or ``{period: F}``. The level's tensors (the list a round averages, in order:
    this rank's local tensors) are split, as one run of elements, into ``F`` consecutive element ranges of equal
    bytes within one element (:func:`hieravg_optim.fragments.split_fragments`: a boundary may fall inside a
    tensor, e.g. one flat ZeRO-1/2 partition or FSDP1 shard; a non-contiguous tensor is kept whole); fragment ``j``
    has its own round at the counts ``t`` with ``t % period == round(j * period / F)`` (Streaming DiLoCo,
    https://arxiv.org/abs/2501.18512), so one round moves about ``1/F`` of the bytes. At a count where a fragment
    and a lower level are due, each element follows the largest level due for it: the fragment's elements that
    level, the others the lower level. ``F`` must not exceed the period nor the number of elements (checked at the
    first round, on every rank); an outer optimizer on a level below a level with fragments is not supported."""

    delay_mixing: tuple[float, ...] = ()
    """Streaming DiLoCo's mixing weight ``alpha`` of each level's delayed or fragment rounds, in level order;
    ``()`` (default): 0 at every level.

    Given as one number in ``[0, 1]`` or ``{period: alpha}``. With ``R`` the round's result (the mean of the
    snapshots, or the anchors after the outer step) and ``theta`` the live local tensor at the apply count, the
    tensor becomes ``(1 - alpha) * A + alpha * theta``, ``A`` the value :attr:`delay_correction` gives
    (``R + (theta - snapshot)`` for ``"eager"``, ``R`` for ``"none"``). ``alpha = 0`` applies ``A`` exactly;
    Streaming DiLoCo (https://arxiv.org/abs/2501.18512, its ``alpha``, 0.5 in the paper) is ``"none"`` with
    ``alpha > 0``: ``theta <- alpha * theta_local + (1 - alpha) * theta_global``."""

    delay_correction: tuple[str, ...] = ()
    """What a delayed round applies at ``t + tau`` per level, in level order; ``()`` (default): ``"eager"`` at every
    level.

    Given as ``"eager"`` or ``"none"``, or ``{period: value}``. ``"eager"`` keeps the local progress made while
    the round was in flight: ``theta <- R + (theta_{t+tau} - theta_t)``, ``R`` the mean of ``theta_t`` over the
    group, or, with an outer optimizer, the anchors after the outer step on the delayed pseudo-gradient
    ``anchor - R`` (Eager updates, https://arxiv.org/abs/2502.12996). ``"none"``: the naive delay,
    ``theta <- R`` at ``t + tau`` (the inner steps since ``t`` are discarded). Then :attr:`delay_mixing` applies."""

    average_frozen: bool = False
    """Also average the parameters whose ``requires_grad`` is ``False``. ``False`` (default): they are not sent
    and not changed; which ones are frozen is part of each round's agreement check. Does not apply to the
    tensors a ``tensors_to_average`` callable returns. The DeepSpeed adapter rejects it under ZeRO-3."""

    collective_timeout_s: float | None = None
    """Timeout of the averaging subgroups' collectives, in seconds (at most :data:`MAX_COLLECTIVE_TIMEOUT_S`);
    ``None`` (default): the process group's timeout.

    A dead peer is usually reported at once; a hung one after this timeout: every rank of the round then raises
    a ``RuntimeError`` naming the level, count and ranks (``docs/faults.md``). The top level gets its own group."""

    nonfinite: Literal["raise", "skip_replica", "ignore"] = "raise"
    """What a round does when a replica's tensors hold a NaN or an infinity, checked before each round and
    agreed on in its agreement collective: ``"raise"`` (default) on every rank of the group, naming the
    replicas; ``"skip_replica"``: average the finite replicas only and give the others that mean (a
    ``RuntimeError`` if none is finite); ``"ignore"``: no check. A sharded replica is non-finite when any of
    its shards is, in every shard's group. The check reads every tensor once."""

    outer_optimizers: Mapping[int, OuterFactory] = field(default_factory=dict, hash=False)
    """``{period: factory}``: levels with an outer optimizer (DiLoCo, https://arxiv.org/abs/2311.08105; HALoS,
    https://arxiv.org/abs/2506.04531); empty (default): every level averages plainly.

    Each such level keeps fp32 anchors of the averaged tensors; its rounds step them with the pseudo-gradient
    ``anchor - mean`` through ``factory(anchors)``, a ``torch.optim.Optimizer``, then copy them into the tensors;
    a higher level's round resets the lower levels' anchors. E.g. ``{64: hieravg_optim.nesterov_outer()}``. Each
    factory is probed once, here. JSON: ``"outer_optimizer": {"period": {"type", "params"}}`` (``docs/outer.md``)."""

    outer_state_device: torch.device | None = None
    """Where anchors and outer optimizer state live: ``"cpu"`` keeps them off the accelerator (torchft's
    ``backup_device``); ``None`` (default): each tensor's own device. Memory per outer level: one fp32 copy
    of the averaged tensors, plus the outer optimizer's state (Nesterov SGD: one more)."""

    compress: tuple[Codec | None, ...] = ()
    """The codec of each level's rounds, in level order; ``()`` (default): no level is compressed, every round
    runs as without this setting.

    Given as one spec or ``{period: spec}``; a spec is ``None``, ``"int8"`` (blockwise absmax, one fp32 scale
    per block of 256), ``{"type": "int8", "block": 256}``, or ``{"type": "topk", "density": 0.01, "chunk": 4096,
    "values": "int8"}`` (per chunk of 4096 elements the 1% of largest magnitude, chunk-local indices, int8
    values with one scale per chunk; ``"values"`` may be ``"float32"``, ``"bfloat16"``, ``"float16"``, and
    defaults to the level's ``comm_dtype``, else ``"int8"``). A compressed level sends the pseudo-gradient
    ``anchor - theta`` plus its error-feedback residual (:attr:`ef_decay`) through its codec: every rank
    all-gathers the payloads and decodes them in rank order, so the replicas stay bitwise equal. Without an
    outer optimizer it steps like outer SGD with lr 1 (the mean of the decoded deltas); before the anchors
    are taken (the warm-up) it averages plainly. Node-aware (``ranks_per_node``), the node sums its deltas at
    full precision and only the node's shard crosses nodes compressed. With :attr:`delay_steps` or
    :attr:`fragments` at the same level, each round's payloads are encoded at its start, all-gathered in the
    background and decoded where it is applied (``hieravg_optim.compression.delayed``); node-aware, the node's
    full-precision sum runs synchronously at the start and the in-node assembly of the mean at the apply, and only
    the compressed payloads' all-gather across nodes runs in the background (one residual shard per fragment).
    Memory per compressed level: the anchors (one fp32 copy of the averaged tensors) and the residuals (one more,
    or one node shard), plus, during a round, the payloads of the group. Canonically one
    :class:`~hieravg_optim.compression.Int8Block` / :class:`~hieravg_optim.compression.TopK` (or ``None``) per level.
    See ``docs/compression.md``."""

    ef_decay: tuple[float, ...] = ()
    """The error-feedback decay ``beta`` of each compressed level, in ``[0, 1]``; ``()`` (default): 1.0 at
    every level (plain accumulation).

    Given as one number or ``{period: number}`` (compressed periods only). Each round compresses
    ``v = beta * e + delta`` and keeps ``e = v - decode(encode(v))`` on each rank (SparseLoCo,
    https://arxiv.org/abs/2508.15706; MuLoCo, https://arxiv.org/abs/2505.23725, uses 0.9). ``0`` turns error
    feedback off: no residual is kept (nor saved), and what a round's codec drops is lost.

    With top-k under a strong outer momentum (Nesterov 0.7 / 0.9) a decay near 1 sends an element with several
    rounds of pseudo-gradient at once, which the momentum then amplifies: measured on the chars LM, top-k 1%
    with ``ef_decay`` 1.0 ends worse than 0 there, and better than 0 with no outer optimizer or momentum 0.5
    (``docs/compression.md``, "Error feedback and the outer optimizer")."""

    log_metrics_every: int | None = None
    """Log the averaging metrics at INFO through the ``hieravg_optim.optimizer`` logger every this many steps
    (at counts that are multiples of it); ``None`` (default) never logs."""

    _outer_kinds: dict[int, object] = field(init=False, repr=False, compare=False, hash=False, default_factory=dict)
    """Per period, the outer optimizer's class and hyperparameters, probed once: what the ranks agree on."""

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("levels must not be empty.")
        previous = 0
        for level in self.levels:
            if not is_int(level.period) or level.period <= 0:
                raise ValueError(
                    f"Period {level.period!r} in period_group_size must be a positive integer (in optimizer steps)."
                )
            if level.period <= previous:
                raise ValueError(
                    f"Periods in period_group_size must be strictly increasing, got {[lv.period for lv in self.levels]}"
                    f": period {level.period} follows {previous}. List them from the most to the least frequent."
                )
            previous = level.period
            if not is_int(level.group_size) or level.group_size <= 0:
                raise ValueError(
                    f"Group size {level.group_size!r} of period {level.period} must be a positive integer (ranks)."
                )
        for name, check in FIELD_CHECKS.items():
            check(name, getattr(self, name))
        comm = self.comm_dtype
        if not (isinstance(comm, tuple) and len(comm) in (0, len(self.levels))) or any(
            c is not None and c not in COMM_DTYPES for c in comm
        ):
            raise setting_error("comm_dtype", comm, "one wire dtype name per level, or () (build it with create())")
        check_compress(self.compress, comm, self.levels)
        check_ef_decay(self.ef_decay, self.levels)
        if self.outer_state_device is not None and not isinstance(self.outer_state_device, torch.device):
            raise setting_error("outer_state_device", self.outer_state_device, "None or a torch.device", kind=TypeError)
        outer = check_outer_optimizers(self.outer_optimizers, self.levels)
        sizes = {lv.period: lv.group_size for lv in self.levels}
        object.__setattr__(self, "outer_optimizers", outer)
        check_delay_settings(self)
        object.__setattr__(self, "_outer_kinds", {p: _probe_once(p, f, sizes[p]) for p, f in outer.items()})

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
        delay_steps: PerLevel = 0,
        fragments: PerLevel = 1,
        delay_mixing: PerLevel = 0.0,
        delay_correction: PerLevel = "eager",
        ranks_per_node: int | str | None = None,
        average_frozen: bool = False,
        outer_optimizers: Mapping[int | str, OuterFactory] | None = None,
        outer_state_device: str | torch.device | None = None,
        compress: CompressSpec = None,
        ef_decay: float | Mapping[int | str, float] | None = None,
        log_metrics_every: int | None = None,
    ) -> AveragingConfig:
        """Build a config from the user forms of the settings; each keyword is the field of the same name.

        The user forms are turned into canonical ones here only: ``{period: group_size}`` (keys may be JSON's
        strings of digits) or pairs; numpy integers; ``comm_dtype`` as one dtype or ``{period: dtype}``;
        ``ranks_per_node="auto"``; ``outer_optimizers=None``; ``outer_state_device`` as a device name;
        ``delay_steps``, ``fragments``, ``delay_mixing``, ``delay_correction``, ``compress`` and ``ef_decay`` as
        one value or ``{period: value}``.

        Raises:
            ValueError: naming the offending value (naming the key, in the DeepSpeed section), for every invalid
                setting. TypeError: for a ``period_group_size``, ``outer_optimizers`` or ``outer_state_device``
                of an unsupported type, or a factory that is not callable or builds no optimizer over its tensors.
        """
        levels = parse_levels(period_group_size)
        numbers = {"warmup_steps": warmup_steps, "ranks_per_replica": ranks_per_replica, "bucket_cap_mb": bucket_cap_mb}
        numbers["collective_timeout_s"] = collective_timeout_s
        numbers["log_metrics_every"] = log_metrics_every
        delays = {"delay_steps": delay_steps, "fragments": fragments, "delay_mixing": delay_mixing,
                  "delay_correction": delay_correction}  # fmt: skip
        for name, value in numbers.items():  # named as given, before they become plain ints and floats
            check_setting(name, value)
        comm = comm_dtype if isinstance(comm_dtype, tuple) else parse_comm_dtype(comm_dtype, levels)
        codecs = compress if isinstance(compress, tuple) else parse_compress(compress, levels, comm)
        return cls(
            levels=levels,
            warmup_steps=plain_number(warmup_steps),  # type: ignore[arg-type]
            synchronous_warmup=synchronous_warmup,
            ranks_per_replica=plain_number(ranks_per_replica),  # type: ignore[arg-type]
            ranks_per_node=resolve_ranks_per_node(ranks_per_node),  # type: ignore[arg-type]
            bucket_cap_mb=as_real(bucket_cap_mb),  # type: ignore[arg-type]
            comm_dtype=comm,
            **{name: parse_delay_setting(name, value, levels) for name, value in delays.items()},
            average_frozen=average_frozen,
            collective_timeout_s=as_real(collective_timeout_s),  # type: ignore[arg-type]
            nonfinite=nonfinite,  # type: ignore[arg-type]
            outer_optimizers=check_outer_optimizers(outer_optimizers, levels),
            outer_state_device=_outer_state_device(outer_state_device),
            compress=codecs,
            ef_decay=ef_decay if isinstance(ef_decay, tuple) else parse_ef_decay(ef_decay, levels, codecs),
            log_metrics_every=plain_number(log_metrics_every),  # type: ignore[arg-type]
        )

    def updated(self, **settings: Any) -> AveragingConfig:
        """This config with the given settings changed, each in any form :meth:`create` takes (``"cpu"`` for
        ``outer_state_device``, string period keys); e.g. to fold in the keywords of an older signature."""
        current = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "levels"}
        return type(self).create(self.levels, **{**current, **settings})

    def agreement_value(self) -> dict[str, object]:
        """What the ranks of a process group compare at construction: every field, each outer factory as the
        class and hyperparameters it builds (a factory's own ``repr`` may differ between processes)."""
        value: dict[str, object] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.init and f.name not in ("outer_optimizers", "outer_state_device")
        }
        value["levels"] = tuple(asdict(lv) for lv in self.levels)
        value["periods with an outer optimizer"] = sorted(self.outer_optimizers)
        value["outer_state_device"] = None if self.outer_state_device is None else str(self.outer_state_device)
        # Replicas stepping with different outer optimizers would drift apart silently.
        value["outer optimizers (class, defaults)"] = self._outer_kinds
        return value

    @property
    def outer_factories(self) -> dict[int, OuterFactory]:
        """``{period: factory}`` of every level that keeps anchors, in level order: those of
        :attr:`outer_optimizers`, and each compressed level without one, which steps as outer SGD with lr 1
        (:data:`~hieravg_optim.outer.PLAIN_OUTER`: the anchors become the mean of the decoded deltas' result)."""
        compressed = {lv.period for lv, c in zip(self.levels, self.compress) if c is not None}
        return {
            lv.period: self.outer_optimizers.get(lv.period, PLAIN_OUTER)
            for lv in self.levels
            if lv.period in self.outer_optimizers or lv.period in compressed
        }

    def level_compress(self, level_index: int) -> Codec | None:
        """The codec of the level at ``level_index`` (``None``: uncompressed)."""
        return self.compress[level_index] if self.compress else None

    def level_ef_decay(self, level_index: int) -> float:
        """The error-feedback decay of the level at ``level_index`` (1.0 unless :attr:`ef_decay` says otherwise)."""
        return self.ef_decay[level_index] if self.ef_decay else 1.0

    @property
    def bucket_cap_bytes(self) -> int:
        """:attr:`bucket_cap_mb` in bytes."""
        return int(self.bucket_cap_mb * 1_000_000)

    def check_world_size(self, world_size: int) -> None:
        """Check the levels against the size of the overall process group.

        Raises:
            ValueError: if a group size does not divide ``world_size``, is not a multiple of
                :attr:`ranks_per_replica`, or the last group size is not ``world_size``; if
                :attr:`ranks_per_node` does not fit the group sizes.

        Warns:
            UserWarning: (at the first caller outside hieravg_optim) for a largest period of 1, as torch, levels
                whose groups do not nest, or a level (or a process group) holding a single replica.
        """
        check_world_size(self.levels, self.ranks_per_replica, self.ranks_per_node, world_size)

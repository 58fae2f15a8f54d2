"""Rounds off the critical path: delayed (overlapped) rounds and streamed fragments, per level.

A level with ``delay_steps`` ``tau > 0`` starts its round at count ``t`` as usual (the agreement check and the
non-finite vote, synchronously), copies the round's tensors (the *snapshot*: local tensors, sharded like them),
and all-reduces the copy in the background (asynchronous collectives on packed copies; a Python thread for
node-aware levels and the checked float16 wire), over process groups of its own, while the next ``tau`` inner
steps run; the round is applied at count ``t + tau`` (:class:`DelayedRounds`). A level with ``fragments``
``F > 1`` splits its tensors into ``F`` fragments of element ranges (:mod:`hieravg_optim.fragments`: a boundary
may fall inside a tensor), each with its own round at staggered counts (:meth:`DelayedRounds.plan`). A round
between its start and its apply is an :class:`~hieravg_optim.in_flight.InFlightRound`. The settings are fields of
:class:`~hieravg_optim.AveragingConfig`; the semantics, with a worked example, are in ``docs/semantics.md``.

Sources: Streaming DiLoCo (https://arxiv.org/abs/2501.18512: fragments, overlapping, the mixing weight),
Eager updates (https://arxiv.org/abs/2502.12996: the correction with the local progress), torchft's
``DiLoCo(fragment_sync_delay=...)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .agreement import agree_across_ranks
from .anchors import OuterLevels
from .averaging import BucketPool, average_tensors_
from .averaging.checked_wire import CHECKED_WIRE
from .comm_dtype import wire_dtype
from .compression.delayed import encode_round, encoded_delta, load_payloads
from .compression.round import residual_error
from .config import AveragingConfig
from .faults import named_collective
from .fragments import (
    Piece, fragment_of, landing_error, level_splits, piece_view, plan_pieces, split_fragments, split_key, tensor_marks,
)
from .groups import LevelGroup, build_level_groups, timeout_seconds
from .in_flight import InFlightRound, check_meaning, pack_copies, saved_round
from .metrics import LevelMetrics, bytes_sent
from .nonfinite import has_nonfinite
from .round_start import agree_round, sync_anchors
from .rounds import round_name
from .schedule import period_of_key
from .tensors import local_tensor

__all__ = ["DelayedRounds", "InFlightRound", "split_fragments"]


def _unencoded(
    chosen: Sequence[torch.Tensor], params_of: Sequence[int | None] | None, encoded: torch.Tensor | None
) -> list[torch.Tensor]:
    """What the non-finite check of a round reads: its tensors, or, for a compressed round whose delta is
    ``encoded`` (:func:`~hieravg_optim.compression.delayed.encoded_delta`), that delta and the buffers."""
    if encoded is None or params_of is None:
        return [local_tensor(t) for t in chosen]
    return [encoded, *(local_tensor(t) for t, i in zip(chosen, params_of) if i is None)]


class DelayedRounds:
    """The delayed and fragment rounds of one averager: the plan of each count, the rounds in flight, applying them.

    Built by :class:`~hieravg_optim.HierarchicalAverager` when some level has ``delay_steps > 0`` or ``fragments >
    1``; the defaults never build it, so their rounds run exactly the synchronous code path.

    .. warning::
        The constructor is collective over the process group when a level has a delay: it creates that level's
        background groups (:func:`hieravg_optim.groups.build_level_groups` with ``fresh=True``), which no other
        collective uses, so the main thread never issues a collective on a group while a round is in flight on it.
    """

    def __init__(
        self, config: AveragingConfig, process_group: dist.ProcessGroup, level_groups: Sequence[LevelGroup]
    ) -> None:
        n = len(config.levels)
        self.config = config
        self.process_group = process_group
        self.level_groups = list(level_groups)
        self.delays = config.delay_steps or (0,) * n
        self.fragments = config.fragments or (1,) * n
        self.mixing = config.delay_mixing or (0.0,) * n
        self.corrections = config.delay_correction or ("eager",) * n
        delayed = [i for i in range(n) if self.delays[i] > 0]
        # One call per level: two levels' rounds may be in flight at once (a lower one inside a higher one's
        # window), and one of them in a thread, so no background group may serve two levels, even where their
        # ranks are the same (build_level_groups shares a group among the levels of one call).
        self.background: dict[int, LevelGroup] = {
            i: build_level_groups(config, process_group, levels=[config.levels[i]], fresh=True)[0] for i in delayed
        }
        """Per delayed level, this rank's groups for the background collective (the same ranks, new groups, none
        shared with another level)."""
        self.pools: dict[int, BucketPool] = {i: BucketPool() for i in delayed}
        self.in_flight: dict[int, InFlightRound] = {}
        """The round in flight per level (at most one: the delay is below the fragment spacing)."""
        self._split: tuple[tuple[int, ...], dict[int, list[range]]] | None = None

    def active(self, level_index: int) -> bool:
        return self.delays[level_index] > 0 or self.fragments[level_index] > 1

    # -- the plan of one count ----------------------------------------------------------------------------------
    def fragment_due(self, count: int) -> bool:
        """Whether a fragment round of a level with fragments (other than its first, which the schedule's level
        gives) starts at ``count``. Pure."""
        return any(
            f > 1 and count % lv.period and fragment_of(count, lv.period, f) is not None
            for lv, f in zip(self.config.levels, self.fragments)
        )

    def handles(self, count: int, index: int | None) -> bool:
        """Whether ``count`` (past the warm-up) needs this class: a round to apply, a fragment round, or a round at a
        delayed or fragmented level. Otherwise the synchronous path runs, as without these settings."""
        if count < self.config.warmup_steps:
            return False
        if any(r.apply_at == count for r in self.in_flight.values()):
            return True
        return (index is not None and self.active(index)) or self.fragment_due(count)

    def first_level(self, count: int) -> list[int]:
        """The lowest level that starts a round at ``count`` (in a one-element list; empty if none does), from the
        schedule alone: where a rank's callbacks failed, it meets the others in that round's agreement."""
        starting = []
        for li, (lv, f) in enumerate(zip(self.config.levels, self.fragments)):
            if f == 1 and count % lv.period == 0:
                starting = [li]  # every lower level is then due for no tensor
            elif f > 1 and fragment_of(count, lv.period, f) is not None:
                starting.append(li)
        return starting[:1]

    def fragments_of(self, tensors: Sequence[torch.Tensor]) -> dict[int, list[tuple[Piece, ...]]]:
        """Per level with fragments, its fragments as pieces of ``tensors`` (:func:`split_fragments` of the local
        tensors' sizes, element sizes and contiguity; cached by them).

        Raises:
            ValueError: for more fragments than elements (from :func:`split_fragments`).
        """
        key = split_key(tensors)
        if self._split is None or self._split[0] != key:
            self._split = (key, level_splits(key, self.fragments))
        return self._split[1]

    def plan(self, count: int, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int | None, tuple[Piece, ...]]]:
        """The rounds that start at ``count``: ``(level index, fragment or None, pieces)``, in level order
        (:func:`hieravg_optim.fragments.plan_pieces`: each element follows the largest level due for it). Pure,
        given the tensors' sizes, so the same on every rank holding the same local shapes.

        Raises:
            ValueError: for more fragments than elements (the same on every rank of a group that agrees on them).
        """
        split = self.fragments_of(tensors) if any(f > 1 for f in self.fragments) else {}
        numels = [local_tensor(t).numel() for t in tensors]
        return plan_pieces(count, self.config.levels, self.fragments, numels, split)

    # -- start -------------------------------------------------------------------------------------------------
    def start(
        self,
        level_index: int,
        fragment: int | None,
        pieces: tuple[Piece, ...],
        tensors: Sequence[torch.Tensor],
        *,
        count: int,
        outers: OuterLevels,
        metrics: LevelMetrics,
        pool: BucketPool,
        replica_group: dist.ProcessGroup | None,
        replica_ranks: list[int],
        error: BaseException | None,
        context: Mapping[str, object] | None,
    ) -> InFlightRound:
        """Start the round of ``level_index`` (fragment ``fragment``) over the ``pieces`` of ``tensors`` at ``count``.

        Synchronously, as the synchronous round: the outer level's local checks, the non-finite check (one read of
        each tensor) and the replica's vote, the agreement check over the level's group, the non-finite policy, and,
        at the level's first round after the anchors were taken, the average of the anchors. Then the copies, and
        the all-reduce of the copies: in the background over the level's own groups with a delay (asynchronous
        all-reduces of buffers of ``bucket_cap_mb`` at most, or a thread for node-aware levels and the checked float16
        wire), at once otherwise (``delay_steps=0`` with fragments). A compressed level encodes its payload
        instead and all-gathers the payloads in the background
        (:func:`~hieravg_optim.compression.delayed.encode_round`; node-aware, after a synchronous reduce-scatter
        inside the node, over the main node group). The live tensors are never written here.

        .. warning::
            Collective over the level's group.
        """
        config, lg = self.config, self.level_groups[level_index]
        tau = self.delays[level_index]
        name = round_name(count, lg)
        if fragment is not None:
            name = f"{name[:-1]}, fragment {fragment} of {self.fragments[level_index]})"
        if tau:
            name = f"{name[:-1]}, delayed {tau} step{'s' if tau != 1 else ''})"
        outer = outers.by_level[level_index]
        if outer is not None and error is None:
            error = outers.error(level_index, tensors, count, config.warmup_steps)
        if outer is not None and outer.anchors is None:
            outer = None
        codec = config.level_compress(level_index) if outer is not None and lg.group is not None else None
        segments = None  # node-aware: per fragment, its anchored elements (one residual shard each)
        if codec is not None and error is None and lg.node is not None:
            try:
                segments = outers.segments(outer, tensors)
            except ValueError as exc:  # more fragments than elements: the same on every rank of equal shapes
                error = exc
        if codec is not None and error is None:
            error = residual_error(outer, outers.part(tensors), lg, segments)
        chosen = [piece_view(tensors, p) for p in pieces]
        begin = time.perf_counter()
        comm_dtype = config.comm_dtype[level_index] if config.comm_dtype else None
        eager = self.corrections[level_index] == "eager" and tau > 0
        replaced, divisor, bad = False, None, []
        encoded = params_of = None
        if codec is not None and error is None:  # unsynced: this rank's anchors' delta, computed again after
            try:  # the compressed delta, read by the non-finite check and then encoded: an fp32 overflow is caught
                params_of = outers.params_of(outer, pieces, len(tensors))
                # node-aware, the residual belongs to the node's shard: the delta alone is checked and summed
                decay = 0.0 if lg.node is not None else config.level_ef_decay(level_index)
                encoded = encoded_delta([local_tensor(t) for t in chosen], params_of, outer, decay)
            except RuntimeError as exc:
                error = exc
        if lg.group is not None:
            with torch.no_grad(), named_collective(name, lg.ranks, timeout_s=timeout_seconds(config, lg.group)):
                unsynced = outer is not None and not outer.synced
                bad, divisor = agree_round(
                    chosen, config=config, process_group=self.process_group, lg=lg, step=count, name=name,
                    what=f"the parameters to average at step {count} ({name})",
                    context={"fragment (pieces)": (fragment, pieces), "delay_steps": tau,
                             **({"compress": codec.describe()} if codec is not None else {}),
                             **outers.context(level_index), **(context or {})},
                    error=error, replica_group=replica_group, replica_ranks=replica_ranks, anchors_unsynced=unsynced,
                    local_nonfinite=lambda: has_nonfinite(_unencoded(chosen, params_of, encoded))
                    or (unsynced and has_nonfinite(outer.anchors)),
                )  # fmt: skip
                replaced = dist.get_rank() in bad
                if unsynced:
                    metrics.payload_bytes += sync_anchors(
                        outer, lg, outers.part(tensors), pool, config, replaced, divisor
                    )
                    encoded = None  # the delta to the averaged anchors (encode_round's)
        elif error is not None:
            raise error
        bg = self.background.get(level_index, lg)
        local = [local_tensor(t).detach() for t in chosen]
        # The flat path: async all-reduces of packed copies, progressed by the backend's own threads (no Python
        # thread holding the GIL through the copies); the thread path for node-aware levels and the checked
        # float16 wire, whose chains average_tensors_ runs.
        flat = tau > 0 and lg.group is not None and bg.node is None and all(
            t.is_floating_point()
            and (wire_dtype(t.dtype, comm_dtype) not in CHECKED_WIRE or config.nonfinite == "ignore")
            for t in local
        )
        with torch.no_grad():
            # theta_t never travels: with outer_state_device (e.g. "cpu") it is kept off the accelerator.
            where = config.outer_state_device
            snapshot = [t.to(device=where or t.device, copy=True) for t in local] if eager and not replaced else None
            flats: list[torch.Tensor] = []
            if codec is not None:
                wire = []  # encode_round's
            else:
                wire = pack_copies(local, comm_dtype, flats, zeros=replaced) if flat else [t.clone() for t in local]
        round_ = InFlightRound(
            level_index=level_index, fragment=fragment, pieces=pieces, started=count, apply_at=count + tau,
            name=name, wire=wire, snapshot=snapshot, replaced=replaced, divisor=divisor, ranks=lg.ranks,
            timeout_s=timeout_seconds(config, lg.group) if lg.group is not None else None,
            marks=tensor_marks(tensors, pieces),
        )  # fmt: skip
        metrics.rounds_started += 1
        if codec is not None:  # the payloads travel instead (hieravg_optim.compression.delayed)
            round_.wire, round_.compressed, round_.works, round_.payload = encode_round(
                local, params_of or outers.params_of(outer, pieces, len(tensors)), outer=outer, codec=codec,
                config=config, level_index=level_index, lg=lg, background=bg, pool=pool, divisor=divisor,
                bad=bad, replaced=replaced, metrics=metrics, what=name, encoded=encoded, segments=segments,
                segment=fragment or 0,
            )  # fmt: skip
        elif lg.group is None:
            round_.finished = True
        else:
            kwargs = dict(
                bucket_cap_bytes=config.bucket_cap_bytes, divisor=divisor, comm_dtype=comm_dtype, node=bg.node,
                check_wire=config.nonfinite != "ignore", what=name, contribute_zeros=replaced,
            )  # fmt: skip
            if tau == 0:
                with named_collective(name, lg.ranks, timeout_s=round_.timeout_s):
                    round_.payload = average_tensors_(wire, lg.group, lg.size, pool=pool, **kwargs)
                round_.finished = True
            elif flat:
                round_.flats, round_.divide_by = flats, float(divisor or bg.size)
                round_.payload = sum(f.numel() * f.element_size() for f in flats)
                for f in flats:
                    step = max(1, config.bucket_cap_bytes // f.element_size())
                    round_.works += [
                        dist.all_reduce(f[a : a + step], group=bg.group, async_op=True) for a in range(0, f.numel(), step)
                    ]
            else:
                self._launch(round_, bg, kwargs)
        metrics.seconds += time.perf_counter() - begin
        return round_

    def _launch(self, round_: InFlightRound, bg: LevelGroup, kwargs: dict[str, Any]) -> None:
        """Run the all-reduce of ``round_.wire`` in a thread over ``bg``'s groups (gloo releases the GIL; on CUDA,
        on a side stream ordered after the copies, with an event the apply waits for)."""
        device = round_.wire[0].device if round_.wire else torch.device("cpu")
        ready = None
        stream = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            stream = torch.cuda.Stream(device)
        pool = self.pools[round_.level_index]

        def run() -> None:
            begin = time.perf_counter()
            try:
                with torch.no_grad():
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            stream.wait_event(ready)
                            round_.payload = average_tensors_(round_.wire, bg.group, bg.size, pool=pool, **kwargs)
                            done = torch.cuda.Event()
                            done.record(stream)
                            round_.done = done
                    else:
                        round_.payload = average_tensors_(round_.wire, bg.group, bg.size, pool=pool, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised where the round is waited for
                round_.error = exc
            round_.seconds = time.perf_counter() - begin

        round_.thread = threading.Thread(target=run, name=f"hieravg {round_.name}", daemon=True)
        round_.thread.start()

    # -- apply -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(
        self,
        round_: InFlightRound,
        tensors: Sequence[torch.Tensor],
        *,
        outers: OuterLevels,
        metrics: LevelMetrics,
        error: BaseException | None = None,
        agree: bool = True,
    ) -> None:
        """Wait for ``round_`` and apply it to ``tensors`` (the live tensors at its apply count), in place.

        First the ranks of the level's group agree that each can apply it (one all-gather of two int64 per rank,
        on the main groups; skipped with ``agree=False``, for a round applied at its start count): ``tensors``
        are those the round started with (:func:`~hieravg_optim.fragments.landing_error`: the same positions,
        storage and elements) and ``error`` (this rank's failed step callback) is ``None``. Otherwise every rank
        of the group raises, and no rank applies the round.

        With ``R`` the mean (or, with an outer optimizer, the anchors after the outer step on ``anchor - R``):
        ``"eager"`` gives ``R + (theta - snapshot)``, ``"none"`` gives ``R``; then ``delay_mixing`` ``alpha`` gives
        ``(1 - alpha) * that + alpha * theta``. A replica that was non-finite at the start
        (``nonfinite="skip_replica"``) takes ``R``.

        Raises:
            CollectiveError, WireOverflowError: from :meth:`InFlightRound.wait`.
            RuntimeError: on every rank of the group, if on some rank the tensors at the apply count are not those
                of the start (another tensor at a position, e.g. a parameter frozen while the round was in flight,
                fewer tensors or elements, a tensor reshaped), or ``error`` was given (that rank raises ``error``
                itself).

        .. warning::
            Collective over the level's group (with ``agree``).
        """
        begin = time.perf_counter()
        round_.wait()
        li = round_.level_index
        problem = error or landing_error(
            round_.name, round_.apply_at, round_.pieces, tensors, round_.marks, [w.shape for w in round_.wire]
        )
        outer = outers.by_level[li]
        if problem is None and outer is not None and outer.anchors is not None:
            try:
                params_of = outers.params_of(outer, round_.pieces, len(tensors))
            except RuntimeError as exc:
                problem = exc
        lg = self.level_groups[li]
        if agree and lg.group is not None:
            agree_across_ranks(
                f"the tensors {round_.name} is applied to at step {round_.apply_at}", None, lg.group, error=problem,
                fix="Every rank must keep the averaged tensors fixed while a round is in flight.",
            )  # fmt: skip
        elif problem is not None:
            raise problem
        live = [local_tensor(piece_view(tensors, p)) for p in round_.pieces]  # their shapes checked above
        result = round_.wire
        if round_.compressed is not None:
            assert outer is not None
            result = list(result)
            named = f"{round_.name} (applied at step {round_.apply_at})"  # node-aware: the mean's all-gather
            decoded = round_.compressed.result(
                params_of, outer, live, metrics, node=lg.node, name=named, ranks=lg.ranks,
                timeout_s=timeout_seconds(self.config, lg.group),
            )  # fmt: skip
            for k, r in zip(round_.compressed.anchored, decoded):
                result[k] = r
        elif outer is not None and outer.anchors is not None:
            n_anchored = len(tensors) - outers.skip_last
            stepped = [k for k, (i, _, _) in enumerate(round_.pieces) if i < n_anchored]
            if stepped:
                outer.step([result[k] for k in stepped], [round_.pieces[k] for k in stepped])
                metrics.pseudo_grad_norm = outer.pseudo_grad_norm
        alpha = self.mixing[li]
        eager = round_.snapshot is not None
        for k, (t, r) in enumerate(zip(live, result)):
            if round_.replaced or (not eager and alpha == 0.0):
                t.copy_(r.to(t.device))
                continue
            compute = torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else t.dtype
            value = r.to(device=t.device, dtype=compute)
            if eager:
                value = value + (t.to(compute) - round_.snapshot[k].to(device=t.device, dtype=compute))
            if alpha:
                value = (1.0 - alpha) * value + alpha * t.to(compute)
            t.copy_(value)
        if self.fragments[li] == 1 and len(round_.pieces) == len(tensors) and all(
            a == 0 and b == local_tensor(tensors[i]).numel() for i, a, b in round_.pieces
        ):
            outers.reset_lower(li, tensors)
            if eager or alpha:  # the replicas kept their own progress: the lower anchors differ across them
                for o in outers.by_level[:li]:
                    if o is not None and o.anchors is not None:
                        o.synced = False
        metrics.rounds += 1
        metrics.rounds_applied += 1
        metrics.payload_bytes += round_.payload
        metrics.bytes_sent += bytes_sent(round_.payload, self.level_groups[li])
        metrics.seconds += time.perf_counter() - begin

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[int, dict[str, Any]]:
        """The rounds in flight, each waited for first (its collective completes; no tensor changes): per period
        ``{"fragment", "pieces", "started", "apply_at", "result", "snapshot", "replaced", "payload", "group_size"}``,
        ``pieces`` the round's element ranges ``[position, start, stop]``, ``result`` this rank's copies all-reduced
        (the mean over the group) and ``snapshot`` its ``theta_t`` (or ``None``), one tensor per piece, sharded like
        the averaged tensors. Empty when none is in flight.

        Raises:
            CollectiveError: if a round's collective failed (see :meth:`InFlightRound.wait`).
        """
        out = {}
        for li, r in sorted(self.in_flight.items()):
            r.wait()
            out[self.config.levels[li].period] = {
                "fragment": r.fragment, "pieces": [list(p) for p in r.pieces], "started": r.started, "apply_at": r.apply_at,
                "result": r.wire, "snapshot": r.snapshot, "replaced": r.replaced, "payload": r.payload,
                "group_size": self.level_groups[li].size,
                "meaning": self.meaning(li, compressed=r.compressed is not None),
                **({"compressed": r.compressed.state()} if r.compressed is not None else {}),
            }  # fmt: skip
        return out

    def meaning(self, level_index: int, *, compressed: bool) -> dict[str, Any]:
        """What a round in flight at the level means besides its tensors (saved with it, checked at a resume by
        :func:`~hieravg_optim.in_flight.check_meaning`): the level's delay settings, fragments and group's ranks;
        with ``compressed``, its codec's ``describe()`` and ``ef_decay``. Pure."""
        li, codec = level_index, self.config.level_compress(level_index)
        out = {"delay_steps": self.delays[li], "delay_correction": self.corrections[li],
               "delay_mixing": self.mixing[li], "fragments": self.fragments[li],
               "group_ranks": list(self.level_groups[li].ranks)}  # fmt: skip
        if compressed and codec is not None:
            out.update(compress=codec.describe(), ef_decay=self.config.level_ef_decay(li))
        return out

    def check_state(self, saved: object, step: int) -> dict[int, InFlightRound]:
        """The rounds of a saved ``"in_flight"`` entry, checked against the levels and ``step`` (the saved count);
        changes nothing. Local.

        Raises:
            ValueError: naming the period, for a malformed entry, a period without a delay here, or an apply count
                that is not in ``(step - 1, started + delay_steps]``.
        """
        if not isinstance(saved, Mapping):
            raise ValueError(f"The 'in_flight' entry of the averaging state dict must be a mapping, got {type(saved).__name__}.")
        periods = [lv.period for lv in self.config.levels]
        rounds = {}
        for key, entry in saved.items():
            period = period_of_key(key)
            where = f"The round in flight of period {key!r} in the averaging state dict"
            if period not in periods or not self.delays[periods.index(period)]:
                raise ValueError(
                    f"{where} cannot be resumed: this averager has no delay_steps at that period (delay_steps="
                    f"{self.config.delay_steps}). Resume with the saved run's delay_steps and fragments."
                )
            li = periods.index(period)
            lg = self.level_groups[li]
            if isinstance(entry, Mapping):
                check_meaning(entry, self.meaning(li, compressed="compressed" in entry), where)
            rounds[li] = saved_round(
                entry, where, step, self.delays[li], level_index=li, lg=lg, correction=self.corrections[li]
            )
            codec = self.config.level_compress(li) if lg.group is not None else None
            device = rounds[li].wire[0].device if rounds[li].wire else torch.device("cpu")
            rounds[li].compressed = load_payloads(entry, codec, lg, where, device)
        return rounds

    def load_state(self, rounds: dict[int, InFlightRound]) -> None:
        """Replace the rounds in flight by ``rounds`` (:meth:`check_state`'s output); a current round is waited for
        and dropped."""
        self.wait_all()
        self.in_flight = dict(rounds)

    def held_bytes(self, level_index: int) -> int:
        """Bytes held on this rank for the level's round in flight (0 when none is)."""
        r = self.in_flight.get(level_index)
        return 0 if r is None else r.nbytes()

    def wait_all(self) -> None:
        """Wait for every round in flight (its collective), without applying it."""
        for r in self.in_flight.values():
            r.wait()

"""One averaging round: this library against torch's ``average_parameters`` and a bare all-reduce.

Run (about 6 minutes on 2 CPU cores)::

    OMP_NUM_THREADS=1 python bench/averaging.py

For each world size (2 and 4 gloo ranks on CPU) and each model (GPT-like stacks of
about 10M and 100M float32 parameters, ~150 tensors of mixed sizes), the same
processes time, interleaved and in rotating order:

* ``ours``: :meth:`hieravg_optim.HierarchicalAverager.average` at the top level (agreement
  check + :func:`hieravg_optim.averaging.average_tensors_`), what the optimizer wrapper runs;
* ``ours_raw``: :func:`~hieravg_optim.averaging.average_tensors_` alone;
* ``torch``: ``torch.distributed.algorithms.model_averaging.utils.average_parameters``
  (concatenates into a new model-sized buffer, all-reduces, rebinds ``p.data``);
* ``ours_coalesced``: ``average_tensors_(..., path="coalesced")``, the GPU path (tensors from
  4 MiB in place, the rest in one bucket, foreach pack and unpack, SUM then one ``_foreach_div_``),
  against ``ours_raw`` (``path="auto"``: on CPU the pipelined path): the CPU A/B of the two paths;
* ``floor``: ``dist.all_reduce`` of one preallocated flat float32 buffer of the model's size;
* ``ours_unchecked``: ``ours`` with ``nonfinite="ignore"``, and ``nonfinite_check``:
  :func:`~hieravg_optim.agreement.has_nonfinite` alone (local, every tensor): the cost of the non-finite guard
  (``ours`` runs it, as the default ``nonfinite="raise"`` does: fused into the division of the tensors reduced in
  place, :func:`~hieravg_optim.averaging.prescale_checked_`) is ``ours - ours_unchecked``,
  reported as a fraction of a round, of medians and (``guard_fraction_paired_median``) as the median
  of the per-repetition differences, in wall time and (``guard_fraction_cpu_paired_median``) in CPU time (all
  threads of all ranks, ``time.process_time``: on a machine whose cores are all busy, what the guard takes from
  the others); ``bench/nonfinite.py`` times the check alone against another revision's;
* ``ours_read_guard``: the guard as a separate read of every tensor (``has_nonfinite``, then the unguarded
  round), the design that the fused one replaced, against ``ours``;
* ``half_allreduce``: ``dist.all_reduce`` of a preallocated buffer of half the bucket (the first piece
  of a round's communication), and ``check_during_allreduce``: the check run while that all-reduce is
  in flight (``async_op=True``): how much of the check overlapping it with communication would hide
  (``check_hidden_by_overlap``, of medians).

Each contender has its own copy of the parameters. Time of a round = the slowest
rank's (all ranks start at a barrier); median over ``--reps`` rounds after one warm-up.
Peak extra memory = the largest rise of a rank's peak RSS over its RSS just before a
round (kernel high-water mark, reset before each round), over all rounds including the
first (where ``ours`` allocates its bucket), maximum over ranks.

Sharded mode (4 ranks, 2 ranks per replica, each holding one half of every tensor):
``ours`` averages each shard among the 2 ranks holding it; the bytes each rank
all-reduces, from :meth:`HierarchicalAverager.metrics`, are model / 2.

``--baseline-rev REV`` adds ``baseline_raw``: ``average_tensors_`` of
``hieravg_optim.averaging`` at git revision REV (the package extracted with ``git archive``),
timed in the same processes (A/B).

Results: printed, and written to ``bench/results/averaging.json``.

``--breakdown`` times the phases of the default round instead (agreement, the all-reduce calls alone, pack,
unpack, the in-place division, the guard's check and fused pass), each on its own in the same processes,
interleaved with the whole round and the floor (``_breakdown_rank``), written to
``bench/results/averaging_breakdown.json``: where the time of a round goes (``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The package of this checkout, not an installed one (the spawned ranks inherit sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import PeakMemory, environment, median, spawn, transformer_shapes, write_json  # noqa: E402

MODELS = {
    "1M": dict(d_model=96, layers=6, vocab=4096),
    "10M": dict(d_model=256, layers=10, vocab=8192),
    "42M": dict(d_model=512, layers=12, vocab=8192),
    "100M": dict(d_model=768, layers=12, vocab=16384),
}
"""The default run (``--models``) takes 10M and 100M; 1M and 42M are for the sweep of the paths' crossover by size."""


def _make(shapes, rank, torch):
    return [torch.nn.Parameter(torch.full(s, float(rank))) for s in shapes]


def _load_baseline(path: str):
    """The averaging module of another revision, for A/B runs.

    ``path`` is a folder holding that revision's package, extracted by ``main`` with ``git archive``
    under the name ``hieravg_baseline``; its imports are relative, so it imports beside this one.
    """
    import importlib

    sys.path.insert(0, path)
    return importlib.import_module("hieravg_baseline.averaging")


def _bench_rank(
    rank: int, world_size: int, model_names: list[str], reps: int, bucket_mb: float, sharded: bool, baseline: str | None
):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    from hieravg_optim.agreement import has_nonfinite
    from hieravg_optim.averaging import BucketPool, average_tensors_
    from hieravg_optim.config import AveragingConfig
    from hieravg_optim.optimizer import HierarchicalAverager

    group = dist.group.WORLD
    mem = PeakMemory()
    expected_mean = (world_size - 1) / 2
    results = []
    for name in model_names:
        shapes = transformer_shapes(**MODELS[name])
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        largest = max(int(torch.Size(s).numel()) for s in shapes) * 4
        ours_params = _make(shapes, rank, torch)
        raw_params = _make(shapes, rank, torch)
        torch_params = _make(shapes, rank, torch)
        flat = torch.full((numel,), float(rank))
        averager = HierarchicalAverager(AveragingConfig.create({2: world_size}, bucket_cap_mb=bucket_mb))
        unchecked_params = _make(shapes, rank, torch)
        unchecked = HierarchicalAverager(
            AveragingConfig.create({2: world_size}, bucket_cap_mb=bucket_mb, nonfinite="ignore")
        )
        raw_pool = BucketPool()

        def ours():
            averager.average(-1, [p.detach() for p in ours_params])

        def ours_raw():
            with torch.no_grad():
                average_tensors_(
                    [p.detach() for p in raw_params], group, world_size,
                    bucket_cap_bytes=int(bucket_mb * 1e6), pool=raw_pool,
                )

        def torch_avg():
            average_parameters(iter(torch_params), group)

        def floor():
            dist.all_reduce(flat, group=group)

        def ours_unchecked():
            unchecked.average(-1, [p.detach() for p in unchecked_params])

        def nonfinite_check():
            assert not has_nonfinite([p.detach() for p in ours_params])

        read_guard_params = _make(shapes, rank, torch)
        read_guard = HierarchicalAverager(
            AveragingConfig.create({2: world_size}, bucket_cap_mb=bucket_mb, nonfinite="ignore")
        )

        def ours_read_guard():
            tensors = [p.detach() for p in read_guard_params]
            assert not has_nonfinite(tensors)
            read_guard.average(-1, tensors)

        half = torch.full((int(bucket_mb * 1e6) // 8,), float(rank))

        def half_allreduce():
            dist.all_reduce(half, group=group)

        def check_during_allreduce():
            work = dist.all_reduce(half, group=group, async_op=True)
            assert not has_nonfinite([p.detach() for p in ours_params])
            work.wait()

        coalesced_params = _make(shapes, rank, torch)
        coalesced_pool = BucketPool()

        def ours_coalesced():
            with torch.no_grad():
                average_tensors_(
                    [p.detach() for p in coalesced_params], group, world_size,
                    bucket_cap_bytes=int(bucket_mb * 1e6), pool=coalesced_pool, path="coalesced",
                )

        contenders = {
            "ours": ours, "ours_raw": ours_raw, "ours_coalesced": ours_coalesced, "torch": torch_avg, "floor": floor,
            "ours_unchecked": ours_unchecked, "nonfinite_check": nonfinite_check, "ours_read_guard": ours_read_guard,
            "half_allreduce": half_allreduce, "check_during_allreduce": check_during_allreduce,
        }
        if baseline:
            old = _load_baseline(baseline)
            base_params = _make(shapes, rank, torch)
            base_pool = old.BucketPool()

            def baseline_raw():
                with torch.no_grad():
                    old.average_tensors_(
                        [p.detach() for p in base_params], group, world_size,
                        bucket_cap_bytes=int(bucket_mb * 1e6), pool=base_pool,
                    )

            contenders["baseline_raw"] = baseline_raw
        times = {k: [] for k in contenders}
        cpu = {k: [] for k in contenders}
        peaks = {k: 0 for k in contenders}
        order = list(contenders)
        for rep in range(reps + 1):  # rep 0 is the warm-up (timed for memory only)
            rotated = order[rep % len(order):] + order[: rep % len(order)]
            for key in rotated:
                dist.barrier(group)
                mem.start()
                c0 = time.process_time()
                t0 = time.perf_counter()
                contenders[key]()
                elapsed = time.perf_counter() - t0
                spent = time.process_time() - c0
                peaks[key] = max(peaks[key], mem.stop())
                slowest = torch.tensor([elapsed], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                total_cpu = torch.tensor([spent], dtype=torch.float64)
                dist.all_reduce(total_cpu, group=group)
                if rep > 0:
                    times[key].append(float(slowest))
                    cpu[key].append(float(total_cpu))
            if rep == 0:
                # Correctness once: every contender holds the exact mean of the ranks.
                checked = [
                    ("ours", ours_params), ("ours_raw", raw_params), ("ours_coalesced", coalesced_params),
                    ("torch", torch_params), ("ours_unchecked", unchecked_params), ("ours_read_guard", read_guard_params),
                ]
                if baseline:
                    checked.append(("baseline_raw", base_params))
                for key, ps in checked:
                    for p in (ps[0], ps[len(ps) // 2], ps[-1]):
                        assert torch.all(p == expected_mean), (key, p.flatten()[:3])
        metrics = averager.metrics()[2]
        results.append(
            {
                "model": name,
                "world_size": world_size,
                "numel": numel,
                "tensors": len(shapes),
                "model_bytes": numel * 4,
                "largest_tensor_bytes": largest,
                "bucket_cap_bytes": int(bucket_mb * 1e6),
                "bucket_pool_bytes": averager.pool.nbytes,
                "ours_payload_bytes_per_round": metrics["payload_bytes"] // metrics["rounds"],
                "times_s": times,
                "cpu_s": cpu,
                "peak_extra_bytes": peaks,
            }
        )
        if baseline:
            del base_params, base_pool
        # Freed before the next model (rebound, not deleted: the contenders above refer to these names).
        ours_params = raw_params = torch_params = flat = averager = raw_pool = unchecked_params = unchecked = None
        half = read_guard_params = read_guard = None

    sharded_result = None
    if sharded:
        s = 2
        name = model_names[-1]
        shapes = transformer_shapes(**MODELS[name])
        # Shard index rank % s holds chunk rank % s of every flattened tensor (FSDP2-style
        # per-parameter sharding, torch.chunk sizes), as a replica split over s ranks would.
        mine = []
        for x in shapes:
            n = int(torch.Size(x).numel())
            size = -(-n // s)
            part = max(0, min(size, n - (rank % s) * size))
            if part:
                mine.append((part,))
        shard_numel = sum(x[0] for x in mine)
        params = _make(mine, rank, torch)
        flat = torch.empty(shard_numel)
        averager = HierarchicalAverager(
            AveragingConfig.create({2: world_size}, ranks_per_replica=s, bucket_cap_mb=bucket_mb)
        )
        lg = averager.level_groups[-1]
        times = {"ours": [], "floor": []}
        for rep in range(reps + 1):
            for key in ("ours", "floor") if rep % 2 else ("floor", "ours"):
                dist.barrier(group)
                t0 = time.perf_counter()
                if key == "ours":
                    averager.average(-1, [p.detach() for p in params])
                else:
                    dist.all_reduce(flat, group=lg.group)
                slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                if rep > 0:
                    times[key].append(float(slowest))
        m = averager.metrics()[2]
        total = sum(int(torch.Size(x).numel()) for x in shapes) * 4
        sharded_result = {
            "model": name,
            "world_size": world_size,
            "ranks_per_replica": s,
            "subgroup_ranks": list(lg.ranks),
            "model_bytes": total,
            "shard_bytes": shard_numel * 4,
            "payload_bytes_per_round": m["payload_bytes"] // m["rounds"],
            "bytes_sent_per_round": m["bytes_sent"] // m["rounds"],
            "times_s": times,
        }
    return {"results": results, "sharded": sharded_result, "memory_method": mem.method}


def _breakdown_rank(rank: int, world_size: int, model_names: list[str], reps: int, bucket_mb: float):
    """Where the time of the default round goes: each of its phases timed on its own, in the same processes.

    The phases of the pipelined path (the CPU default), each on its own copy of the tensors, interleaved with the
    whole round (``round``, the default, guard on; ``round_unchecked``, ``nonfinite="ignore"``) and ``floor``:

    * ``agreement``: :func:`~hieravg_optim.agreement.check_agreement` alone (the round's one small all-reduce);
    * ``check_packed``: :func:`~hieravg_optim.nonfinite.has_nonfinite` of the packed tensors (the guard's separate
      read); ``prescale_in_place``: the fused check-and-divide pass over the tensors reduced in place
      (:func:`~hieravg_optim.averaging.prescale_checked_`'s kernel), against ``divide_in_place``, the division
      after the SUM that it replaces (the unguarded round's);
    * ``pack``: ``torch.cat`` of the packed tensors into the bucket halves, local; ``unpack``: the division fused
      into the copy back (``torch.div(..., out=)``), local;
    * ``all_reduce_calls``: the round's all-reduces alone, in its order and overlap (the tensors in place all
      issued at once, then the bucket halves, two in flight), on preallocated buffers, without pack or unpack.

    The sum of the phases against the measured round tells what overlap hides (or contention adds).
    """
    import torch
    import torch.distributed as dist

    from hieravg_optim.agreement import check_agreement
    from hieravg_optim.averaging.pipelined import direct_numel
    from hieravg_optim.config import AveragingConfig
    from hieravg_optim.nonfinite import has_nonfinite
    from hieravg_optim.optimizer import HierarchicalAverager

    group = dist.group.WORLD
    ranks = list(range(world_size))
    cap_bytes = int(bucket_mb * 1e6)
    results = []
    for name in model_names:
        shapes = transformer_shapes(**MODELS[name])
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        direct_min = direct_numel(torch.device("cpu"), torch.float32, cap_bytes, None)
        is_direct = [int(torch.Size(s).numel()) >= direct_min for s in shapes]
        round_params = _make(shapes, rank, torch)
        unchecked_params = _make(shapes, rank, torch)
        averager = HierarchicalAverager(AveragingConfig.create({2: world_size}, bucket_cap_mb=bucket_mb))
        unchecked = HierarchicalAverager(
            AveragingConfig.create({2: world_size}, bucket_cap_mb=bucket_mb, nonfinite="ignore")
        )
        local = [torch.full(s, float(rank)) for s in shapes]
        direct = [t for t, d in zip(local, is_direct) if d]
        packed = [t for t, d in zip(local, is_direct) if not d]
        zeros_direct = [torch.zeros_like(t) for t in direct]
        half = max(1, min(cap_bytes // 4, sum(t.numel() for t in packed)) // 2)
        bucket = torch.zeros(2 * half)
        slots = (bucket[:half], bucket[half:])
        # The packed tensors cut into halves as reduce_packed cuts them: per half, its pieces and its bucket view.
        plan: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        pieces: list[torch.Tensor] = []
        used = 0
        for t in packed:
            flat, start = t.view(-1), 0
            while start < flat.numel():
                take = min(flat.numel() - start, half - used)
                pieces.append(flat[start : start + take])
                used, start = used + take, start + take
                if used == half:
                    plan.append((pieces, slots[len(plan) % 2][:used]))
                    pieces, used = [], 0
        if used:
            plan.append((pieces, slots[len(plan) % 2][:used]))
        flat_buffer = torch.zeros(numel)
        found = torch.zeros(1)
        one = torch.ones(1)

        def round_default():
            averager.average(-1, [p.detach() for p in round_params])

        def round_unchecked():
            unchecked.average(-1, [p.detach() for p in unchecked_params])

        def agreement():
            check_agreement(local, group, ranks, context={"step count": -1}, what="the benchmark", nonfinite=False)

        def check_packed():
            assert not has_nonfinite(packed)

        def prescale_in_place():  # the same kernel and bytes as prescale_checked_ (scale 1: values kept)
            torch._amp_foreach_non_finite_check_and_unscale_(direct, found, one)

        def divide_in_place():
            for t in direct:
                t.div_(1.0)

        def pack():
            for members, view in plan:
                torch.cat(members, out=view)

        def unpack():
            for members, view in plan:
                offset = 0
                for piece in members:
                    torch.div(view[offset : offset + piece.numel()], 1.0, out=piece)
                    offset += piece.numel()

        def all_reduce_calls():
            works = [dist.all_reduce(t, group=group, async_op=True) for t in zeros_direct]
            halves: list = []
            for i, (_, view) in enumerate(plan):
                if i >= 2:
                    for w in works:
                        w.wait()
                    works = []
                    halves[i - 2].wait()
                halves.append(dist.all_reduce(view, group=group, async_op=True))
            for w in works + halves[-2:]:
                w.wait()

        def floor():
            dist.all_reduce(flat_buffer, group=group)

        contenders = {
            "round": round_default, "round_unchecked": round_unchecked, "floor": floor, "agreement": agreement,
            "check_packed": check_packed, "prescale_in_place": prescale_in_place, "divide_in_place": divide_in_place,
            "pack": pack, "unpack": unpack, "all_reduce_calls": all_reduce_calls,
        }
        times = {k: [] for k in contenders}
        cpu = {k: [] for k in contenders}
        order = list(contenders)
        for rep in range(reps + 1):  # rep 0: warm-up
            for key in order[rep % len(order):] + order[: rep % len(order)]:
                dist.barrier(group)
                c0 = time.process_time()
                t0 = time.perf_counter()
                contenders[key]()
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                spent = torch.tensor([time.process_time() - c0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(spent, group=group)
                if rep > 0:
                    times[key].append(float(elapsed))
                    cpu[key].append(float(spent))
        expected = (world_size - 1) / 2
        for ps in (round_params, unchecked_params):
            assert all(bool(torch.all(p == expected)) for p in ps)
        results.append(
            {
                "model": name, "world_size": world_size, "numel": numel,
                "direct_tensors": len(direct), "direct_bytes": sum(t.numel() for t in direct) * 4,
                "packed_tensors": len(packed), "packed_bytes": sum(t.numel() for t in packed) * 4,
                "bucket_halves_per_round": len(plan), "times_s": times, "cpu_s": cpu,
            }
        )
        round_params = unchecked_params = averager = unchecked = local = direct = packed = zeros_direct = None
        bucket = flat_buffer = plan = pieces = slots = None
    return results


def _breakdown(args) -> None:
    env = environment()
    rows = []
    for ws in (int(x) for x in args.world_sizes.split(",")):
        for r in spawn(_breakdown_rank, ws, args.models.split(","), args.reps, args.bucket_mb)[0]:
            r["median_s"] = {k: median(v) for k, v in r["times_s"].items()}
            r["cpu_median_s"] = {k: median(v) for k, v in r["cpu_s"].items()}
            rows.append(r)
    phases = ("agreement", "all_reduce_calls", "pack", "unpack", "divide_in_place")
    print(f"\nWhere a round's time goes, gloo on CPU, float32, bucket {args.bucket_mb} MB; median of {args.reps} "
          f"(wall: slowest rank; CPU: all ranks' threads); load average at start {env['load_average_1_5_15']}")
    for r in rows:
        m, c = r["median_s"], r["cpu_median_s"]
        print(f"{r['model']} on {r['world_size']} ranks: {r['direct_tensors']} tensors in place "
              f"({r['direct_bytes'] / 1e6:.1f} MB), {r['packed_tensors']} packed ({r['packed_bytes'] / 1e6:.1f} MB, "
              f"{r['bucket_halves_per_round']} bucket halves)")
        print(f"  {'phase':<18} {'wall ms':>8} {'/floor':>7} {'CPU ms':>8} {'/floor':>7}")
        for k in ("round", "round_unchecked", "floor", *phases, "check_packed", "prescale_in_place"):
            print(f"  {k:<18} {1e3 * m[k]:8.1f} {m[k] / m['floor']:7.2f} {1e3 * c[k]:8.1f} {c[k] / c['floor']:7.2f}")
        parts, parts_cpu = sum(m[k] for k in phases), sum(c[k] for k in phases)
        print(f"  {'sum of phases':<18} {1e3 * parts:8.1f} {parts / m['floor']:7.2f} {1e3 * parts_cpu:8.1f} "
              f"{parts_cpu / c['floor']:7.2f}  (against round_unchecked: overlap hides "
              f"{100 * (1 - m['round_unchecked'] / parts):.0f}% wall, {100 * (1 - c['round_unchecked'] / parts_cpu):.0f}% CPU)")
        guard = m["check_packed"] + m["prescale_in_place"] - m["divide_in_place"]
        guard_cpu = c["check_packed"] + c["prescale_in_place"] - c["divide_in_place"]
        print(f"  guard = check_packed + prescale_in_place - divide_in_place: {1e3 * guard:.1f} ms "
              f"({100 * guard / m['round_unchecked']:.1f}% of round_unchecked), CPU {1e3 * guard_cpu:.1f} ms "
              f"({100 * guard_cpu / c['round_unchecked']:.1f}%); measured round - round_unchecked: "
              f"{100 * (m['round'] / m['round_unchecked'] - 1):+.1f}% wall, {100 * (c['round'] / c['round_unchecked'] - 1):+.1f}% CPU")
    path = write_json(args.out if args.out != "averaging.json" else "averaging_breakdown.json",
                      {"environment": env, "bucket_mb": args.bucket_mb, "reps": args.reps, "rows": rows})
    print(f"written: {path}")


def _fmt_mb(b: float) -> str:
    return f"{b / 1e6:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--models", default="10M,100M", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--reps", type=int, default=11, help="timed rounds per contender (median reported), >= 5")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--out", default="averaging.json", help="file name under bench/results/")
    parser.add_argument(
        "--baseline-rev", default=None,
        help="also time average_tensors_ of hieravg_optim.averaging at this git revision (A/B), as baseline_raw",
    )
    parser.add_argument(
        "--breakdown", action="store_true",
        help="time the phases of the default round instead (pack, all-reduce calls, unpack, check, agreement), "
        "written to bench/results/averaging_breakdown.json",
    )
    args = parser.parse_args()
    if args.breakdown:
        _breakdown(args)
        return
    models = args.models.split(",")
    baseline = None
    if args.baseline_rev:
        import subprocess
        import tempfile

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        baseline = tempfile.mkdtemp(prefix="hieravg-baseline-")
        archive = subprocess.run(
            ["git", "archive", args.baseline_rev, "hieravg_optim"], cwd=root, check=True, capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", baseline], input=archive, check=True)
        os.rename(os.path.join(baseline, "hieravg_optim"), os.path.join(baseline, "hieravg_baseline"))
    env = environment()
    rows, sharded = [], []
    memory_method = None
    for ws in (int(x) for x in args.world_sizes.split(",")):
        per_rank = spawn(_bench_rank, ws, models, args.reps, args.bucket_mb, ws >= 4, baseline)
        memory_method = per_rank[0]["memory_method"]
        for i, r in enumerate(per_rank[0]["results"]):
            r = dict(r)
            r["peak_extra_bytes"] = {k: max(pr["results"][i]["peak_extra_bytes"][k] for pr in per_rank) for k in r["peak_extra_bytes"]}
            med = {k: median(v) for k, v in r["times_s"].items()}
            r["median_s"] = med
            r["ratio_ours_floor"] = med["ours"] / med["floor"]
            r["ratio_ours_raw_floor"] = med["ours_raw"] / med["floor"]
            r["ratio_ours_ours_raw"] = med["ours"] / med["ours_raw"]
            r["ratio_ours_torch"] = med["ours"] / med["torch"]
            # The fastest round of each: less sensitive to other jobs on a shared machine.
            best = {k: min(v) for k, v in r["times_s"].items()}
            r["min_s"] = best
            r["min_ratio_ours_floor"] = best["ours"] / best["floor"]
            r["min_ratio_ours_torch"] = best["ours"] / best["torch"]
            r["ours_memory_target_bytes"] = r["bucket_cap_bytes"] + r["largest_tensor_bytes"]
            # The non-finite guard: what the default (nonfinite="raise") adds to a round (target <= 5%).
            r["guard_fraction_of_round"] = (med["ours"] - med["ours_unchecked"]) / med["ours_unchecked"]
            r["check_fraction_of_round"] = med["nonfinite_check"] / med["ours_unchecked"]
            # Paired per repetition (both timed in the same rotation), less sensitive to drifting load.
            r["guard_fraction_paired_median"] = median(
                [(a - b) / b for a, b in zip(r["times_s"]["ours"], r["times_s"]["ours_unchecked"])]
            )
            r["read_guard_fraction_paired_median"] = median(
                [(a - b) / b for a, b in zip(r["times_s"]["ours_read_guard"], r["times_s"]["ours_unchecked"])]
            )
            r["cpu_median_s"] = {k: median(v) for k, v in r["cpu_s"].items()}
            r["guard_fraction_cpu_paired_median"] = median(
                [(a - b) / b for a, b in zip(r["cpu_s"]["ours"], r["cpu_s"]["ours_unchecked"])]
            )
            r["read_guard_fraction_cpu_paired_median"] = median(
                [(a - b) / b for a, b in zip(r["cpu_s"]["ours_read_guard"], r["cpu_s"]["ours_unchecked"])]
            )
            # Overlap: the share of the check that an all-reduce of half a bucket in flight hides.
            r["check_hidden_by_overlap"] = (
                med["half_allreduce"] + med["nonfinite_check"] - med["check_during_allreduce"]
            ) / med["nonfinite_check"]
            if "baseline_raw" in med:
                r["baseline_rev"] = args.baseline_rev
                r["ratio_ours_raw_baseline_raw"] = med["ours_raw"] / med["baseline_raw"]
                r["ratio_baseline_raw_floor"] = med["baseline_raw"] / med["floor"]
            rows.append(r)
        if per_rank[0]["sharded"]:
            s = dict(per_rank[0]["sharded"])
            s["median_s"] = {k: median(v) for k, v in s["times_s"].items()}
            s["ratio_ours_floor"] = s["median_s"]["ours"] / s["median_s"]["floor"]
            s["payload_bytes_per_round_by_rank"] = [pr["sharded"]["payload_bytes_per_round"] for pr in per_rank]
            sharded.append(s)

    print(f"\nAveraging round, gloo on CPU, float32, bucket {args.bucket_mb} MB; median of {args.reps} "
          f"(slowest rank per round); load average at start {env['load_average_1_5_15']}")
    hdr = (f"{'model':>5} {'ranks':>5} | {'ours s':>8} {'raw s':>8} {'torch s':>8} {'floor s':>8} | "
           f"{'ours/floor':>10} {'ours/torch':>10} | {'MB: ours':>8} {'torch':>8} {'floor':>8} {'target':>8} {'model':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        m, p = r["median_s"], r["peak_extra_bytes"]
        print(
            f"{r['model']:>5} {r['world_size']:>5} | {m['ours']:8.3f} {m['ours_raw']:8.3f} {m['torch']:8.3f} "
            f"{m['floor']:8.3f} | {r['ratio_ours_floor']:10.2f} {r['ratio_ours_torch']:10.2f} | "
            f"{_fmt_mb(p['ours'])} {_fmt_mb(p['torch'])} {_fmt_mb(p['floor'])} "
            f"{_fmt_mb(r['ours_memory_target_bytes'])} {_fmt_mb(r['model_bytes'])}"
        )
    print("ours: the default round (nonfinite=\"raise\", guard on); raw: average_tensors_ alone (no agreement, no guard)")
    print("targets: ours/floor <= 1.3, ours/torch <= 0.7, ours peak extra <= bucket + largest tensor")
    for r in rows:
        print(f"default round / raw: {r['model']} on {r['world_size']} ranks: {r['ratio_ours_ours_raw']:.2f} (target <= 1.03)")
    for r in rows:
        print(f"fastest rounds: {r['model']} on {r['world_size']} ranks: ours/floor {r['min_ratio_ours_floor']:.2f}, "
              f"ours/torch {r['min_ratio_ours_torch']:.2f}")
    for r in rows:
        print(f"non-finite guard: {r['model']} on {r['world_size']} ranks: round {r['median_s']['ours']:.3f} s "
              "checked, "
              f"{r['median_s']['ours_unchecked']:.3f} s unchecked (+{100 * r['guard_fraction_of_round']:.1f}%); "
              f"the check alone {r['median_s']['nonfinite_check']:.4f} s ({100 * r['check_fraction_of_round']:.1f}% "
              f"of a round); paired per round +{100 * r['guard_fraction_paired_median']:.1f}%, in CPU time "
              f"+{100 * r['guard_fraction_cpu_paired_median']:.1f}%; target <= 3%")
        print(f"  the guard as a separate read (ours_read_guard): paired per round "
              f"+{100 * r['read_guard_fraction_paired_median']:.1f}%, in CPU time "
              f"+{100 * r['read_guard_fraction_cpu_paired_median']:.1f}%")
        print(f"  overlapped with an all-reduce of half a bucket ({r['median_s']['half_allreduce']:.4f} s alone): "
              f"{r['median_s']['check_during_allreduce']:.4f} s, {100 * r['check_hidden_by_overlap']:.0f}% of the "
              "check hidden")
        m = r["median_s"]
        print(f"A/B paths: {r['model']} on {r['world_size']} ranks: coalesced {m['ours_coalesced']:.3f} s, "
              f"pipelined {m['ours_raw']:.3f} s (coalesced/pipelined {m['ours_coalesced'] / m['ours_raw']:.2f})")
    for r in rows:
        if "baseline_raw" in r["median_s"]:
            print(f"A/B: {r['model']} on {r['world_size']} ranks: average_tensors_ now / at {r['baseline_rev']}: "
                  f"{r['ratio_ours_raw_baseline_raw']:.2f} (baseline/floor {r['ratio_baseline_raw_floor']:.2f}, "
                  f"now/floor {r['ratio_ours_raw_floor']:.2f})")
    for s in sharded:
        print(
            f"sharded: {s['model']} on {s['world_size']} ranks, {s['ranks_per_replica']} ranks per replica: "
            f"each rank all-reduces {s['payload_bytes_per_round_by_rank']} bytes per round "
            f"(model {s['model_bytes']} bytes / {s['ranks_per_replica']}); ours {s['median_s']['ours']:.3f} s, "
            f"floor {s['median_s']['floor']:.3f} s (ours/floor {s['ratio_ours_floor']:.2f})"
        )
    path = write_json(
        args.out,
        {"environment": env, "bucket_mb": args.bucket_mb, "reps": args.reps, "memory_method": memory_method,
         "rows": rows, "sharded": sharded},
    )
    print(f"written: {path}")


if __name__ == "__main__":
    main()

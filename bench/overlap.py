"""Overlap of a delayed round with the inner steps: seconds per step with ``delay_steps`` 0 and > 0, side by side.

Two gloo ranks average one float32 tensor of ``--mb`` MB every ``--period`` steps. The inner step is simulated by
``time.sleep(--compute-ms)``: the time an accelerator computes while the host thread waits, during which gloo's
threads can move the bytes of a round in flight. With ``delay_steps=0`` the averaging step costs the all-reduce on
top of the step; with ``delay_steps=d`` it runs during the next ``d`` steps. Prints, per mode, the median, the
slowest and the mean seconds per step, and the ratios to ``delay_steps=0``.

    PYTHONPATH=. python bench/overlap.py --mb 200 --period 4 --compute-ms 60 --steps 24

``--agreement`` instead times, on the same gloo ranks (``--ranks``, default 2), the one collective a delayed round
adds to its apply step (:func:`hieravg_optim.agreement.agree_across_ranks`: an all-gather of two int64 per rank,
that every rank can apply it) against the all-reduce of the ``--mb`` MB float32 tensor the round moves,
interleaved, ``--steps`` of each after a warm-up; prints their medians and the ratio.

``--guard`` times the non-finite guard (``nonfinite="raise"`` against ``"ignore"``) in the synchronous round and in
the start of a delayed one (``delay_steps=1``: what the training thread spends at the round's count, the all-reduce
running in the background), on the ``--ranks`` gloo ranks, each with its own copy of the 10M-parameter GPT-like
model of ``bench/averaging.py``; the four averagers are called in rotating order, ``--steps`` rounds each after
a warm-up; prints the medians of the per-round differences (raise - ignore) as fractions of each ``"ignore"``
median.

Not part of the library and not run by the test suite.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import median, spawn  # noqa: E402


def _run(rank, world_size, mb, period, compute_ms, steps, delay):
    import torch

    from hieravg_optim import AveragingConfig, HierarchicalAverager

    averager = HierarchicalAverager(AveragingConfig.create({period: world_size}, delay_steps=delay))
    tensors = [torch.full((int(mb * 1e6) // 4,), float(rank))]
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        time.sleep(compute_ms / 1000)  # the inner step
        averager.step_and_average(lambda: tensors)
        times.append(time.perf_counter() - begin)
    averager.apply_rounds_in_flight(tensors)
    return times[period:]  # past the first period (group setup, first buffers)


def _agreement(rank, world_size, mb, reps):
    import torch
    import torch.distributed as dist

    from hieravg_optim.agreement import agree_across_ranks

    tensor = torch.full((int(mb * 1e6) // 4,), float(rank))
    agree, reduce = [], []
    for i in range(reps + 1):
        dist.barrier()
        begin = time.perf_counter()
        agree_across_ranks("the tensors the round is applied to", None, None)
        middle = time.perf_counter()
        dist.all_reduce(tensor)
        end = time.perf_counter()
        if i:  # past the warm-up
            agree.append(middle - begin)
            reduce.append(end - middle)
    return median(agree), median(reduce)


def _guard(rank, world_size, reps):
    import torch
    import torch.distributed as dist

    from bench._common import transformer_shapes
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    torch.manual_seed(rank)
    shapes = transformer_shapes(d_model=256, layers=10, vocab=8192)
    kinds = [(delay, policy) for delay in (0, 1) for policy in ("raise", "ignore")]
    averagers = {k: HierarchicalAverager(AveragingConfig.create({2: world_size}, delay_steps=k[0], nonfinite=k[1]))
                 for k in kinds}  # fmt: skip
    tensors = {k: [torch.randn(s) for s in shapes] for k in kinds}
    times: dict = {k: [] for k in kinds}
    for i in range(reps + 1):
        for k in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:  # rotating order
            dist.barrier()
            begin = time.perf_counter()
            averagers[k].step_and_average(lambda k=k: tensors[k])  # the round's count: sync round or delayed start
            elapsed = time.perf_counter() - begin
            averagers[k].step_and_average(lambda k=k: tensors[k])  # the next count: the delayed round applied
            if i:
                times[k].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--compute-ms", type=float, default=60.0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--delays", default="0,1,3")
    parser.add_argument("--show", action="store_true", help="print rank 0's seconds per step too")
    parser.add_argument("--agreement", action="store_true", help="time the apply's agreement against the all-reduce")
    parser.add_argument("--guard", action="store_true", help="time the non-finite guard, synchronous and delayed")
    parser.add_argument("--ranks", type=int, default=2, help="--agreement, --guard: gloo ranks")
    args = parser.parse_args()
    if args.guard:
        times = spawn(_guard, args.ranks, args.steps)[0]
        print(f"{args.ranks} gloo ranks, 10M parameters, rank 0, {args.steps} rounds each:")
        for delay, what in ((0, "synchronous round"), (1, "delayed round's start")):
            raised, ignored = times[(delay, "raise")], times[(delay, "ignore")]
            paired = median([a - b for a, b in zip(raised, ignored)])
            print(f"  {what}: ignore {1e3 * median(ignored):.1f} ms, raise {1e3 * median(raised):.1f} ms, guard "
                  f"(median of paired differences) {1e3 * paired:.2f} ms = {paired / median(ignored):+.1%} of it")
        return
    if args.agreement:
        agree, reduce = spawn(_agreement, args.ranks, args.mb, args.steps)[0]
        print(f"{args.ranks} gloo ranks, rank 0's medians of {args.steps}: the apply's agreement {1e3 * agree:.3f} ms, "
              f"all_reduce of {args.mb:g} MB {1e3 * reduce:.1f} ms, ratio {agree / reduce:.4f}")
        return
    rows = []
    for delay in (int(d) for d in args.delays.split(",")):
        times = spawn(_run, 2, args.mb, args.period, args.compute_ms, args.steps, delay)[0]
        if args.show:
            print(f"delay_steps={delay}:", " ".join(f"{t:.2f}" for t in times))
        rows.append((delay, median(times), max(times), sum(times) / len(times)))
    base = rows[0]
    print(f"{args.mb:g} MB, period {args.period}, inner step {args.compute_ms:g} ms, 2 gloo ranks")
    print("delay_steps  median_s  slowest_s  mean_s  slowest/median  mean vs delay 0")
    for delay, med, slow, mean in rows:
        print(f"{delay:11d}  {med:8.3f}  {slow:9.3f}  {mean:6.3f}  {slow / med:14.2f}  {base[3] / mean:14.2f}x")


if __name__ == "__main__":
    main()

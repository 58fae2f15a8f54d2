"""Overlap of a delayed round with the inner steps: seconds per step with ``delay_steps`` 0 and > 0, side by side.

Two gloo ranks average one float32 tensor of ``--mb`` MB every ``--period`` steps. The inner step is simulated by
``time.sleep(--compute-ms)``: the time an accelerator computes while the host thread waits, during which gloo's
threads can move the bytes of a round in flight. With ``delay_steps=0`` the averaging step costs the all-reduce on
top of the step; with ``delay_steps=d`` it runs during the next ``d`` steps. Prints, per mode, the median, the
slowest and the mean seconds per step, and the ratios to ``delay_steps=0``.

    PYTHONPATH=. python bench/overlap.py --mb 200 --period 4 --compute-ms 60 --steps 24

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--compute-ms", type=float, default=60.0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--delays", default="0,1,3")
    parser.add_argument("--show", action="store_true", help="print rank 0's seconds per step too")
    args = parser.parse_args()
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

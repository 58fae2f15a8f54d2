"""Cost of the wrapper on steps that do not average: wrapped ``step()`` against the bare inner optimizer.

Run (about 1 minute on 2 CPU cores)::

    OMP_NUM_THREADS=1 python bench/overhead.py

On 2 gloo ranks (rank 0 times, rank 1 waits, so they do not compete for cores), blocks
of about ``--block-seconds`` of optimizer steps, interleaved in alternating order, of (a) the bare inner optimizer and (b) the same optimizer class wrapped
in :class:`hieravg_optim.HierarchicalAveragingOptimizer` (levels ``{2**30: 2}``, warmup 1,
so no step of the measured blocks averages; asserted through ``metrics()``), each on its
own copy of the parameters with fixed gradients. Reported: the median block time per
step of each, and their ratio (target <= 1.02), per model and inner optimizer; and,
less sensitive to load, the wrapper's own work per non-averaging step timed alone
(``wrapped.step()`` in a tight loop with the inner step replaced by a no-op) and
``(bare + that) / bare``.

Models: the digits MLP of the examples (26k parameters, 6 tensors: the worst case, the
step itself is tiny) and a GPT-like stack of about 10M parameters (~150 tensors).

Results: printed, and written to ``bench/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The package of this checkout, not an installed one (the spawned ranks inherit sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, median, spawn, transformer_shapes, write_json  # noqa: E402


PERIOD = 1 << 30
"""The only level's period: far beyond the steps taken, so no measured step averages."""


def _params(kind: str, torch):
    if kind == "mlp_26k":
        shapes = [(128, 64), (128,), (128, 128), (128,), (10, 128), (10,)]
    else:
        shapes = transformer_shapes(d_model=256, layers=10, vocab=8192)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def _rank(rank: int, world_size: int, models: list[str], blocks: int, target_block_s: float):
    import torch

    from hieravg_optim import HierarchicalAveragingOptimizer

    inner = {
        "SGD(momentum=0.9)": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    }
    out = []
    for model in models:
        for name, make in inner.items():
            wrapped = HierarchicalAveragingOptimizer(make(_params(model, torch)), {PERIOD: world_size}, warmup_steps=1)
            # Count 0 is in warmup: no averaging. Every rank takes this first step: it is where the
            # ranks check, once, that they agree on the count (a collective).
            wrapped.step()
            if rank != 0:
                continue  # only rank 0 times, so the ranks do not compete for the cores
            bare = make(_params(model, torch))
            bare.step()  # state initialised like the wrapped one's
            # Steps per block so that one block takes about target_block_s.
            t0 = time.perf_counter()
            for _ in range(5):
                bare.step()
            per_step = (time.perf_counter() - t0) / 5
            steps = max(5, int(target_block_s / per_step))
            times = {"bare": [], "wrapped": []}
            for b in range(blocks):
                for key in (("bare", "wrapped") if b % 2 == 0 else ("wrapped", "bare")):
                    opt = bare if key == "bare" else wrapped
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        opt.step()
                    times[key].append((time.perf_counter() - t0) / steps)
            # The wrapper's own work on a non-averaging step, isolated: wrapped.step() with the inner
            # step replaced by a no-op on this instance (hooks, schedule, count): µs, less noisy.
            averager = wrapped.averager
            n_iso = 4000
            iso = []
            wrapped.optimizer.step = lambda *a, **k: None
            try:
                for _ in range(7):
                    averager.step = 1
                    t0 = time.perf_counter()
                    for _ in range(n_iso):
                        wrapped.step()
                    iso.append((time.perf_counter() - t0) / n_iso)
            finally:
                del wrapped.optimizer.step
            rounds = sum(m["rounds"] for m in wrapped.metrics().values())
            assert rounds == 0, f"a measured step averaged ({rounds} rounds): not a non-averaging step"
            assert wrapped.averaging_step < PERIOD, wrapped.averaging_step
            med = {k: median(v) for k, v in times.items()}
            out.append(
                {
                    "model": model,
                    "inner": name,
                    "rank": rank,
                    "steps_per_block": steps,
                    "blocks": blocks,
                    "median_step_s": med,
                    "ratio_wrapped_bare": med["wrapped"] / med["bare"],
                    "overhead_us_per_step": (med["wrapped"] - med["bare"]) * 1e6,
                    "isolated_wrapper_us_per_step": median(iso) * 1e6,
                    "isolated_ratio": (med["bare"] + median(iso)) / med["bare"],
                    "times_s": times,
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp_26k,gpt_10M")
    parser.add_argument("--blocks", type=int, default=15, help="timed blocks per contender (median), >= 5")
    parser.add_argument("--block-seconds", type=float, default=0.1)
    parser.add_argument("--out", default="overhead.json")
    args = parser.parse_args()
    env = environment()
    per_rank = spawn(_rank, 2, args.models.split(","), args.blocks, args.block_seconds)
    rows = per_rank[0]
    print(f"\nNon-averaging step, wrapped vs bare inner optimizer; median of {args.blocks} blocks per rank, "
          f"rank 0 of 2 times; load average at start {env['load_average_1_5_15']}")
    hdr = (f"{'model':>9} {'inner':>18} | {'bare us':>9} {'wrapped us':>10} | {'ratio':>6} {'+us/step':>8} | "
           f"{'isolated us':>11} {'ratio':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        m = r["median_step_s"]
        print(f"{r['model']:>9} {r['inner']:>18} | {m['bare'] * 1e6:9.1f} {m['wrapped'] * 1e6:10.1f} | "
              f"{r['ratio_wrapped_bare']:6.3f} {r['overhead_us_per_step']:8.1f} | "
              f"{r['isolated_wrapper_us_per_step']:11.2f} {r['isolated_ratio']:6.4f}")
    print("target: ratio <= 1.02. isolated: the wrapper's own work per non-averaging step "
          "(wrapped step with a no-op inner step), and (bare + isolated) / bare")
    path = write_json(args.out, {"environment": env, "blocks": args.blocks, "rows": rows})
    print(f"written: {path}")


if __name__ == "__main__":
    main()

"""The codecs' own cost per round (issue 25) against the all-reduce floor, at 10M and 100M parameters.

Run (a few minutes on 2 CPU cores; needs a ``hieravg_optim`` with ``hieravg_optim.compression``)::

    OMP_NUM_THREADS=1 python bench/codecs.py                   # 2 and 4 gloo ranks, 10M and 100M
    OMP_NUM_THREADS=1 python bench/codecs.py --world-sizes 4 --sizes 10

For each world size and each size (one flat float32 tensor of N elements per rank, N(0, 1) values, another
seed per rank), the same processes time, interleaved (the order rotates every repetition):

* ``floor``: ``dist.all_reduce`` of the preallocated flat tensor: an uncompressed round's communication;
* ``encode``: the codec's ``encode`` of the tensor (the payload a rank sends);
* ``decode``: ``decode_add_`` of the group's ``world_size`` payloads, in rank order, into one fp32 accumulator
  (what every rank does after the exchange);
* ``exchange``: ``dist.all_gather_single`` of the payloads (the compressed round's communication).

Codecs: ``int8`` (:class:`~hieravg_optim.compression.Int8Block`, blocks of 256) and top-k 1% with int8
values (:class:`~hieravg_optim.compression.TopK`, chunks of 4096). Time = the slowest rank's (all start at a
barrier), median over ``--reps`` repetitions after one warm-up. Reported: each part over the floor, the codec's
own cost ``(encode + decode) / floor``, and the compressed round's communication plus codec
``(encode + exchange + decode) / floor``. This measures the codecs in isolation, on one flat tensor; the
library's round also copies the pseudo-gradient and the residual (``docs/compression.md``).

Results: printed, and written to ``bench/results/codecs.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, median, spawn, write_json  # noqa: E402

PARTS = ("floor", "encode", "decode", "exchange")


def _codecs():
    try:
        from hieravg_optim.compression import Int8Block, TopK
    except ImportError as exc:
        import hieravg_optim

        raise SystemExit(
            f"bench/codecs.py needs hieravg_optim.compression (issue 25), not in {os.path.dirname(hieravg_optim.__file__)}"
            f" ({exc}); run with a build that has it (PYTHONPATH)."
        ) from None
    return {"int8": Int8Block(block=256), "topk 1% int8": TopK(density=0.01, chunk=4096, values="int8")}


def _rank(rank: int, world_size: int, sizes: list[int], reps: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    codecs = _codecs()
    out = []
    for numel in sizes:
        flat = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        reduced = flat.clone()
        for name, codec in codecs.items():
            nbytes = codec.payload_nbytes(numel)
            gathered = torch.empty(world_size * nbytes, dtype=torch.uint8)
            acc = torch.zeros(codec.padded_numel(numel), dtype=torch.float32)
            payload = codec.encode(flat)
            assert payload.numel() == nbytes, (payload.numel(), nbytes)

            def floor():
                dist.all_reduce(reduced)

            def encode():
                codec.encode(flat)

            def decode():
                acc.zero_()
                for r in range(world_size):
                    codec.decode_add_(gathered[r * nbytes : (r + 1) * nbytes], acc)

            def exchange():
                dist.all_gather_single(gathered, payload)

            fns = {"floor": floor, "encode": encode, "decode": decode, "exchange": exchange}
            exchange()  # every rank's real payload in the buffer that decode reads
            times: dict[str, list[float]] = {k: [] for k in PARTS}
            for rep in range(reps + 1):
                order = PARTS[rep % len(PARTS) :] + PARTS[: rep % len(PARTS)]
                for key in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    fns[key]()
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
                    if rep:  # the first repetition warms up
                        times[key].append(float(dt))
            out.append({"codec": name, "spec": codec.describe(), "numel": numel, "world_size": world_size,
                        "payload_bytes": nbytes, "fp32_bytes": 4 * numel, "times_s": times})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated numbers of gloo ranks")
    parser.add_argument("--sizes", default="10,100", help="comma-separated millions of float32 elements")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (after one warm-up)")
    parser.add_argument("--name", default="codecs", help="output file bench/results/NAME.json")
    args = parser.parse_args()
    _codecs()  # SystemExit here, before any spawn, without the codecs
    env = environment()
    sizes = [int(float(s) * 1_000_000) for s in args.sizes.split(",")]
    rows = []
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        rows += spawn(_rank, world_size, sizes, args.reps)[0]  # the times are all-reduced: the same on every rank
    print(f"\ncodecs, load average at start {env['load_average_1_5_15']}; medians of {args.reps}, slowest rank")
    hdr = (f"{'codec':>13} {'M':>4} {'ranks':>5} | {'floor s':>8} {'encode s':>8} {'decode s':>8} {'exch s':>8} | "
           f"{'payload/fp32':>12} {'codec/floor':>11} {'round/floor':>11}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        m = {k: median(v) for k, v in r["times_s"].items()}
        r["median_s"] = m
        r["payload_over_fp32"] = r["payload_bytes"] / r["fp32_bytes"]
        r["codec_over_floor"] = (m["encode"] + m["decode"]) / m["floor"]
        r["compressed_round_over_floor"] = (m["encode"] + m["exchange"] + m["decode"]) / m["floor"]
        print(f"{r['codec']:>13} {r['numel'] / 1e6:4.0f} {r['world_size']:5d} | {m['floor']:8.3f} {m['encode']:8.3f} "
              f"{m['decode']:8.3f} {m['exchange']:8.3f} | {r['payload_over_fp32']:12.4f} {r['codec_over_floor']:11.2f} "
              f"{r['compressed_round_over_floor']:11.2f}")
    path = write_json(f"{args.name}.json", {"environment": env, "args": vars(args), "reps": args.reps, "rows": rows})
    print(f"written: {path}")


if __name__ == "__main__":
    main()

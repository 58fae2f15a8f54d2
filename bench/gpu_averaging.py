"""One averaging round on GPUs with NCCL: this library against torch and the all-reduce floor.

Run on one GPU (under 2 minutes)::

    python bench/gpu_averaging.py

or on several GPUs of one machine, which adds the NCCL all-reduce floor::

    torchrun --nproc-per-node 8 bench/gpu_averaging.py

CPU smoke run (gloo, tiny models, a few rounds; checks every contender's result)::

    python bench/gpu_averaging.py --smoke

For each model (GPT-like stacks of 292 tensors, about 350M and 1.3B parameters) in
float32 and bfloat16, the same processes time, interleaved and in rotating order:

* ``ours``: :func:`hieravg_optim.averaging.average_tensors_` with its defaults (on GPU the
  coalesced path: contiguous tensors from 1 MiB in place, the rest in one bucket, one
  coalesced NCCL group, ``ReduceOp.AVG``; each tensor in its own dtype);
* ``previous``: the pipelined path with float32 on the wire (``path="pipelined",
  comm_dtype="float32"``), the design before the coalesced path: bfloat16 summed in float32
  buckets;
* ``torch``: ``torch.distributed.algorithms.model_averaging.utils.average_parameters``;
* ``all_in_place``: every tensor in place in one coalesced group with ``ReduceOp.AVG``
  (``path="coalesced", direct_min_bytes=0``);
* ``floor`` (two or more ranks): one ``all_reduce`` of a preallocated flat buffer of the
  model's size and dtype.

With one GPU the all-reduce itself is nearly free, so the times are each design's own
local work (copies, kernel launches). Each contender has its own copy of the parameters,
set to the rank; time of a round = the slowest rank's, after a barrier and a device
synchronization; median over ``--reps`` rounds after one warm-up. Peak extra GPU memory =
``torch.cuda.max_memory_allocated`` during the round minus the memory allocated before it,
maximum over rounds and ranks (the warm-up, where buckets are allocated, included).

Results: printed, and written to ``bench/results/gpu_averaging.json`` (``--smoke``:
``gpu_averaging_smoke.json``), or under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, transformer_shapes, write_json  # noqa: E402

MODELS = {
    "350M": dict(d_model=1024, layers=24, vocab=50257),
    "1.3B": dict(d_model=2048, layers=24, vocab=50257),
}
SMOKE_MODELS = {"tiny": dict(d_model=64, layers=2, vocab=512)}
DTYPES = ("fp32", "bf16")


def _init(smoke: bool):
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "gloo" if smoke else "nccl"
    if "RANK" in os.environ:  # torchrun
        if not smoke:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    else:
        init_file = os.path.join(tempfile.mkdtemp(prefix="hieravg-gpu-bench-"), "rendezvous")
        if not smoke:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(models: dict, reps: int, smoke: bool, bucket_mb: float) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    from hieravg_optim.averaging import BucketPool, average_tensors_

    _init(smoke)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    cap = int(bucket_mb * 1e6)
    rows = []
    for name, spec in models.items():
        shapes = transformer_shapes(**spec)
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        for dtype_name in DTYPES:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]

            def make():
                return [torch.full(s, float(rank), dtype=dtype, device=device) for s in shapes]

            pools = {k: BucketPool() for k in ("ours", "previous", "all_in_place")}
            params = {k: make() for k in ("ours", "previous", "torch", "all_in_place")}
            torch_params = [torch.nn.Parameter(p) for p in params["torch"]]
            contenders = {
                "ours": lambda: average_tensors_(params["ours"], group, world, bucket_cap_bytes=cap, pool=pools["ours"]),
                "previous": lambda: average_tensors_(
                    params["previous"], group, world, bucket_cap_bytes=cap, pool=pools["previous"],
                    path="pipelined", comm_dtype="float32",
                ),
                "torch": lambda: average_parameters(iter(torch_params), group),
                "all_in_place": lambda: average_tensors_(
                    params["all_in_place"], group, world, bucket_cap_bytes=cap, pool=pools["all_in_place"],
                    path="coalesced", direct_min_bytes=0,
                ),
            }
            if world > 1:
                flat = torch.full((numel,), float(rank), dtype=dtype, device=device)
                contenders["floor"] = lambda: dist.all_reduce(flat, group=group)
            times: dict[str, list[float]] = {k: [] for k in contenders}
            peaks = {k: 0 for k in contenders}
            order = list(contenders)
            with torch.no_grad():
                for rep in range(reps + 1):  # rep 0: warm-up, memory only
                    rotated = order[rep % len(order):] + order[: rep % len(order)]
                    for key in rotated:
                        _sync(device)
                        dist.barrier(group)
                        if device.type == "cuda":
                            before = torch.cuda.memory_allocated(device)
                            torch.cuda.reset_peak_memory_stats(device)
                        t0 = time.perf_counter()
                        contenders[key]()
                        _sync(device)
                        elapsed = time.perf_counter() - t0
                        if device.type == "cuda":
                            peaks[key] = max(peaks[key], torch.cuda.max_memory_allocated(device) - before)
                        slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
                        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                        if rep > 0:
                            times[key].append(float(slowest))
                    if rep == 0:  # every contender holds the exact mean of the ranks
                        mean = (world - 1) / 2
                        for key, ps in (("ours", params["ours"]), ("previous", params["previous"]),
                                        ("torch", [p.data for p in torch_params]),
                                        ("all_in_place", params["all_in_place"])):  # fmt: skip
                            for p in (ps[0], ps[len(ps) // 2], ps[-1]):
                                assert bool((p == mean).all()), (key, p.flatten()[:3])
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {
                "model": name, "dtype": dtype_name, "world_size": world, "tensors": len(shapes), "numel": numel,
                "median_s": med, "peak_extra_bytes": peaks,
                "ratio_ours_torch": med["ours"] / med["torch"],
            }
            if "floor" in med:
                row["ratio_ours_floor"] = med["ours"] / med["floor"]
            rows.append(row)
            del params, torch_params, contenders, pools
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny models: a check, not a measurement")
    parser.add_argument("--reps", type=int, default=9, help="timed rounds per contender (median reported)")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--out-dir", default=None, help="where the JSON goes (default: bench/results)")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/gpu_averaging.py needs a CUDA GPU; run with --smoke for the CPU check.")
    reps = min(args.reps, 3) if args.smoke else args.reps
    rows = bench(SMOKE_MODELS if args.smoke else MODELS, reps, args.smoke, args.bucket_mb)
    if dist.get_rank() == 0:
        env = environment()
        if not args.smoke:
            env["gpu"] = torch.cuda.get_device_name()
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        world = rows[0]["world_size"]
        print(f"\nAveraging round, {'gloo on CPU (smoke)' if args.smoke else 'NCCL'}, {world} rank(s), "
              f"bucket {args.bucket_mb} MB; median of {reps} rounds, ms")
        hdr = (f"{'model':>5} {'dtype':>5} | {'ours':>8} {'previous':>8} {'torch':>8} {'in place':>8}"
               + (f" {'floor':>8} {'ours/floor':>10}" if world > 1 else "")
               + f" {'ours/torch':>10} | peak extra MB: {'ours':>7} {'previous':>8} {'torch':>7} {'in place':>8}")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            m, p = {k: v * 1e3 for k, v in r["median_s"].items()}, {k: v / 1e6 for k, v in r["peak_extra_bytes"].items()}
            print(
                f"{r['model']:>5} {r['dtype']:>5} | {m['ours']:8.2f} {m['previous']:8.2f} {m['torch']:8.2f} "
                f"{m['all_in_place']:8.2f}"
                + (f" {m['floor']:8.2f} {r['ratio_ours_floor']:10.2f}" if world > 1 else "")
                + f" {r['ratio_ours_torch']:10.2f} | {'':>14} {p['ours']:7.0f} {p['previous']:8.0f} "
                f"{p['torch']:7.0f} {p['all_in_place']:8.0f}"
            )
        print("target: ours/torch <= 0.6 in every row")
        path = write_json("gpu_averaging_smoke.json" if args.smoke else "gpu_averaging.json",
                          {"environment": env, "bucket_mb": args.bucket_mb, "reps": reps, "results": rows},
                          out_dir=args.out_dir)
        print(f"written: {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The codecs' encode and decode at two revisions of ``hieravg_optim/compression/codecs.py``, in one process.

Run (about five minutes on 2 CPU cores)::

    OMP_NUM_THREADS=1 python bench/codecs_ab.py --before 752e7f9 --sizes 10,100 --reps 5

``--before REV``: the ``codecs.py`` of that git revision (``git show REV:hieravg_optim/compression/codecs.py``),
loaded as a module of its own, against the one that ``hieravg_optim`` imports. For each size (one flat
float32 tensor of N(0, 1) values) and each codec (int8 blocks of 256; top-k 1% with int8 values, chunks of
4096), the same process times, interleaved (the order of the two revisions alternates every repetition):
``encode`` of the tensor, and ``decode``: ``decode_add_`` of 4 payloads into one fp32 accumulator (what a rank of
a group of 4 does after the exchange). Median over ``--reps`` repetitions after one warm-up; the payloads of
the two revisions must be equal byte for byte. Timing the two in the same process, one after the other, makes
their ratio fair on a loaded machine; the absolute seconds move with the load (recorded).

Results: printed, and written to ``bench/results/NAME.json`` (default ``codecs_ab``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, median, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = "hieravg_optim/compression/codecs.py"


def _load(revision: str):
    """The module ``codecs.py`` of git ``revision``, loaded under a name of its own."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{PATH}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    folder = tempfile.mkdtemp(prefix="codecs_ab_")
    path = os.path.join(folder, "codecs_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("codecs_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["codecs_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="752e7f9", help="git revision of the codecs to compare against")
    parser.add_argument("--sizes", default="10,100", help="comma-separated millions of float32 elements")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    parser.add_argument("--name", default="codecs_ab", help="output file bench/results/NAME.json")
    args = parser.parse_args()

    import torch

    from hieravg_optim.compression import codecs as after

    before = _load(args.before)
    specs = {
        "int8": lambda m: m.Int8Block(block=256),
        "topk 1% int8": lambda m: m.TopK(density=0.01, chunk=4096, values="int8"),
    }
    env = environment()
    env["before"] = args.before
    rows = []
    for millions in [int(s) for s in args.sizes.split(",")]:
        numel = millions * 1_000_000
        flat = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        for name, make in specs.items():
            codecs = {"before": make(before), "after": make(after)}
            payloads = {k: c.encode(flat) for k, c in codecs.items()}
            assert torch.equal(payloads["before"], payloads["after"]), f"{name}: the payloads differ"
            acc = torch.zeros(codecs["after"].padded_numel(numel))
            times: dict[str, dict[str, list[float]]] = {k: {"encode": [], "decode": []} for k in codecs}
            for rep in range(args.reps + 1):
                order = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
                for key in order:
                    codec, payload = codecs[key], payloads[key]
                    enc = _time(lambda: codec.encode(flat))
                    acc.zero_()
                    dec = _time(lambda: [codec.decode_add_(payload, acc) for _ in range(4)])
                    if rep:  # the first repetition warms up
                        times[key]["encode"].append(enc)
                        times[key]["decode"].append(dec)
            medians = {k: {part: median(v) for part, v in t.items()} for k, t in times.items()}
            row = {
                "codec": name,
                "numel": numel,
                "times_s": times,
                "median_s": medians,
                "speedup": {part: medians["before"][part] / medians["after"][part] for part in ("encode", "decode")},
                "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            }
            rows.append(row)
            print(
                f"{name:14s} {millions:4d}M  encode {medians['before']['encode']:.3f} -> {medians['after']['encode']:.3f} s"
                f"  decode x4 {medians['before']['decode']:.3f} -> {medians['after']['decode']:.3f} s"
                f"  load {row['load_average_1_5_15']}",
                flush=True,
            )
    path = write_json(f"{args.name}.json", {"environment": env, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

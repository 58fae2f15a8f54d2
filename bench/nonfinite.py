"""The non-finite check alone: :func:`hieravg_optim.agreement.has_nonfinite` now against another revision's.

Run (about a minute on one CPU core)::

    OMP_NUM_THREADS=1 python bench/nonfinite.py --baseline-rev b4ad337

One process, one thread, the parameters of ``bench/averaging.py``'s GPT-like models (about 10M and
100M elements, ~150 tensors of mixed sizes) in float32 and bfloat16. The two implementations are
timed interleaved (alternating order), so that both see the same load; median and fastest of
``--reps`` calls each, after one warm-up. The check is a local pass over memory, so its cost as a
fraction of an averaging round is this time over the round's (``bench/averaging.py``; quote that
file's medians, measured on a quiet machine, next to these).

``--baseline-rev REV`` takes ``has_nonfinite`` from ``hieravg_optim/nonfinite.py`` (``agreement.py`` before it
moved) at git revision REV (the function alone, executed with ``torch`` in scope).

Results: printed, and written to ``bench/results/nonfinite.json``.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, median, transformer_shapes, write_json  # noqa: E402

MODELS = {
    "10M": dict(d_model=256, layers=10, vocab=8192),
    "100M": dict(d_model=768, layers=12, vocab=16384),
}


def _baseline(rev: str):
    """``has_nonfinite`` as written at ``rev``: in ``hieravg_optim/nonfinite.py``, or (older revisions)
    ``hieravg_optim/agreement.py``."""
    import torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    node = None
    for module in ("nonfinite", "agreement"):
        shown = subprocess.run(
            ["git", "show", f"{rev}:hieravg_optim/{module}.py"], cwd=root, capture_output=True, text=True
        )
        defs = [n for n in ast.parse(shown.stdout).body if isinstance(n, ast.FunctionDef) and n.name == "has_nonfinite"]
        if shown.returncode == 0 and defs:
            node = defs[0]
            break
    if node is None:
        raise SystemExit(f"no has_nonfinite in hieravg_optim/nonfinite.py or agreement.py at {rev}")
    namespace = {"torch": torch, "Sequence": list}
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"{rev}:{module}.py", "exec"), namespace)
    return namespace["has_nonfinite"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="10M,100M", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--reps", type=int, default=21, help="timed calls per implementation (median reported)")
    parser.add_argument("--baseline-rev", default=None, help="also time has_nonfinite at this git revision")
    parser.add_argument("--out", default="nonfinite.json", help="file name under bench/results/")
    args = parser.parse_args()

    import torch

    from hieravg_optim.agreement import has_nonfinite

    torch.set_num_threads(1)
    contenders = {"now": has_nonfinite}
    if args.baseline_rev:
        contenders["baseline"] = _baseline(args.baseline_rev)
    env = environment()
    rows = []
    for name in args.models.split(","):
        shapes = transformer_shapes(**MODELS[name])
        for dtype in (torch.float32, torch.bfloat16):
            tensors = [
                torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype) for i, s in enumerate(shapes)
            ]
            times = {k: [] for k in contenders}
            order = list(contenders)
            for rep in range(args.reps + 1):
                for key in order if rep % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    assert not contenders[key](tensors)
                    if rep:
                        times[key].append(time.perf_counter() - start)
            row = {
                "model": name,
                "dtype": str(dtype).removeprefix("torch."),
                "numel": sum(t.numel() for t in tensors),
                "tensors": len(tensors),
                "times_s": times,
                "median_s": {k: median(v) for k, v in times.items()},
                "min_s": {k: min(v) for k, v in times.items()},
            }
            rows.append(row)
            print(
                f"{name} {row['dtype']}: "
                + ", ".join(f"{k} median {row['median_s'][k] * 1e3:.2f} ms (fastest {row['min_s'][k] * 1e3:.2f})"
                            for k in contenders)
            )  # fmt: skip
    payload = {"environment": env, "baseline_rev": args.baseline_rev, "reps": args.reps, "rows": rows}
    path = write_json(args.out, payload)
    print(f"written: {path}")


if __name__ == "__main__":
    main()

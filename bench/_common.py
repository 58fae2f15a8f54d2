"""Shared pieces of the benchmarks: spawning gloo ranks, peak-memory probes, statistics, output.

Not part of the library and not run by the test suite.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import psutil

__all__ = [
    "FEATURE_SETTINGS",
    "code_revision",
    "PeakMemory",
    "environment",
    "median",
    "on_level",
    "spawn",
    "transformer_shapes",
    "write_json",
]

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Every allocation of 128 KiB or more is its own mmap, returned to the OS on free: the glibc
# default raises this threshold dynamically (up to 32 MiB) and then serves buffers from heap
# pages that are already resident, which would hide them from an RSS delta. Fixed, each
# contender's temporary buffers show up in its own peak RSS.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_TRIM_THRESHOLD_": str(128 * 1024)}


FEATURE_SETTINGS = {
    "delay_steps": "delayed rounds (issue 24)",
    "fragments": "streamed fragments (issue 24)",
    "delay_mixing": "delayed rounds (issue 24)",
    "delay_correction": "delayed rounds (issue 24)",
    "compress": "compressed rounds (issue 25)",
    "ef_decay": "compressed rounds (issue 25)",
}
"""The settings of the per-level features the benchmarks sweep, and the feature each belongs to."""


def on_level(settings: dict[str, Any], period: int) -> dict[str, Any]:
    """``settings`` (AveragingConfig keywords) put on one level: each value becomes ``{period: value}``.

    Raises SystemExit, naming the setting and the feature, when the installed ``hieravg_optim`` has no such
    field (a build without that feature), before any process group is made.
    """
    import dataclasses

    from hieravg_optim import AveragingConfig

    known = {f.name for f in dataclasses.fields(AveragingConfig)}
    missing = sorted(set(settings) - known)
    if missing:
        import hieravg_optim

        features = sorted({FEATURE_SETTINGS.get(name, "an unknown setting") for name in missing})
        raise SystemExit(
            f"{missing}: not settings of the hieravg_optim at {os.path.dirname(hieravg_optim.__file__)} "
            f"(needs {', '.join(features)}); run with a build that has them (PYTHONPATH)."
        )
    return {name: {period: value} for name, value in settings.items()}


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


class PeakMemory:
    """Peak RSS of this process above its RSS at :meth:`start`, in bytes.

    Uses the kernel's high-water mark (``VmHWM`` in ``/proc/self/status``), reset by
    writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0): exact, no sampling. Where
    that is not available, a background thread samples ``psutil`` RSS every millisecond.
    """

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._exact = self._can_reset()
        self._base = 0
        self._peak = 0
        self._stop = False
        self._thread = None

    @staticmethod
    def _can_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _hwm() is not None
        except OSError:
            return False

    @property
    def method(self) -> str:
        return "VmHWM reset via /proc/self/clear_refs" if self._exact else "psutil RSS sampled every 1 ms"

    def start(self) -> None:
        self._base = self._proc.memory_info().rss
        if self._exact:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return
        import threading

        self._peak = self._base
        self._stop = False

        def sample() -> None:
            while not self._stop:
                self._peak = max(self._peak, self._proc.memory_info().rss)
                time.sleep(0.001)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Peak extra bytes since :meth:`start` (never negative)."""
        if self._exact:
            peak = _hwm()
        else:
            self._stop = True
            self._thread.join()
            peak = max(self._peak, self._proc.memory_info().rss)
        return max(0, peak - self._base)


def _hwm() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def transformer_shapes(d_model: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-like stack: embedding, per layer LN/attention/MLP, final LN.

    Many tensors of mixed sizes: per layer 12 tensors, from ``d_model`` elements to
    ``4 * d_model**2``.
    """
    d = d_model
    shapes: list[tuple[int, ...]] = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def code_revision() -> dict[str, Any]:
    """Which ``hieravg_optim`` ran: its folder, and the git commit there (with ``+changes`` when the package's
    files differ from it), or the ``REVISION`` file next to the package (a ``git archive`` of a commit)."""
    import subprocess

    import hieravg_optim

    package = os.path.dirname(os.path.abspath(hieravg_optim.__file__))
    root = os.path.dirname(package)
    revision = None
    marker = os.path.join(root, "REVISION")
    if os.path.exists(marker):
        with open(marker) as f:
            revision = f.read().strip()
    else:
        try:
            head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  timeout=30, check=True).stdout.strip()  # fmt: skip
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "hieravg_optim"],
                                   capture_output=True, text=True, timeout=30, check=True).stdout.strip()  # fmt: skip
            revision = head + ("+changes" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return {"path": package, "revision": revision}


def environment() -> dict[str, Any]:
    """Where and when a benchmark ran (the load matters on a shared machine), and which ``hieravg_optim``."""
    import torch

    return {
        "hieravg_optim": code_revision(),
        "utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host_cpus": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def write_json(name: str, payload: dict, out_dir: str | None = None) -> str:
    folder = out_dir or RESULTS_DIR
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
    return path


def _child(fn, rank, world_size, init_file, args, results, env) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=900)
        )
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 3600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return their results.

    The rendezvous is a ``file://`` store in a temporary folder (no TCP port). glibc's
    mmap threshold is fixed in the children (see ``MALLOC_ENV``) so RSS deltas are attributable.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **MALLOC_ENV}
    # The malloc settings must be in the environment before the child's interpreter starts.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory(prefix="hieravg-bench-") as tmp:
            init_file = os.path.join(tmp, "rendezvous")
            procs = [
                ctx.Process(target=_child, args=(fn, r, world_size, init_file, args, results, env), daemon=True)
                for r in range(world_size)
            ]
            for p in procs:
                p.start()
            out: dict[int, Any] = {}
            deadline = time.monotonic() + timeout
            try:
                while len(out) < world_size:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish")
                    try:
                        rank, status, payload = results.get(timeout=min(remaining, 5.0))
                    except Exception:  # queue.Empty
                        dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                        if dead and results.empty():
                            time.sleep(1.0)
                            if results.empty():
                                raise RuntimeError(f"ranks {dead} exited without reporting") from None
                        continue
                    if status != "ok":
                        raise RuntimeError(f"rank {rank} failed:\n{payload}")
                    out[rank] = payload
            finally:
                for p in procs:
                    p.join(timeout=5.0)
                for p in procs:
                    if p.is_alive():
                        p.kill()
                        p.join()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [out[r] for r in range(world_size)]

"""A small spawn harness for multi-process tests on CPU with gloo.

Modelled on DeepSpeed's ``tests/unit/common.py`` and torchft's tests:

* spawn start method, a ``file://`` rendezvous in a fresh temporary folder (never a port);
* gloo with a short collective timeout;
* a hard wall-clock deadline: on a hang, every rank is killed and the ranks that
  had not finished are named;
* a child's traceback is re-raised in the parent with its rank;
* when one rank fails, the others get a short grace period, then are killed, so a
  rank blocked in a collective never keeps the test waiting.

Run several scenarios per spawn: starting processes costs seconds on 2 cores.

The ranks start from a ``forkserver`` that imported torch, ``hieravg_optim`` and pytest once per
session (:data:`PRELOAD`): each rank is a fresh process forked from that server, with the test
process's current environment, instead of a new interpreter importing them again (about 2.5 s of
CPU per rank, most of a 4-rank spawn on 2 cores). No rank ever runs code in the server, so every
rank starts from the same just-imported state. ``HIERAVG_TEST_START_METHOD=spawn`` starts each rank
as a new interpreter instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = [
    "DistributedTestError",
    "default_timeout",
    "mp_context",
    "run_distributed",
    "run_scenarios",
    "start_ranks",
    "wait_for_survivors",
]


def default_timeout(seconds: float) -> float:
    """``seconds`` scaled by ``HIERAVG_TEST_TIMEOUT_SCALE`` (default 1), for slow or loaded machines."""
    return seconds * float(os.environ.get("HIERAVG_TEST_TIMEOUT_SCALE", "1"))


START_METHOD = os.environ.get("HIERAVG_TEST_START_METHOD", "forkserver")
"""How the ranks start: ``forkserver`` (the default) or ``spawn``."""

PRELOAD = ["torch", "torch.distributed", "hieravg_optim", "hieravg_optim.fsdp", "pytest", "tests.harness"]
"""What the forkserver imports once, before it forks any rank."""


def mp_context():
    """The multiprocessing context the ranks start from (:data:`START_METHOD`, :data:`PRELOAD`)."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


class DistributedTestError(AssertionError):
    """A rank raised, or the ranks did not finish in time."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    args: tuple,
    results: mp.Queue,
    pg_timeout_s: float,
    env: dict[str, str],
    base_env: dict[str, str] | None = None,
) -> None:
    if base_env is not None:  # the test process's environment when it started the ranks (not the forkserver's)
        os.environ.clear()
        os.environ.update(base_env)
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE", str(world_size)),
            "OMP_NUM_THREADS": "1",
        }
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
        _exit_now(results, 1)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    _exit_now(results, 0)


def wait_for_survivors(procs: list, survivors: list[int], deadline: float) -> list[int]:
    """Wait until every process in ``survivors`` has exited or ``deadline`` (``time.monotonic()``) passes.

    Then kill every process still alive (the victim of a fault test included) and return the
    survivors that were still running at the deadline: the ranks that hang.
    """
    try:
        while time.monotonic() < deadline and any(procs[r].is_alive() for r in survivors):
            time.sleep(0.1)
        hung = [r for r in survivors if procs[r].is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5.0)
    return hung


def _exit_now(results: mp.Queue, code: int) -> None:
    """Flush the result to the parent, then exit without the interpreter's slow teardown (8-10 s at 8 ranks)."""
    results.close()
    results.join_thread()
    os._exit(code)


def start_ranks(
    ctx: Any,
    fn: Callable[..., Any],
    world_size: int,
    init_file: str,
    args: tuple,
    results: mp.Queue,
    pg_timeout: float,
    env: dict[str, str] | None = None,
) -> list[mp.Process]:
    """Start ``world_size`` daemon processes ``rank0``, ``rank1``, ... from ``ctx`` (:func:`mp_context`), each running
    ``fn(rank, world_size, *args)`` in a gloo group that rendezvouses at ``init_file`` and reporting to ``results``,
    with the environment of this process now plus ``env``. The caller waits for them."""
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, init_file, args, results, pg_timeout, dict(env or {}), dict(os.environ)),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes with a gloo group.

    ``fn`` must be a module-level function (it is pickled by name). Returns the
    per-rank return values, in rank order.

    Raises:
        DistributedTestError: with the first failing rank's traceback, or naming the
            ranks still running after ``timeout`` seconds (a hang).
    """
    timeout = default_timeout(timeout)
    ctx = mp_context()
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hieravg-test-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = start_ranks(ctx, fn, world_size, init_file, args, results, pg_timeout, env)
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outputs) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if errors:
                    remaining = min(remaining, 5.0)
                if remaining <= 0:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outputs and r not in errors]
                    # A process that died without reporting (segfault, os._exit) counts as failed.
                    time.sleep(0.2)
                    if dead and results.empty():
                        for r in dead:
                            if not procs[r].is_alive():
                                errors[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                    continue
                if status == "ok":
                    outputs[rank] = payload
                else:
                    errors[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=2.0 if not errors else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
    if errors:
        first = min(errors)
        others = sorted(set(errors) - {first})
        raise DistributedTestError(
            f"rank {first} of {world_size} failed running {fn.__name__}"
            + (f" (ranks {others} failed too)" if others else "")
            + f":\n{errors[first]}"
        )
    missing = [r for r in range(world_size) if r not in outputs]
    if missing:
        raise DistributedTestError(
            f"{fn.__name__}: ranks {missing} of {world_size} did not finish within {timeout:.0f} s (hang?); "
            f"finished: {sorted(outputs)}"
        )
    return [outputs[r] for r in range(world_size)]


def run_scenarios(scenarios: dict[str, Callable[[int], Any]], rank: int) -> dict[str, Any]:
    """Inside a rank: run each ``scenarios[name](rank)`` in order, with a barrier after each.

    ``HIERAVG_CORE_SCENARIOS`` (comma-separated names) runs only those, to iterate on one.
    A failure is re-raised naming the scenario and the rank.
    """
    import torch.distributed as dist

    only = os.environ.get("HIERAVG_CORE_SCENARIOS")
    out = {}
    for name, fn in scenarios.items():
        if only and name not in only.split(","):
            continue
        try:
            out[name] = fn(rank)
        except BaseException as e:  # name the scenario in the traceback the harness re-raises
            raise AssertionError(f"scenario {name!r} failed on rank {rank}: {e!r}") from e
        dist.barrier()
    return out

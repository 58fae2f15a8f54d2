"""No abort at exit after a gloo collective: tensors handed to the backend stay referenced until it lets go.

ProcessGroupGloo (torch 2.13) runs each collective on a worker thread (named
``pt_gloo_runloop``), which drops its reference to the work, and so to the work's tensors, a
moment *after* ``wait()`` has returned on the calling thread. If the calling thread has already
dropped its own reference to a tensor made in Python, the worker's drop is the last one and must
take the GIL to free the tensor's Python object. Once the interpreter is finalizing, it cannot:
the worker thread is torn down inside a C++ destructor and the process aborts with ``terminate
called without an active exception`` (SIGABRT), after the run has finished (``docs/faults.md``,
"An abort at exit with gloo"). torch keeps the worker threads alive after ``destroy_process_group()`` while any object (a module, an optimizer, a
device mesh) still holds the process group.

Two parts:

* Every CPU tensor this package hands to a collective goes through :func:`hand_over` first: it
  is recorded with its reference count and kept until that count is back, which means the
  backend has dropped it. The worker's drop is then never the last one, whenever it happens.
  Released tensors are forgotten at each later call.
* Collectives this package does not issue itself (DeepSpeed's all-gathers after an averaging
  step, ``all_gather_object`` on the error paths) can leave a worker thread about to drop a
  tensor. At interpreter exit, before finalization, an ``atexit`` hook sleeps 1 ms at a time,
  with the GIL released, until no gloo worker thread has been runnable at two checks in a row
  (at most ``EXIT_WAIT_S``): a worker that is about to drop a tensor is runnable, or waits for
  the GIL, which the sleep lets it take. A process that never ran a gloo collective returns at
  once. Without ``/proc`` (not Linux), it waits for the held tensors instead.
"""

from __future__ import annotations

import atexit
import os
import time

import torch

EXIT_WAIT_S = 5.0
"""Longest wait at interpreter exit for gloo's worker threads, in seconds."""

_MAX_HELD = 4096
"""Bound on the tensors held; the oldest are dropped first (a tensor whose count never comes back)."""

_QUIET_CHECKS = 2
"""Checks in a row, 1 ms apart, with no gloo worker thread runnable, that end the wait at exit."""

_held: list[tuple[torch.Tensor, int]] = []


def hand_over(*tensors: torch.Tensor) -> None:
    """Record ``tensors`` right before they are passed to a collective; see the module docstring."""
    _forget_released()
    # References to the C++ tensor (``Tensor._use_count``, which torch.utils.swap_tensors uses too):
    # a Python object counts once, however many names it has. CPU tensors only: they go to gloo.
    # NCCL's watchdog thread releases CUDA tensors on its own schedule, not measured here (no GPU in
    # CI), and holding them could delay every exit.
    _held.extend((t, t._use_count()) for t in tensors if t.device.type == "cpu")
    del _held[: max(0, len(_held) - _MAX_HELD)]


def held() -> int:
    """How many tensors the backend may still hold (forgets the released ones first)."""
    _forget_released()
    return len(_held)


def _forget_released() -> None:
    _held[:] = [(t, count) for t, count in _held if t._use_count() > count]


def _gloo_workers() -> list[str] | None:
    """The scheduler state (``R`` runnable, ``S`` sleeping, ...) of each gloo worker thread; None without /proc."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        except OSError:  # the thread ended meanwhile
            continue
    return states


@atexit.register
def _wait_for_gloo_workers() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    states = _gloo_workers()
    if states == []:
        return
    quiet = 0
    while quiet < _QUIET_CHECKS and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL: a worker waiting for it runs
        states = _gloo_workers()
        busy = held() > 0 if states is None else "R" in states
        quiet = 0 if busy else quiet + 1

"""Tensors handed to a collective stay referenced here until the backend has let go of them.

ProcessGroupGloo (torch 2.13) runs each collective on a worker thread, which drops its
reference to the work, and so to the work's tensors, a moment *after* ``wait()`` has returned
on the calling thread. If the calling thread has already dropped its own reference to a tensor
made in Python, the worker's drop is the last one and must take the GIL to free the tensor's
Python object. Once the interpreter is finalizing, it cannot: the worker thread is torn down
inside a C++ destructor and the process aborts with ``terminate called without an active
exception`` (SIGABRT), after the run has finished. On a loaded 2-core machine a 4-rank script
whose last collective was this package's (``hieravg_optim.fsdp.load_checkpoint``) aborted so
in about 1 run of 10. torch keeps the worker threads alive after ``destroy_process_group()``
while any object (a module, an optimizer, a device mesh) still holds the process group.

So every CPU tensor this package hands to a collective goes through :func:`hand_over` first: it is
recorded with its reference count, and kept until that count is back, which means the backend
has dropped it. Released tensors are forgotten at each later call; at interpreter exit, before
finalization, an ``atexit`` hook waits for the rest (at most ``EXIT_WAIT_S``, sleeping with the
GIL released so that the worker threads can run).
"""

from __future__ import annotations

import atexit
import time

import torch

EXIT_WAIT_S = 5.0
"""Longest wait at interpreter exit for the backend to drop the tensors still held, in seconds."""

_MAX_HELD = 4096
"""Bound on the tensors held; the oldest are dropped first (a tensor whose count never comes back)."""

_held: list[tuple[torch.Tensor, int]] = []


def hand_over(*tensors: torch.Tensor) -> None:
    """Record ``tensors`` right before they are passed to a collective; see the module docstring."""
    _forget_released()
    # References to the C++ tensor (``Tensor._use_count``, which torch.utils.swap_tensors uses too):
    # a Python object counts once, however many names it has.
    # CPU tensors only: they go to gloo. NCCL's watchdog thread releases CUDA tensors on its own
    # schedule, not measured here (no GPU in CI), and holding them could delay every exit.
    _held.extend((t, t._use_count()) for t in tensors if t.device.type == "cpu")
    del _held[: max(0, len(_held) - _MAX_HELD)]


def held() -> int:
    """How many tensors the backend may still hold (forgets the released ones first)."""
    _forget_released()
    return len(_held)


def _forget_released() -> None:
    _held[:] = [(t, count) for t, count in _held if t._use_count() > count]


@atexit.register
def _wait_for_backend() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    while held() and time.monotonic() < deadline:
        time.sleep(0.001)
    _held.clear()

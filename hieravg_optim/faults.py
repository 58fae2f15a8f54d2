"""A failed collective, named: which round, which group, and the likely cause.

When a peer dies (killed, out of memory, a lost node), the other ranks of the group it was
in get the backend's error at their next collective with it: with gloo ``Connection closed
by peer`` or ``Connection reset by peer`` within about a second; when a peer hangs
(stopped, deadlocked, swapped out), ``Timed out waiting ...`` only at the group's timeout.
When ranks fall out of step (one rank skipped or added an optimizer step), their collectives
pair with different ones and the backend reports a size mismatch, or waits until the timeout.
None of these messages say which averaging round, which group or which step count was
involved. :func:`named_collective` wraps every collective this package issues during
training (the agreement check and the averaging of each round, the count check after a
load, every other agreement across ranks, the broadcast from the first replica) and re-raises
the backend's error as a :class:`CollectiveError` (a ``RuntimeError``) that says so, chained to the
original (``raise ... from``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from ._compat import DistError

__all__ = ["CollectiveError", "is_backend_failure", "named_collective"]

_MARKERS = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "timed out",
    "third_party/gloo",
    "nccl",
    "socket timeout",
)
"""Lower-case fragments of the errors gloo and NCCL raise (as plain ``RuntimeError`` on gloo, torch 2.13)."""

_OWN = ("failed while checking", "disagree on")
"""Fragments of the agreement check's own errors, which may quote another rank's error: never re-wrapped."""


class CollectiveError(RuntimeError):
    """A collective of this package failed: a dead or hung peer, or ranks out of step.

    Raised by :func:`named_collective`, chained to the backend's error (``__cause__``). A
    ``RuntimeError``, as torch's own ``DistBackendError`` is.
    """


def is_backend_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective as the communication backend reports it.

    ``True`` for :class:`torch.distributed.DistError` and its subclasses (``DistBackendError``,
    ``DistNetworkError``, ...) and for a ``RuntimeError`` whose message is gloo's or NCCL's
    (a closed or reset connection, a timeout, a mismatch reported by the transport).
    """
    if DistError is not None and isinstance(exc, DistError):
        return True
    if type(exc) is not RuntimeError:  # CollectiveError included: wrapped once only
        return False
    message = str(exc).lower()
    return any(marker in message for marker in _MARKERS) and not any(own in message for own in _OWN)


@contextlib.contextmanager
def named_collective(what: str, group_ranks: Sequence[int], *, timeout_s: float | None = None) -> Iterator[None]:
    """Re-raise a failed collective inside the ``with`` block as a ``RuntimeError`` naming it.

    Errors that are not the backend's (see :func:`is_backend_failure`), such as the agreement
    check's own ``RuntimeError`` or a local ``ValueError``, pass through unchanged.

    Args:
        what: The collective, with the level and the step count, e.g. ``"the averaging round at
            step 12 (period 4, group size 8)"``.
        group_ranks: Global ranks of the group the collective runs over.
        timeout_s: The group's timeout in seconds, quoted in the message; ``None`` if unknown.

    Raises:
        CollectiveError: (a ``RuntimeError``) naming ``what``, this rank, ``group_ranks`` and the
            likely causes, chained (``from``) to the backend's error.
    """
    try:
        yield
    except RuntimeError as exc:
        if not is_backend_failure(exc):
            raise
        rank = dist.get_rank() if dist.is_initialized() else "?"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        waited = f"within the group's timeout of {timeout_s:g} s" if timeout_s is not None else "within the timeout"
        raise CollectiveError(
            f"{what} failed on rank {rank}, in the group of ranks {list(group_ranks)}: {first_line} "
            f"Likely cause: a dead or hung peer (a rank of this group exited, was killed, or did not answer {waited}), "
            "or ranks out of step (a rank skipped or added an optimizer step, so its collectives pair with other ones). "
            "The first error in the other ranks' logs names the cause; this rank stops here instead of waiting. "
            "Restart the job from the latest checkpoint (e.g. torchrun --max-restarts)."
        ) from exc

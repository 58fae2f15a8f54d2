"""A script whose last collective is this package's (or ran while it is imported) exits cleanly, even when
gloo's worker threads release that collective's tensors only during interpreter finalization.

torch 2.13's ProcessGroupGloo worker thread drops its reference to a collective's tensors just
after ``wait()`` returns. When that drop is the last reference to a tensor made in Python and
happens during finalization, it cannot take the GIL and the process aborts (SIGABRT) after the
run finished (see hieravg_optim/_handover.py). tests/exit_after_collective.py starves the worker
threads so that they run only when the main thread blocks; the control case shows that torch
alone then usually aborts (a run where it does not is skipped, not failed: the race is the
scheduler's to decide). Without the protection the other cases abort often but not every time (2 to
3 of 4-6 cases per run, measured): whether the main thread blocks before finalization, letting the
worker drop the tensors early, varies. Each case is one torchrun launch (about 5 s; DeepSpeed's
about 15 s).
"""

from __future__ import annotations

import re
import signal

import pytest

from tests.launch import ROOT, check_ok, torchrun

SCRIPT = ROOT / "tests" / "exit_after_collective.py"

pytestmark = pytest.mark.timeout(300)


def test_control_torch_alone_aborts_at_exit():
    """Without hieravg_optim, the starved script often aborts: evidence that the tests below can fail.

    Whether torch's exit race happens depends on the scheduler (a loaded machine can let the worker
    thread drop the tensors before finalization), so a run without the abort is a skip with that
    reason, never a failure; the protection's own tests below are deterministic either way. The
    script must still have run to its end, so a broken launch or starvation setup fails here.
    """
    result = torchrun(2, SCRIPT, "plain_torch_all_reduce", timeout=120)
    done = re.findall(r"rank (\d): plain_torch_all_reduce done", result.stdout)
    assert sorted(done) == ["0", "1"], (
        f"the control script did not run to its end (exit code {result.returncode}):\n--- stdout ---\n"
        f"{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    )
    if result.returncode == 0:
        pytest.skip("torch's exit race did not occur in this run (both ranks exited cleanly); the control shows "
                    "nothing this time")
    assert "terminate called without an active exception" in result.stderr, result.stderr[-3000:]
    assert f"exitcode  : -{int(signal.SIGABRT)}" in result.stderr, result.stderr[-3000:]


CASES = {  # case: ranks
    "fsdp_load_checkpoint": 2,
    "bucketed_step": 2,
    "in_place_step": 2,
    "non_contiguous": 2,
    "agreement_error": 2,  # all_gather_object on the error path
    "deepspeed_step": 4,  # DeepSpeed's own all-gather after the averaging
    "plain_torch_all_reduce_after_import": 2,  # the control's collective, hieravg_optim imported
}


@pytest.mark.parametrize("case", list(CASES))
def test_exit_after_our_collective_is_clean(case, tmp_path):
    result = torchrun(CASES[case], SCRIPT, case, str(tmp_path / "checkpoint"), timeout=180)
    check_ok(result)
    ranks = [str(r) for r in range(CASES[case])]
    assert sorted(re.findall(rf"rank (\d): {case} done", result.stdout)) == ranks, result.stdout
    assert "terminate called" not in result.stderr, result.stderr[-3000:]


def test_a_failed_collective_does_not_delay_the_exit():
    """The failed work keeps its tensors referenced: the hook waits for idle gloo threads, not for them."""
    result = torchrun(2, SCRIPT, "peer_exits", timeout=120)
    check_ok(result)
    assert "rank 0: the step failed as expected" in result.stdout, result.stdout
    seconds = float(re.search(r"rank 0: exit hook took ([0-9.]+) s", result.stdout).group(1))
    assert seconds < 1.0, result.stdout  # the cap is 5 s
    assert "rank 0: peer_exits done" in result.stdout, result.stdout


def test_a_handed_over_tensor_is_held_while_another_cpp_reference_exists():
    """The bookkeeping alone: an autograd node holds a C++ reference, as a gloo work does."""
    import torch

    from hieravg_optim import _handover

    a = torch.zeros(2, requires_grad=True)
    _handover.hand_over(a)
    b = a * 2  # AccumulateGrad holds ``a`` from C++
    _handover.held()
    assert any(t is a for t, _ in _handover._held)
    del b
    _handover.held()
    assert not any(t is a for t, _ in _handover._held)

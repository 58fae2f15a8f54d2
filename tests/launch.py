"""Launcher subprocesses for the example tests: ``torchrun --standalone`` with a timeout.

``torchrun --standalone`` rendezvouses on a c10d TCP store at a port the OS picks at
run time (``localhost:0``): no fixed port, no race between tests. On a timeout the
launcher and every rank (one new session) are killed and the test fails with the
captured output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import default_timeout

__all__ = ["RANK_LINE", "ROOT", "check_ok", "doc_block", "doc_files", "run_command", "torchrun"]

ROOT = Path(__file__).resolve().parents[1]

RANK_LINE = r"rank (\d+): (loss ([0-9.]+), averaging rounds per period (\{[^}]*\}))"
"""What the documented quickstarts print per rank. Not anchored to line starts: the ranks share one
pipe, and one rank's line can land right after another's without a newline between them."""


def torchrun(
    nproc: int,
    script: Path | str,
    *args: str,
    timeout: float = 240.0,
    progress_bar: bool = False,
    cwd: Path = ROOT,
    launcher_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node nproc *launcher_args script *args``; return its completed process.

    ``extra_env`` is added to the environment of the launcher and the ranks. On a timeout the
    launcher and every rank are killed (they share a new session) and the test fails with the
    captured output.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        *launcher_args, str(script), *args,
    ]  # fmt: skip
    return run_command(cmd, timeout=timeout, progress_bar=progress_bar, cwd=cwd, extra_env=extra_env)


def run_command(
    cmd: list[str],
    *,
    timeout: float = 240.0,
    progress_bar: bool = False,
    cwd: Path = ROOT,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a launcher that starts the ranks) with this repository on ``PYTHONPATH``; as :func:`torchrun`."""
    # No PYTHONUNBUFFERED: unbuffered, print() writes the text and the newline in two calls, and the
    # lines of 4 ranks sharing one pipe interleave.
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
    env.pop("PYTHONUNBUFFERED", None)
    if progress_bar:
        env.pop("TQDM_DISABLE", None)
    else:
        env["TQDM_DISABLE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    limit = default_timeout(timeout)
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd)} did not finish within {limit:.0f} s (hang?).\n--- stdout ---\n{out[-4000:]}\n"
            f"--- stderr ---\n{err[-8000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def check_ok(result: subprocess.CompletedProcess) -> None:
    """Fail the test, with the launcher's stdout and stderr, unless it exited with 0."""
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(result.args)} exited with {result.returncode}.\n--- stdout ---\n{result.stdout[-4000:]}\n"
            f"--- stderr ---\n{result.stderr[-8000:]}"
        )


def doc_files() -> list[Path]:
    """The Markdown files whose ``<!-- test:NAME -->`` blocks the tests run: README.md and docs/**/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def doc_block(name: str) -> str:
    """The fenced code block that follows ``<!-- test:NAME -->`` in README.md or a page under docs/.

    A block may appear in several files (the README's quickstarts are repeated on the docs
    pages); every copy must then be identical, so no copy can go stale untested.
    """
    pattern = re.compile(rf"^<!-- test:{re.escape(name)} -->\s*```[a-z]*\n(.*?)```", re.S | re.M)
    found: dict[str, str] = {}
    for path in doc_files():
        for match in pattern.finditer(path.read_text()):
            found.setdefault(str(path.relative_to(ROOT)), match.group(1))
    assert found, f"no fenced code block after <!-- test:{name} --> in README.md or docs/"
    copies = set(found.values())
    assert len(copies) == 1, f"the copies of <!-- test:{name} --> differ between {sorted(found)}: keep them identical"
    return copies.pop()

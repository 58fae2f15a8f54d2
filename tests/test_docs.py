"""The checked parts of the documentation: generated benchmark tables, the schedule table, tested blocks.

No processes are spawned here; the tested quickstart blocks themselves run in
``tests/test_examples.py`` and ``tests/test_fsdp_example.py``.
"""

from __future__ import annotations

import importlib.util
import re

from hieravg_optim import level_at
from tests.launch import ROOT, doc_block, doc_files

SEMANTICS = ROOT / "docs" / "semantics.md"

# Every <!-- test:NAME --> block in README.md and docs/, and the test that runs it.
TESTED_BLOCKS = {
    "quickstart": "tests/test_examples.py::test_documented_quickstart_runs",
    "quickstart_output": "tests/test_examples.py::test_documented_quickstart_runs",
    "quickstart_ddp": "tests/test_examples.py::test_documented_quickstart_runs",
    "quickstart_ddp_output": "tests/test_examples.py::test_documented_quickstart_runs",
    "quickstart_slow_link": "tests/test_examples.py::test_documented_quickstart_runs",
    "quickstart_slow_link_output": "tests/test_examples.py::test_documented_quickstart_runs",
    "fsdp_quickstart": "tests/test_fsdp_example.py::test_documented_fsdp_quickstart_runs_and_checkpoints",
    "fsdp_quickstart_output": "tests/test_fsdp_example.py::test_documented_fsdp_quickstart_runs_and_checkpoints",
}


def _report_module():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_tables_match_the_benchmark_results(tmp_path):
    """docs/snippets/bench_*.md and docs/img/ are what ``python bench/report.py --docs`` writes now."""
    report = _report_module()
    snippets, images = tmp_path / "snippets", tmp_path / "img"
    written = report.write_docs(snippets=str(snippets), images=str(images))
    plots = [p for p in report.PLOTS if (ROOT / "bench" / "results" / p).exists()]
    assert len(written) == len(report.SECTIONS) + len(plots), written  # every table, and the plots there are
    for fresh in [*snippets.iterdir(), *images.iterdir()]:
        committed = ROOT / "docs" / fresh.parent.name / fresh.name
        assert committed.exists() and committed.read_bytes() == fresh.read_bytes(), (
            f"{committed.relative_to(ROOT)} is out of date with bench/results/: run python bench/report.py --docs"
        )


def test_schedule_table_in_the_semantics_page_matches_level_at():
    """The table of docs/semantics.md, {2: 2, 4: 4} on 4 ranks, cell by cell against level_at."""
    levels = {2: 2, 4: 4}
    text = SEMANTICS.read_text()
    header = re.search(r"^\| count \*k\* *\|(.*)\|$", text, re.M)
    assert header, "docs/semantics.md has no schedule table"
    counts = [int(c) for c in header.group(1).split("|")]
    rows = re.findall(r"^\| `warmup_steps=(\d+)` *\|(.*)\|$", text, re.M)
    assert [int(w) for w, _ in rows] == [0, 1]
    group_sizes = list(levels.values())
    for warmup, cells in rows:
        shown = [c.strip() for c in cells.split("|")]
        expected = [
            "-" if (i := level_at(k, levels, int(warmup))) is None else str(group_sizes[i]) for k in counts
        ]  # fmt: skip
        assert shown == expected, f"warmup_steps={warmup}: the page shows {shown}, level_at gives {expected}"


def test_every_tested_block_is_known_and_its_copies_agree():
    """No orphan <!-- test:NAME --> marker; a block repeated on several pages is the same everywhere."""
    names = set()
    for path in doc_files():
        names |= set(re.findall(r"^<!-- test:(\w+) -->", path.read_text(), re.M))
    assert names == set(TESTED_BLOCKS), f"markers {sorted(names ^ set(TESTED_BLOCKS))} are not run by any test"
    for name in names:
        assert doc_block(name).strip(), name  # doc_block asserts that every copy is identical

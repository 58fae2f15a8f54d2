"""``python -m hieravg_optim.run SCRIPT ARGS...`` under ``torchrun -m``: an unchanged script gets the averaging.

The script below is a plain DeepSpeed script (``from deepspeed import initialize``, a config with
the section); launched through the runner on 4 ranks (2 replicas of 2) its engine averages, it
runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` sets them, and
rank 0 logs the levels once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.launch import ROOT, check_ok, torchrun

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.timeout(600)

SCRIPT = '''
import json, os, sys

import torch
import torch.distributed as dist
from deepspeed import initialize  # bound by name: after the runner's install(), so it is the library's

import hieravg_optim.deepspeed as hds

config = {
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 10**9,
    "zero_optimization": {"stage": 2},
    "hierarchical_averaging": {"period_group_size": {"2": 4}, "ranks_per_replica": 2, "synchronous_warmup": False},
}
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
engine, *_ = initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config)
rank = dist.get_rank()
for step in range(3):  # counts 0, 1, 2: a round at 2
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
weights = [None] * dist.get_world_size()
dist.all_gather_object(weights, engine.module.weight.tolist())
state = hds.get_averaging(engine)
# A file per rank, next to the script: the ranks' stdout lines can interleave in the launcher's pipe.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"result{rank}.json"), "w") as fd:
    json.dump({
        "rank": rank, "name": __name__, "argv": sys.argv, "path0": sys.path[0], "count": state.step,
        "dp_world_size": engine.dp_world_size, "equal": all(w == weights[0] for w in weights),
    }, fd)
'''


def test_runner_under_torchrun_gives_an_unchanged_script_the_averaging(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = torchrun(4, "hieravg_optim.run", str(script), "--flag", "value", launcher_args=("-m",), timeout=300)
    check_ok(result)
    found = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("result*.json"))]
    assert sorted(r["rank"] for r in found) == [0, 1, 2, 3], result.stdout
    for r in found:
        assert r["name"] == "__main__" and r["argv"] == [str(script), "--flag", "value"], r
        assert r["path0"] == str(tmp_path), r
        assert r["count"] == 3 and r["dp_world_size"] == 2 and r["equal"], r
    logs = re.findall(r"hierarchical averaging on DeepSpeed: 2 replicas of 2 ranks.*levels \[\(2, 4\)\]", result.stderr)
    assert len(logs) == 1, result.stderr[-4000:]


def test_runner_moves_the_deepspeed_launchers_local_rank_after_the_script(tmp_path):
    """``deepspeed --module hieravg_optim.run train.py A`` runs ``python -m hieravg_optim.run --local_rank=N train.py A``."""
    script = tmp_path / "show_argv.py"
    script.write_text("import json, sys\nprint('ARGV ' + json.dumps(sys.argv))\n")
    result = subprocess.run(
        [sys.executable, "-m", "hieravg_optim.run", "--local_rank=3", str(script), "a", "--b"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert f'ARGV {json.dumps([str(script), "--local_rank=3", "a", "--b"])}' in result.stdout, result.stdout


def test_runner_without_a_script_prints_the_usage():
    for args, code in (([], 2), (["/nonexistent/train.py"], 2), (["--help"], 0)):
        result = subprocess.run(
            [sys.executable, "-m", "hieravg_optim.run", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == code, (args, result.stderr)
        assert "usage: python -m hieravg_optim.run SCRIPT [ARGS...]" in result.stderr, result.stderr


def test_ranks_a_framework_restarts_install_the_hook_through_lightnings_entry_point(tmp_path):
    """The runner exports ``HIERAVG_DEEPSPEED_INSTALL=1``; Lightning's launcher starts the node's other ranks as
    ``python train.py`` with that environment, without the runner: a ``Trainer`` built there installs the hook
    (the entry point's ``callbacks_factory``), which it did not before (a hang under ``DeepSpeedStrategy``: the
    first rank's engine averaged, the others' did not). Without the variable, nothing is installed."""
    pytest.importorskip("lightning")
    from tests.test_lightning import _write_dist_info

    from hieravg_optim.run import INSTALL_ENV

    site = _write_dist_info(tmp_path / "site")
    child = (
        "import hieravg_optim.deepspeed as d\n"
        "from lightning.pytorch import Trainer\n"
        "before = d.installed()\n"
        "Trainer(accelerator='cpu', devices=1, logger=False, enable_checkpointing=False)\n"
        "print('INSTALLED', before, d.installed())\n"
    )
    for value, expected in (("1", "INSTALLED False True"), (None, "INSTALLED False False")):
        env = {k: v for k, v in os.environ.items() if k != INSTALL_ENV}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), env.get("PYTHONPATH")]))
        if value is not None:
            env[INSTALL_ENV] = value
        result = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=180)  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        assert expected in result.stdout, (value, result.stdout, result.stderr[-2000:])


def test_runner_exports_the_install_variable_to_the_script(tmp_path):
    script = tmp_path / "show_env.py"
    script.write_text("import os\nprint('ENV', os.environ.get('HIERAVG_DEEPSPEED_INSTALL'))\n")
    result = subprocess.run([sys.executable, "-m", "hieravg_optim.run", str(script)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ENV 1" in result.stdout, result.stdout

"""hieravg_optim.lightning under a real Lightning ``Trainer`` with ``DDPStrategy``: 4 gloo ranks as 2 replicas of 2.

One spawn of 4 ranks (Lightning is imported in those 4 processes only). In each rank:

* ``entry_point``: a ``hieravg_optim`` dist-info whose ``entry_points.txt`` is this repository's
  ``pyproject.toml`` table ``[project.entry-points."lightning.pytorch.callbacks_factory"]`` is put first on
  ``sys.path`` (what ``pip install`` writes), and ``HIERAVG_LIGHTNING_CONFIG`` names a JSON file: the
  ``Trainer`` finds the callback by itself. 4 epochs of 5 steps, a checkpoint after each epoch. Every step
  records the global step, the wrapper's count and the parameters: the parent checks that the two ranks
  of a replica are always equal, that all ranks are equal during the warm-up (DDP all-reduces over every
  rank), that the replicas are apart between rounds and bitwise equal after one, and the count is
  Lightning's global step.
* ``resume``: :func:`~hieravg_optim.lightning.callbacks_factory` called directly (inline JSON in the
  variable); a new ``Trainer`` resumes from the checkpoint after epoch 2 (count 10, no round: the replicas
  differ there, so every rank needs its own state) and ends where the uninterrupted run ended (allclose 1e-6:
  DDP's buckets are rebuilt after its first iteration), count included.
* ``bad``: an unknown key and levels that do not fit the world size (``ValueError`` naming them, on every
  rank), Lightning's own ``model_averaging_period`` set too, a checkpoint of another world size, two
  optimizers: a clear error on every rank, no hang.

And one real launch: ``python tests/lightning_train.py``, a script that never names this library, with
``HIERAVG_LIGHTNING_CONFIG`` set and the dist-info on ``PYTHONPATH``; Lightning's own launcher starts the 4
ranks: every rank's count is the global step and the rounds are the schedule's.

Runtime budget: about 50 s on 2 idle cores (one spawn, one launch).
"""

from __future__ import annotations

import importlib.util
import json
import re
import os
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from tests.harness import default_timeout, run_distributed, run_scenarios
from tests.launch import check_ok, run_command

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed"),
    pytest.mark.timeout(default_timeout(400)),
]

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
WARMUP = 2
PERIOD = 4
STEPS_PER_EPOCH = 5
EPOCHS = 4
SECTION = {"period_group_size": {str(PERIOD): WORLD}, "warmup_steps": WARMUP, "ranks_per_replica": 2}


def _entry_points_txt() -> str:
    """``entry_points.txt`` as pip writes it from this repository's ``pyproject.toml``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        groups = tomllib.load(f)["project"]["entry-points"]
    return "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
        for group, entries in groups.items()
    )


def _write_dist_info(site: Path) -> Path:
    """A ``hieravg_optim`` dist-info under ``site`` with this repository's entry points, as pip writes it."""
    dist_info = site / "hieravg_optim-0.1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: hieravg_optim\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text(_entry_points_txt())
    return site


def _module_class():
    import lightning.pytorch as pl
    from torch import nn

    class Regression(pl.LightningModule):
        """Each rank its own data (Lightning's DistributedSampler); SGD with momentum and a StepLR."""

        def __init__(self, optimizers: int = 1):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.n_optimizers = optimizers
            self.records: list[tuple[int, int, list[float]]] = []
            if optimizers > 1:
                self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if not self.automatic_optimization:
                for opt in self.optimizers():
                    opt.zero_grad()
                self.manual_backward(loss)
                for opt in self.optimizers():
                    opt.step()
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            opt = self.trainer.optimizers[0]
            flat = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
            self.records.append((self.trainer.global_step, getattr(opt, "averaging_step", -1), flat.tolist()))

        def configure_optimizers(self):
            if self.n_optimizers > 1:
                params = list(self.parameters())
                return [torch.optim.SGD(params[:2], lr=0.05), torch.optim.SGD(params[2:], lr=0.05)]
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)}

        def train_dataloader(self):
            gen = torch.Generator().manual_seed(0)
            n = WORLD * STEPS_PER_EPOCH * 4
            x = torch.randn(n, 8, generator=gen)
            y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(n, 1, generator=gen)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    return Regression


def _trainer(folder: Path, callbacks, *, epochs: int = EPOCHS, strategy=None, checkpoints: bool = False):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    if checkpoints:
        callbacks = [*callbacks, ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)]
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy or "ddp",
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpoints,
        limit_val_batches=0,
        default_root_dir=folder,
    )


def _raises_everywhere(fn, *expected: str) -> str:
    """``fn()`` raises on this rank, with every string of ``expected`` in its message; that message."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is checked
        message = f"{type(exc).__name__}: {exc}"
        for text in expected:
            assert text in message, message
        return message
    raise AssertionError(f"no error, expected one naming {expected}")


def _ranks(rank: int, world_size: int, folder: str) -> dict:
    from hieravg_optim import lightning as hl

    folder = Path(folder)
    Regression = _module_class()
    out: dict = {}

    def entry_point(rank: int):
        site = _write_dist_info(folder / f"site_{rank}")
        config_file = folder / f"hieravg_{rank}.json"
        config_file.write_text(json.dumps({"hierarchical_averaging": SECTION}))  # a whole config holding it
        sys.path.insert(0, str(site))
        os.environ[hl.CONFIG_ENV] = str(config_file)
        try:
            trainer = _trainer(folder / "run", [], checkpoints=True)
        finally:
            sys.path.remove(str(site))
            del os.environ[hl.CONFIG_ENV]
        found = [cb for cb in trainer.callbacks if isinstance(cb, hl.HierarchicalAveraging)]
        assert len(found) == 1, trainer.callbacks
        model = Regression()
        trainer.fit(model)
        out["uninterrupted"] = model.records
        out["final_step"] = (trainer.global_step, found[0].optimizer.averaging_step)
        if rank == 0:
            ckpt = torch.load(folder / "run" / "epoch=1.ckpt", weights_only=True)
            ranks = ckpt["callbacks"]["HierarchicalAveraging"]["ranks"]
            out["saved_ranks"] = [None if r is None else sorted(r) for r in ranks]

    def resume(rank: int):
        os.environ[hl.CONFIG_ENV] = json.dumps(SECTION)
        try:
            callbacks = hl.callbacks_factory()
        finally:
            del os.environ[hl.CONFIG_ENV]
        trainer = _trainer(folder / "resumed", callbacks)
        model = Regression()
        trainer.fit(model, ckpt_path=folder / "run" / "epoch=1.ckpt")
        out["resumed"] = model.records
        out["resumed_final_step"] = (trainer.global_step, callbacks[0].optimizer.averaging_step)

    def bad(rank: int):
        from lightning.pytorch.strategies import DDPStrategy

        out["bad_key"] = _raises_everywhere(
            lambda: hl.HierarchicalAveraging({**SECTION, "period": 3}), "HierarchicalAveraging(section)", "'period'"
        )
        out["bad_levels"] = _raises_everywhere(
            lambda: _trainer(folder / "bad", [hl.HierarchicalAveraging({**SECTION, "period_group_size": {"3": 3}})], epochs=1).fit(Regression()),
            "period_group_size", "world size 4",
        )
        out["lightning_averaging"] = _raises_everywhere(
            lambda: _trainer(
                folder / "bad", [hl.HierarchicalAveraging(SECTION)], epochs=1, strategy=DDPStrategy(model_averaging_period=4)
            ).fit(Regression()),
            "model_averaging_period",
        )
        ckpt = torch.load(folder / "run" / "epoch=1.ckpt", weights_only=True)
        ckpt["callbacks"]["HierarchicalAveraging"]["world_size"] = 8  # as if saved by 8 ranks
        torch.save(ckpt, folder / f"other_world_{rank}.ckpt")
        out["other_world"] = _raises_everywhere(
            lambda: _trainer(folder / "bad", [hl.HierarchicalAveraging(SECTION)], epochs=3).fit(
                Regression(), ckpt_path=folder / f"other_world_{rank}.ckpt"
            ),
            "ValueError", "states of 8 ranks", "world size 4",
        )
        out["two_optimizers"] = _raises_everywhere(
            lambda: _trainer(folder / "bad", [hl.HierarchicalAveraging(SECTION)], epochs=1).fit(Regression(optimizers=2)),
            "NotImplementedError", "exactly one optimizer",
        )

    run_scenarios({"entry_point": entry_point, "resume": resume, "bad": bad}, rank)
    return out



@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lightning")
    return run_distributed(
        _ranks, WORLD, str(folder), timeout=300, pg_timeout=120, env={"PYTHONWARNINGS": "ignore"}
    )


def test_entry_point_and_schedule(outputs):
    runs = [o["uninterrupted"] for o in outputs]
    assert all(len(r) == EPOCHS * STEPS_PER_EPOCH for r in runs), [len(r) for r in runs]
    for i in range(EPOCHS * STEPS_PER_EPOCH):
        step, count, p0 = runs[0][i]
        for rank in range(WORLD):
            assert runs[rank][i][:2] == (i + 1, i + 1), (rank, runs[rank][i][:2])  # count == global step
        assert runs[1][i][2] == p0 and runs[3][i][2] == runs[2][i][2], f"a replica's ranks differ at step {step}"
        averaged = count - 1 < WARMUP or (count - 1) % PERIOD == 0
        assert (runs[2][i][2] == p0) == averaged, f"step {step}: replicas equal {runs[2][i][2] == p0}, expected {averaged}"
    assert all(o["final_step"] == (EPOCHS * STEPS_PER_EPOCH,) * 2 for o in outputs)
    saved = outputs[0]["saved_ranks"]
    assert saved[0] is None and all(r == ["optimizer_states", "state_dict"] for r in saved[1:]), saved


def test_resume_equals_uninterrupted(outputs):
    start = 2 * STEPS_PER_EPOCH
    assert (start - 1) % PERIOD != 0, "the checkpoint must fall between rounds"
    for rank, o in enumerate(outputs):
        resumed, full = o["resumed"], o["uninterrupted"][start:]
        assert [r[:2] for r in resumed] == [r[:2] for r in full], rank
        for (step, _, a), (_, _, b) in zip(resumed, full):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6, msg=f"rank {rank} step {step}")
        assert o["resumed_final_step"] == (EPOCHS * STEPS_PER_EPOCH,) * 2


def test_bad_settings_raise_on_every_rank(outputs):
    for key in ("bad_key", "bad_levels", "lightning_averaging", "other_world", "two_optimizers"):
        messages = [o[key] for o in outputs]
        assert all(m for m in messages), key
    assert "ValueError" in outputs[0]["bad_levels"] and "TypeError" not in outputs[0]["bad_key"]


def test_lightning_launch_of_an_unchanged_script(tmp_path):
    """``HIERAVG_LIGHTNING_CONFIG=... python train.py``, Lightning starting the 4 ranks itself: the entry point (a
    dist-info on PYTHONPATH) is found by a script that never names this library; on every rank the count is the
    global step and the rounds are the schedule's. (Ranks started by another launcher, e.g. torchrun, are what the
    spawned ranks above are to Lightning: processes created externally.)"""
    from hieravg_optim import AveragingLevel, rounds_per_level

    site = _write_dist_info(tmp_path / "site")
    env = {"HIERAVG_LIGHTNING_CONFIG": json.dumps(SECTION), "PYTHONPATH": str(site), "PYTHONWARNINGS": "ignore"}
    result = run_command([sys.executable, str(ROOT / "tests" / "lightning_train.py")], timeout=240, extra_env=env)
    check_ok(result)
    steps = 2 * STEPS_PER_EPOCH
    expected = rounds_per_level(0, steps, [AveragingLevel(PERIOD, WORLD)], warmup_steps=WARMUP)
    # Found anywhere in the output: the ranks share the launcher's stdout, where another rank's text can
    # precede a line without a newline between them.
    lines = sorted(re.findall(r"rank \d+: global step \d+, count \d+, rounds \{[^}]*\}", result.stdout))
    assert lines == [
        f"rank {r}: global step {steps}, count {steps}, rounds {{{PERIOD}: {expected[0]}}}" for r in range(WORLD)
    ], result.stdout + result.stderr[-3000:]

"""The DeepSpeed section under Lightning's ``DeepSpeedStrategy`` and Fabric's, after ``hieravg_optim.deepspeed.install()``.

4 gloo ranks as 2 replicas of 2, real DeepSpeed engines on the CPU, each rank its own data (Lightning's
``DistributedSampler`` over the world; Fabric: a generator seeded by the rank). One spawn of 4 ranks for
all of it (Lightning and DeepSpeed are imported in those 4 processes only).

Both strategies refuse the CPU in ``setup_environment`` ("The DeepSpeed strategy is only supported on CUDA
GPUs"). Inside the spawned ranks only, this file subclasses each strategy to skip that one check (the
subclass's ``setup_environment`` runs the parent's parent's), as ``tests/test_deepspeed_fp16.py`` overrides
DeepSpeed's CPU fp16 check. The subclasses also give the strategy its devices as ``cpu:<local rank>``
(``parallel_devices``, a constructor argument of both): the strategies pass ``root_device.index`` to
DeepSpeed as ``device_rank`` and check that the indices are the local ranks, and torch ignores the index
of a CPU device. Everything else is Lightning's and DeepSpeed's own code: the strategy's
``deepspeed.initialize(model_parameters=filter(...))`` call (an iterator), its engine, its checkpoints
(``engine.save_checkpoint(path, tag="checkpoint")``, loaded back through ``Trainer.fit(ckpt_path=...)`` and
``Fabric.load``).

* ``lightning``: ZeRO-2, 4 epochs of 5 steps: the two ranks of a replica always equal, the replicas equal
  during the warm-up (synchronous) and after a round, apart between rounds; the count is
  ``trainer.global_step`` and the engine's ``global_steps``; a resume from the checkpoint after epoch 2
  (between rounds, so each replica needs its own files: ``<ckpt>/checkpoint/replica_<k>/``) ends where the
  uninterrupted run ended (allclose 1e-6), count included.
* ``lightning_zero3``: ZeRO-3 with the layers built in ``configure_model`` (Lightning wraps it in
  ``deepspeed.zero.Init`` over the world): ``NotImplementedError`` on every rank naming the fix; with the
  model built in ``__init__`` instead, ZeRO-3 trains and the count is the global step.
* ``callback_under_deepspeed``: the DDP callback under ``DeepSpeedStrategy``: ``TypeError`` naming ``install()``.
* ``fabric``: the same checks, briefly (resume included), through ``Fabric.setup`` / ``Fabric.save`` / ``Fabric.load``, stepping
  with ``fabric.strategy.model.step()`` (the engine); ``optimizer.step()`` raises on every rank: Fabric 2.6
  would step DeepSpeed's optimizer directly, bypassing the engine's step and so the averaging.
* ``bad``: a bad section raises on every rank, naming the key.

Runtime budget: about 90 s on 2 cores (one spawn).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.harness import default_timeout, run_distributed, run_scenarios

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None or importlib.util.find_spec("deepspeed") is None,
        reason="needs lightning and deepspeed",
    ),
    pytest.mark.timeout(default_timeout(500)),
]

WORLD = 4
WARMUP = 2
PERIOD = 4
STEPS_PER_EPOCH = 5
EPOCHS = 4
RESUME_AT = 2 * STEPS_PER_EPOCH  # between rounds: (RESUME_AT - 1) % PERIOD != 0
CPU_DEVICES = [torch.device("cpu", i) for i in range(WORLD)]
"""The CPU with the local rank as its index (torch ignores it): what the strategies' CUDA code reads."""
SECTION = {"period_group_size": {str(PERIOD): WORLD}, "warmup_steps": WARMUP, "ranks_per_replica": 2}


def _config(stage: int, **section) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "hierarchical_averaging": {**SECTION, **section},
    }


def _cpu_strategies():
    """Lightning's and Fabric's DeepSpeedStrategy with only their CUDA checks skipped. Ranks only."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def __init__(self, **kwargs):
            super().__init__(parallel_devices=CPU_DEVICES, **kwargs)

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's CUDA check skipped

    class CPUFabricDeepSpeedStrategy(FabricDeepSpeed):
        def __init__(self, **kwargs):
            super().__init__(parallel_devices=CPU_DEVICES, **kwargs)

        def setup_environment(self) -> None:
            FabricDDP.setup_environment(self)  # DeepSpeedStrategy's CUDA check skipped

    return CPUDeepSpeedStrategy, CPUFabricDeepSpeedStrategy


def _data(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return x, x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(n, 1, generator=gen)


def _net():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _flat(module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


def _module_class():
    import lightning.pytorch as pl
    from torch import nn

    from hieravg_optim.deepspeed import get_averaging

    class Regression(pl.LightningModule):
        def __init__(self, in_configure_model: bool = False, zero3_in_init: bool = False):
            super().__init__()
            self.in_configure_model = in_configure_model
            self.partitioned = in_configure_model or zero3_in_init  # ZeRO-3: no whole parameters to record
            self.net = None if in_configure_model else _net()
            self.records: list[tuple[int, int, int, list[float]]] = []

        def configure_model(self):
            if self.net is None:
                self.net = _net()  # under deepspeed.zero.Init with ZeRO-3

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            engine = self.trainer.strategy.deepspeed_engine
            averaging = get_averaging(engine)
            count = -1 if averaging is None else averaging.averager.step
            params = [] if self.partitioned else _flat(self.net)
            self.records.append((self.trainer.global_step, engine.global_steps, count, params))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            x, y = _data(WORLD * STEPS_PER_EPOCH * 4)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    return Regression


def _trainer(folder: Path, strategy, *, epochs: int = EPOCHS, checkpoints: bool = False):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)] if checkpoints else []
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpoints,
        limit_val_batches=0,
        default_root_dir=folder,
    )


def _fabric_run(fabric, model, optimizer, rank: int, start: int, stop: int, records: list) -> None:
    from hieravg_optim.deepspeed import get_averaging

    for step in range(start, stop):
        x, y = _data(4, seed=1000 * rank + step)  # each rank its own data
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        engine = fabric.strategy.model  # the DeepSpeedEngine: its step() averages (optimizer.step() refuses)
        engine.step()
        records.append((step + 1, engine.global_steps, get_averaging(engine).averager.step, _flat(model.module)))


def _outcome(fn, records: list) -> tuple[str, object]:
    """``("ok", records)`` after ``fn()``, or ``("error", message)``: checked in the parent, on every rank."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is checked in the parent
        return "error", f"{type(exc).__name__}: {exc}"
    return "ok", records


def _ranks(rank: int, world_size: int, folder: str) -> dict:
    import hieravg_optim.deepspeed

    folder = Path(folder)
    CPUDeepSpeedStrategy, CPUFabricDeepSpeedStrategy = _cpu_strategies()
    Regression = _module_class()
    hieravg_optim.deepspeed.install()
    out: dict = {}

    def lightning(rank: int):
        model = Regression()
        trainer = _trainer(folder / "pl", CPUDeepSpeedStrategy(config=_config(2)), checkpoints=True)
        trainer.fit(model)
        out["pl"] = model.records

    def lightning_resume(rank: int):
        model = Regression()
        trainer = _trainer(folder / "pl_resumed", CPUDeepSpeedStrategy(config=_config(2)))
        out["pl_resumed"] = _outcome(lambda: trainer.fit(model, ckpt_path=folder / "pl" / "epoch=1.ckpt"), model.records)

    def lightning_zero3(rank: int):
        model = Regression(in_configure_model=True)
        trainer = _trainer(folder / "pl3", CPUDeepSpeedStrategy(config=_config(3)), epochs=1)
        out["zero3"] = _outcome(lambda: trainer.fit(model), model.records)
        model = Regression(zero3_in_init=True)  # the fix the error names: the model built in __init__
        trainer = _trainer(folder / "pl3_init", CPUDeepSpeedStrategy(config=_config(3)), epochs=1)
        out["zero3_in_init"] = _outcome(lambda: trainer.fit(model), model.records)

    def setup():
        from lightning.fabric import Fabric

        fab = Fabric(accelerator="cpu", devices=WORLD, strategy=CPUFabricDeepSpeedStrategy(config=_config(2)))
        fab.launch()
        net = _net()
        model, optimizer = fab.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        return fab, model, optimizer

    def fabric_optimizer_step(rank: int):
        fab, model, optimizer = setup()
        fab.backward(torch.nn.functional.mse_loss(model(_data(4, seed=rank)[0]), _data(4, seed=rank)[1]))
        out["fabric_optimizer_step"] = _outcome(optimizer.step, [])

    def fabric(rank: int):
        steps = EPOCHS * STEPS_PER_EPOCH
        fab, model, optimizer = setup()
        records: list = []
        _fabric_run(fab, model, optimizer, rank, 0, RESUME_AT, records)
        fab.save(folder / "fabric", {"model": model, "optimizer": optimizer, "step": RESUME_AT})
        _fabric_run(fab, model, optimizer, rank, RESUME_AT, steps, records)
        out["fabric"] = records

    def fabric_resume(rank: int):
        fab, model, optimizer = setup()
        state = {"model": model, "optimizer": optimizer, "step": 0}
        resumed: list = []

        def resume():
            fab.load(folder / "fabric", state)
            _fabric_run(fab, model, optimizer, rank, state["step"], EPOCHS * STEPS_PER_EPOCH, resumed)

        out["fabric_resumed"] = _outcome(resume, resumed)

    def callback_under_deepspeed(rank: int):
        from hieravg_optim.lightning import HierarchicalAveraging

        trainer = _trainer(folder / "cb", CPUDeepSpeedStrategy(config=_config(2)), epochs=1)
        trainer.callbacks.append(HierarchicalAveraging(SECTION))
        out["callback_under_deepspeed"] = _outcome(lambda: trainer.fit(Regression()), [])

    def bad(rank: int):
        trainer = _trainer(folder / "bad", CPUDeepSpeedStrategy(config=_config(2, period=3)), epochs=1)
        try:
            trainer.fit(Regression())
        except Exception as exc:  # noqa: BLE001 - the message is checked in the parent
            out["bad"] = f"{type(exc).__name__}: {exc}"
        else:
            out["bad"] = None

    scenarios = {"lightning": lightning, "lightning_resume": lightning_resume, "lightning_zero3": lightning_zero3}
    scenarios["callback_under_deepspeed"] = callback_under_deepspeed
    scenarios.update(fabric_optimizer_step=fabric_optimizer_step, fabric=fabric, fabric_resume=fabric_resume, bad=bad)
    run_scenarios(scenarios, rank)
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lightning_deepspeed")
    return run_distributed(_ranks, WORLD, str(folder), timeout=450, pg_timeout=180, env={"PYTHONWARNINGS": "ignore"})


def _check_trajectory(runs: list[list], what: str) -> None:
    """Every step: count == global step; a replica's ranks equal; replicas equal exactly when averaged."""
    steps = EPOCHS * STEPS_PER_EPOCH
    assert all(len(r) == steps for r in runs), (what, [len(r) for r in runs])
    for i in range(steps):
        step, _, _, p0 = runs[0][i]
        for rank in range(WORLD):
            assert runs[rank][i][:3] == (i + 1,) * 3, (what, rank, runs[rank][i][:3])
        assert runs[1][i][3] == p0 and runs[3][i][3] == runs[2][i][3], f"{what}: a replica's ranks differ at step {step}"
        averaged = step - 1 < WARMUP or (step - 1) % PERIOD == 0
        equal = runs[2][i][3] == p0
        assert equal == averaged, f"{what} step {step}: replicas equal {equal}, expected {averaged}"


def _check_resume(full: list, outcome: tuple[str, object], what: str) -> None:
    kind, resumed = outcome
    assert kind == "ok", f"{what}: {resumed}"
    full = full[RESUME_AT:]
    assert [r[:3] for r in resumed] == [r[:3] for r in full], what
    for (step, _, _, a), (_, _, _, b) in zip(resumed, full):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6, msg=f"{what} step {step}")


def test_lightning_deepspeed_strategy(outputs):
    _check_trajectory([o["pl"] for o in outputs], "Lightning")


def test_lightning_deepspeed_resume(outputs):
    assert (RESUME_AT - 1) % PERIOD != 0
    for rank, o in enumerate(outputs):
        _check_resume(o["pl"], o["pl_resumed"], f"Lightning resume, rank {rank}")


def test_lightning_zero3_configure_model_errors_clearly(outputs):
    """Lightning's configure_model runs under deepspeed.zero.Init over the world: the adapter refuses it."""
    for rank, (kind, message) in enumerate(o["zero3"] for o in outputs):
        assert kind == "error", (rank, message)
        for text in ("NotImplementedError", "deepspeed.zero.Init", "Lightning", "configure_model"):
            assert text in message, (rank, message)


def test_lightning_zero3_model_built_in_init(outputs):
    """The fix the error names: under ZeRO-3 with the model built in __init__, it averages; count == global step."""
    for rank, (kind, records) in enumerate(o["zero3_in_init"] for o in outputs):
        assert kind == "ok", (rank, records)
        assert [r[:3] for r in records] == [(i + 1,) * 3 for i in range(STEPS_PER_EPOCH)], (rank, records)


def test_ddp_callback_refuses_deepspeed_strategy(outputs):
    for rank, (kind, message) in enumerate(o["callback_under_deepspeed"] for o in outputs):
        assert kind == "error" and "TypeError" in message and "install()" in message, (rank, message)


def test_fabric_deepspeed_strategy(outputs):
    _check_trajectory([o["fabric"] for o in outputs], "Fabric")


def test_fabric_optimizer_step_refused_on_every_rank(outputs):
    """Fabric 2.6 steps DeepSpeed's optimizer itself (its engine fails Fabric's Optimizable check): no silent no-op."""
    for rank, (kind, message) in enumerate(o["fabric_optimizer_step"] for o in outputs):
        assert kind == "error" and "RuntimeError" in message and "fabric.strategy.model.step()" in message, (rank, message)


def test_fabric_deepspeed_resume(outputs):
    for rank, o in enumerate(outputs):
        _check_resume(o["fabric"], o["fabric_resumed"], f"Fabric resume, rank {rank}")


def test_bad_section_raises_on_every_rank(outputs):
    for o in outputs:
        assert o["bad"] is not None and "'period'" in o["bad"] and "hierarchical_averaging" in o["bad"], o["bad"]

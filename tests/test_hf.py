"""The section through Hugging Face's ``Trainer`` and ``accelerate``: real frameworks, 4 ranks as 2 replicas of 2.

``hieravg_optim.deepspeed.install()`` is in effect; neither framework's code is changed. A tiny
``LlamaForCausalLM`` built from a config (``HF_HUB_OFFLINE=1``, no download), ZeRO-2 in fp32, the section
``{"2": 4}`` with ``"ranks_per_replica": "local_world_size"`` (``LOCAL_WORLD_SIZE=2``: two "nodes" of
2 ranks), ``"train_batch_size": "auto"`` (filled over the world, rewritten to one replica's). Each
rank reads its own samples. One spawn runs every ``Trainer`` scenario, another every ``accelerate``
one (importing transformers costs most of a spawn):

* the replicas differ after a local step and are equal after an averaging step, the ranks of a
  replica always equal; the averaging count equals the framework's global step;
* a run resumed from the framework's own checkpoint (``Trainer.train(resume_from_checkpoint=...)``,
  ``Accelerator.save_state`` / ``load_state``) equals the uninterrupted one (allclose 1e-6), the count
  included, and the checkpoint has the layout the framework looks for (``<dir>/global_step<N>/replica_<k>``);
* a bad section is a ``ValueError`` on every rank;
* without DeepSpeed (DDP), the documented recipe: the wrapped optimizer and the post-local SGD hook.
"""

from __future__ import annotations

import os

import pytest

from tests.harness import run_distributed, run_scenarios

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORLD = 4
S = 2
STEPS = 4
# MASTER_ADDR: accelerate asks for it when LOCAL_WORLD_SIZE < WORLD_SIZE ("multinode"); the harness's process
# group is already initialized, so nothing connects to it.
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "LOCAL_WORLD_SIZE": str(S), "TQDM_DISABLE": "1",
       "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
SECTION = {"period_group_size": {"2": WORLD}, "ranks_per_replica": "local_world_size", "synchronous_warmup": False}

pytestmark = pytest.mark.timeout(900)


def _ds_config(section=SECTION):
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "hierarchical_averaging": section,
    }


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class _Tokens:
    """64 samples of 16 token ids, fixed by the index; records the indices this rank read."""

    def __init__(self):
        self.read: list[int] = []

    def __len__(self):
        return 64

    def __getitem__(self, i):
        import torch

        self.read.append(int(i))
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(int(i)))
        return {"input_ids": ids, "labels": ids.clone()}


def _flat(model):
    import torch

    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def _equality(model):
    """(replicas equal, each replica's ranks equal) of the full module parameters. Collective."""
    import torch.distributed as dist

    flats = [None] * dist.get_world_size()
    dist.all_gather_object(flats, _flat(model))
    replicas_equal = all(flats[r].equal(flats[r % S]) for r in range(WORLD))
    within = all(flats[r].equal(flats[(r // S) * S]) for r in range(WORLD))
    return replicas_equal, within


def _all_read(read):
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(read))
    return everyone


# ------------------------------------------------------------------------------------------------
# HF Trainer
# ------------------------------------------------------------------------------------------------
def _trainer(folder, name, dataset, callbacks=(), section=SECTION, deepspeed=True, model=None, optimizer=None):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=os.path.join(folder, name), per_device_train_batch_size=2, max_steps=STEPS, save_steps=2,
        save_strategy="steps", learning_rate=1e-2, report_to=[], logging_steps=10**6, disable_tqdm=True,
        use_cpu=True, deepspeed=_ds_config(section) if deepspeed else None, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    return Trainer(
        model=model or _model(), args=args, train_dataset=dataset, callbacks=list(callbacks),
        optimizers=(optimizer, None),
    )  # fmt: skip


def _steps_callback(record):
    from transformers import TrainerCallback

    class Equality(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            record.append(_equality(model))

    return Equality()


def _hf_train_and_resume(rank, folder):
    import hieravg_optim.deepspeed as hds

    record: list = []
    data = _Tokens()
    trainer = _trainer(folder, "a", data, [_steps_callback(record)])
    trainer.train()
    engine = trainer.model_wrapped
    state = hds.get_averaging(engine)
    final = _flat(trainer.model)
    resumed = _trainer(folder, "b", _Tokens())
    resumed.train(resume_from_checkpoint=os.path.join(folder, "a", "checkpoint-2"))
    resumed_state = hds.get_averaging(resumed.model_wrapped)
    checkpoint = os.path.join(folder, "a", "checkpoint-2")
    return {
        "equality": record,
        "count": state.step,
        "global_step": trainer.state.global_step,
        "dp_world_size": engine.dp_world_size,
        "train_batch_size": engine.train_batch_size(),
        "read": _all_read(data.read),
        "resumed_count": resumed_state.step,
        "resumed_global_step": resumed.state.global_step,
        "resumed_max_diff": float((_flat(resumed.model) - final).abs().max()),
        "layout": (
            sorted(d for d in os.listdir(checkpoint) if d.startswith("global_step") or d == "latest"),
            sorted(d for d in os.listdir(os.path.join(checkpoint, "global_step2")) if d.startswith("replica_")),
        ),
    }


def _hf_bad_section(rank, folder):
    trainer = _trainer(folder, "bad", _Tokens(), section={**SECTION, "period_group_size": {"2": 3}})
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"


def _hf_ddp_recipe(rank, folder):
    """The documented recipe without DeepSpeed: wrap the optimizer, register the hook when training begins."""
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    from hieravg_optim import HierarchicalAveragingOptimizer
    from hieravg_optim.ddp import register_post_local_sgd_hook

    record: list = []
    data = _Tokens()
    model = _model()
    optimizer = HierarchicalAveragingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), period_group_size_dict={2: WORLD}, warmup_steps=0
    )
    replica_group, _ = dist.new_subgroups(group_size=S)  # DDP all-reduces gradients within the replica

    class PostLocalSGD(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            register_post_local_sgd_hook(trainer.model_wrapped, optimizer, replica_group)

    trainer = _trainer(folder, "ddp", data, [PostLocalSGD(), _steps_callback(record)], deepspeed=False, model=model,
                       optimizer=optimizer)  # fmt: skip
    trainer.train()
    return {
        "wrapped": type(trainer.model_wrapped).__name__,
        "equality": record,
        "count": optimizer.averaging_step,
        "global_step": trainer.state.global_step,
        "read": _all_read(data.read),
    }


def _hf_scenarios(rank, world_size, folder):
    import hieravg_optim.deepspeed as hds

    hds.install()
    try:
        return run_scenarios(
            {
                "ddp_recipe": lambda r: _hf_ddp_recipe(r, folder),
                "train_and_resume": lambda r: _hf_train_and_resume(r, folder),
                "bad_section": lambda r: _hf_bad_section(r, folder),
            },
            rank,
        )
    finally:
        hds.uninstall()


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    return run_distributed(_hf_scenarios, WORLD, str(folder), timeout=600, pg_timeout=180, env=ENV)


# Counts 0 and 2 average (period 2, no warm-up); counts 1 and 3 are local steps.
EQUALITY = [(True, True), (False, True), (True, True), (False, True)]


def _check_own_data(read):
    flat = [i for r in read for i in r]
    assert len(flat) == len(set(flat)), read  # no sample read by two ranks
    assert all(len(r) >= STEPS * 2 for r in read), read  # (accelerate's loader reads one batch ahead)


def test_trainer_replicas_apart_between_rounds_and_count_is_global_step(hf_results):
    for rank, out in enumerate(hf_results):
        r = out["train_and_resume"]
        assert r["equality"] == EQUALITY, (rank, r["equality"])
        assert r["count"] == r["global_step"] == STEPS, (rank, r)
        assert r["dp_world_size"] == S and r["train_batch_size"] == 2 * S, (rank, r)
        _check_own_data(r["read"])


def test_trainer_resume_from_its_checkpoint_equals_the_uninterrupted_run(hf_results):
    for rank, out in enumerate(hf_results):
        r = out["train_and_resume"]
        assert r["layout"] == (["global_step2", "latest"], ["replica_0", "replica_1"]), (rank, r["layout"])
        assert r["resumed_count"] == r["resumed_global_step"] == STEPS, (rank, r)
        assert r["resumed_max_diff"] <= 1e-6, (rank, r["resumed_max_diff"])


def test_trainer_bad_section_raises_on_every_rank(hf_results):
    for rank, out in enumerate(hf_results):
        message = out["bad_section"]
        assert message.startswith("ValueError: ") and '"period_group_size"' in message, (rank, message)


def test_trainer_ddp_recipe_without_deepspeed(hf_results):
    for rank, out in enumerate(hf_results):
        r = out["ddp_recipe"]
        assert r["wrapped"] == "DistributedDataParallel", r
        assert r["equality"] == EQUALITY and r["count"] == r["global_step"] == STEPS, (rank, r)
        _check_own_data(r["read"])


# ------------------------------------------------------------------------------------------------
# accelerate
# ------------------------------------------------------------------------------------------------
def _accelerator(deepspeed=True, section=SECTION):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DeepSpeedPlugin

    # One Accelerator per run in this process: accelerate's own tests reset its shared state so.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if not deepspeed:
        return Accelerator(cpu=True)
    config = {k: v for k, v in _ds_config(section).items() if k != "gradient_clipping"}
    plugin = DeepSpeedPlugin(hf_ds_config=config, gradient_accumulation_steps=1)
    # The CPU trap: Accelerator(cpu=True) leaves DeepSpeed out (plain DDP), and without it a CPU-only launch is a
    # world of 1. The process state on the CPU first, then DeepSpeed (as TrainingArguments(use_cpu=True) does).
    PartialState(cpu=True)
    return Accelerator(deepspeed_plugin=plugin)


def _accelerate_run(accelerator, *, save_at=None, load_from=None, hook=None):
    """STEPS steps of the loop (the first 2 skipped after ``load_state``); per step, the equality."""
    import torch

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if hook is not None:
        optimizer = hook[0](model, optimizer)
    data = _Tokens()
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if hook is not None:
        hook[1](model, optimizer)
    start = 0
    if load_from is not None:
        accelerator.load_state(load_from)
        start = 2
        loader = accelerator.skip_first_batches(loader, start)
    record = []
    for step, batch in enumerate(loader, start):
        if step == STEPS:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        record.append(_equality(accelerator.unwrap_model(model)))
        if save_at is not None and step + 1 == 2:
            accelerator.save_state(save_at)
    return model, record, data


def _accelerate_train_and_resume(rank, folder):
    import hieravg_optim.deepspeed as hds

    checkpoint = os.path.join(folder, "accelerate_state")
    engine, record, data = _accelerate_run(_accelerator(), save_at=checkpoint)
    final = _flat(engine.module)
    resumed, _, _ = _accelerate_run(_accelerator(), load_from=checkpoint)
    state, resumed_state = hds.get_averaging(engine), hds.get_averaging(resumed)
    assert state is not None and resumed_state is not None, f"no averaging engine: {type(engine).__name__}"
    return {
        "equality": record,
        "count": state.step,
        "global_step": engine.global_steps,
        "dp_world_size": engine.dp_world_size,
        "train_batch_size": engine.train_batch_size(),
        "read": _all_read(data.read),
        "resumed_count": resumed_state.step,
        "resumed_global_step": resumed.global_steps,
        "resumed_max_diff": float((_flat(resumed.module) - final).abs().max()),
        "layout": (
            sorted(d for d in os.listdir(checkpoint) if d in ("latest", "pytorch_model")),
            sorted(d for d in os.listdir(os.path.join(checkpoint, "pytorch_model")) if d.startswith("replica_")),
        ),
    }


def _accelerate_bad_sections(rank, folder):
    out = {}
    for label, section in (
        ("world_mismatch", {**SECTION, "period_group_size": {"2": 3}}),
        ("auto_string", {**SECTION, "ranks_per_replica": "auto"}),  # accelerate's own check refuses "auto"
    ):
        try:
            _accelerate_run(_accelerator(section=section))
            out[label] = "no error"
        except Exception as err:  # noqa: BLE001
            out[label] = f"{type(err).__name__}: {err}"
    return out


def _accelerate_ddp_recipe(rank, folder):
    """Without DeepSpeed: wrap the optimizer before prepare, register the hook on the prepared DDP model."""
    import torch.distributed as dist

    from hieravg_optim import HierarchicalAveragingOptimizer
    from hieravg_optim.ddp import register_post_local_sgd_hook

    replica_group, _ = dist.new_subgroups(group_size=S)
    wrapped = {}

    def wrap(model, optimizer):
        wrapped["optimizer"] = HierarchicalAveragingOptimizer(optimizer, period_group_size_dict={2: WORLD}, warmup_steps=0)
        return wrapped["optimizer"]

    def register(model, optimizer):
        wrapped["model"] = type(model).__name__
        register_post_local_sgd_hook(model, wrapped["optimizer"], replica_group)

    _, record, data = _accelerate_run(_accelerator(deepspeed=False), hook=(wrap, register))
    return {
        "wrapped": wrapped["model"],
        "equality": record,
        "count": wrapped["optimizer"].averaging_step,
        "read": _all_read(data.read),
    }


def _accelerate_scenarios(rank, world_size, folder):
    import hieravg_optim.deepspeed as hds

    hds.install()
    try:
        return run_scenarios(
            {
                "ddp_recipe": lambda r: _accelerate_ddp_recipe(r, folder),
                "train_and_resume": lambda r: _accelerate_train_and_resume(r, folder),
                "bad_sections": lambda r: _accelerate_bad_sections(r, folder),
            },
            rank,
        )
    finally:
        hds.uninstall()


@pytest.fixture(scope="module")
def accelerate_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accelerate")
    return run_distributed(_accelerate_scenarios, WORLD, str(folder), timeout=600, pg_timeout=180, env=ENV)


def test_accelerate_replicas_apart_between_rounds_and_count_is_global_step(accelerate_results):
    for rank, out in enumerate(accelerate_results):
        r = out["train_and_resume"]
        assert r["equality"] == EQUALITY, (rank, r["equality"])
        assert r["count"] == r["global_step"] == STEPS, (rank, r)
        assert r["dp_world_size"] == S and r["train_batch_size"] == 2 * S, (rank, r)
        _check_own_data(r["read"])


def test_accelerate_save_state_load_state_resume_equals_the_uninterrupted_run(accelerate_results):
    for rank, out in enumerate(accelerate_results):
        r = out["train_and_resume"]
        assert r["layout"] == (["latest", "pytorch_model"], ["replica_0", "replica_1"]), (rank, r["layout"])
        assert r["resumed_count"] == r["resumed_global_step"] == STEPS, (rank, r)
        assert r["resumed_max_diff"] <= 1e-6, (rank, r["resumed_max_diff"])


def test_accelerate_bad_sections_raise_on_every_rank(accelerate_results):
    for rank, out in enumerate(accelerate_results):
        r = out["bad_sections"]
        assert r["world_mismatch"].startswith("ValueError: ") and '"period_group_size"' in r["world_mismatch"], r
        # accelerate's own error, before DeepSpeed or this library sees the config: hence "local_world_size".
        assert r["auto_string"].startswith("ValueError: `hierarchical_averaging.ranks_per_replica` not found"), r


def test_accelerate_ddp_recipe_without_deepspeed(accelerate_results):
    for rank, out in enumerate(accelerate_results):
        r = out["ddp_recipe"]
        assert r["wrapped"] == "DistributedDataParallel", r
        assert r["equality"] == EQUALITY and r["count"] == STEPS, (rank, r)
        _check_own_data(r["read"])

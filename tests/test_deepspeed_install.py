"""``hieravg_optim.deepspeed.install()``: ``deepspeed.initialize`` itself honours the section, on real engines.

One spawn of 4 ranks (2 replicas of 2) runs every engine scenario, with ``install()`` in effect:

* a config with the section: the engine averages (replica mpu, averaging attached), and rank 0
  alone logs the levels once at INFO;
* a config without the section, or with the section but no optimizer (HF's ZeRO-3 evaluation
  engine): exactly DeepSpeed's engine, trained side by side with one built after ``uninstall()``,
  parameters bitwise equal.

Local tests: ``install`` / ``uninstall`` are idempotent and restore DeepSpeed's function; a module
global bound by name before ``install`` is named in a warning.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

from tests.harness import run_distributed, run_scenarios

deepspeed = pytest.importorskip("deepspeed")

WORLD = 4
S = 2  # ranks per replica

pytestmark = pytest.mark.timeout(600)

SECTION = {"period_group_size": {"2": WORLD}, "ranks_per_replica": S, "synchronous_warmup": False}


def _config(section=None, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        **extra,
    }
    if section is not None:
        cfg["hierarchical_averaging"] = section
    return cfg


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(engine, rank, steps):
    """``steps`` engine steps on this rank's own data; the full parameters after them."""
    import torch

    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(4, 8, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return [p.detach().clone() for p in engine.module.parameters()]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _with_section(rank):
    import torch
    import torch.distributed as dist

    import hieravg_optim.deepspeed as hds

    logger = logging.getLogger("hieravg_optim.deepspeed.initialize")
    records = _Records()
    logger.addHandler(records)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        model = _model()
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=_config(SECTION)
        )
    finally:
        logger.removeHandler(records)
        logger.setLevel(old_level)
    params = _train(engine, rank, 3)  # counts 0, 1, 2: averaging at 2
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, [p.tolist() for p in params])
    state = hds.get_averaging(engine)
    return {
        "averaging": state is not None,
        "count": state.step,
        "dp_world_size": engine.dp_world_size,
        "equal_after_round": all(g == gathered[0] for g in gathered),
        "logs": [m for m in records.messages if m.startswith("hierarchical averaging on DeepSpeed")],
    }


def _plain_pair(rank, config, with_optimizer):
    """The engine of ``config`` under install() and after uninstall(): whether each averages, and the parameters."""
    import torch

    import hieravg_optim.deepspeed as hds

    out = {}
    for label in ("installed", "uninstalled"):
        if label == "uninstalled":
            hds.uninstall()
        try:
            model = _model()
            kwargs = {"optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)} if with_optimizer else {}
            engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, **kwargs)
            if with_optimizer:
                params = _train(engine, rank, 3)
            else:
                with torch.no_grad():
                    params = [engine(torch.ones(2, 8))]
            out[label] = (hds.get_averaging(engine), engine.dp_world_size, type(optimizer).__name__, params)
        finally:
            hds.install()
    return out


def _no_section(rank):
    out = _plain_pair(rank, _config(), True)
    return _summary(out)


def _no_optimizer(rank):
    out = _plain_pair(rank, _config(SECTION, zero_optimization={"stage": 3}), False)
    return _summary(out)


def _summary(out):
    (avg_a, dp_a, opt_a, p_a), (avg_b, dp_b, opt_b, p_b) = out["installed"], out["uninstalled"]
    return {
        "averaging": (avg_a is not None, avg_b is not None),
        "dp_world_size": (dp_a, dp_b),
        "optimizer": (opt_a, opt_b),
        "bitwise_equal": all(a.equal(b) for a, b in zip(p_a, p_b)),
    }


def _captured(fn, name="hieravg_optim.deepspeed.local"):
    """``fn()`` and the INFO messages of logger ``name`` meanwhile."""
    logger = logging.getLogger(name)
    records = _Records()
    logger.addHandler(records)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        return fn(), records.messages
    finally:
        logger.removeHandler(records)
        logger.setLevel(old_level)


def _world_batch_size(rank):
    """``"train_batch_size"`` counted over the world (HF and accelerate fill ``"auto"`` so): one replica's."""
    import torch

    model = _model()
    config = _config(SECTION, train_batch_size=4 * 1 * WORLD)
    (engine, *_), logs = _captured(
        lambda: deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config)
    )
    return {"train_batch_size": engine.train_batch_size(), "logs": [m for m in logs if "train_batch_size" in m]}


def _local_world_size_and_iterator(rank):
    """``"ranks_per_replica": "local_world_size"`` (LOCAL_WORLD_SIZE=2 here) and ``model_parameters`` an iterator."""
    import torch.distributed as dist

    import hieravg_optim.deepspeed as hds

    model = _model()
    initial = [p.detach().clone() for p in model.parameters()]
    section = {**SECTION, "ranks_per_replica": "local_world_size"}
    optimizer = {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=filter(lambda p: p.requires_grad, model.parameters()),  # as Lightning passes them
        config=_config(section, optimizer=optimizer),
    )
    params = _train(engine, rank, 3)  # a round at count 2
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, [p.tolist() for p in params])
    state = hds.get_averaging(engine)
    return {
        "ranks_per_replica": state.config.ranks_per_replica,
        "dp_world_size": engine.dp_world_size,
        "count": state.step,
        "parameters_trained": sum(not p.equal(q) for p, q in zip(params, initial)),
        "equal_after_round": all(g == gathered[0] for g in gathered),
    }


def _zero_init_model(rank):
    """A model built under deepspeed.zero.Init over the world: an error on every rank, naming the fixes."""
    import torch

    config = _config(SECTION, zero_optimization={"stage": 3})
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _model()
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error"


def _earlier_layout_loads(rank):
    """A checkpoint moved into the earlier layout, <dir>/replica_<k>/<tag>/ with a latest each, still loads."""
    import os
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    import hieravg_optim.deepspeed as hds

    def build():
        model = _model()
        return deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=_config(SECTION)
        )[0]

    names = [None]
    if rank == 0:
        names[0] = tempfile.mkdtemp(prefix="hieravg-layout-")
    dist.broadcast_object_list(names, src=0)
    folder = names[0]
    engine = build()
    saved = _train(engine, rank, 3)
    engine.save_checkpoint(folder, tag="t3")
    new_layout = sorted(os.listdir(folder)), sorted(os.listdir(os.path.join(folder, "t3")))
    dist.barrier()
    if rank == 0:
        for k in range(WORLD // S):
            os.makedirs(os.path.join(folder, f"replica_{k}"))
            shutil.move(os.path.join(folder, "t3", f"replica_{k}"), os.path.join(folder, f"replica_{k}", "t3"))
            with open(os.path.join(folder, f"replica_{k}", "latest"), "w") as fd:
                fd.write("t3")
        shutil.rmtree(os.path.join(folder, "t3"))
        os.remove(os.path.join(folder, "latest"))
    dist.barrier()
    resumed = build()
    path, _ = resumed.load_checkpoint(folder)
    out = {
        "new_layout": new_layout,
        "loaded_from": os.path.relpath(path, folder),
        "count": hds.get_averaging(resumed).step,
        "equal": all(a.equal(b) for a, b in zip(saved, resumed.module.parameters())),
    }
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    return out


def _install_scenarios(rank, world_size):
    import hieravg_optim.deepspeed as hds

    assert hds.install() is True
    assert deepspeed.initialize is hds.initialize
    try:
        return run_scenarios(
            # The plain engines first: DeepSpeed keeps the last engine's mpu (deepspeed.utils.groups.mpu) for
            # every later engine of the process built without one.
            {
                "no_section": _no_section,
                "no_optimizer": _no_optimizer,
                "with_section": _with_section,
                "world_batch_size": _world_batch_size,
                "local_world_size_and_iterator": _local_world_size_and_iterator,
                "zero_init_model": _zero_init_model,
                "earlier_layout_loads": _earlier_layout_loads,
            },
            rank,
        )
    finally:
        hds.uninstall()


@pytest.fixture(scope="module")
def installed_results():
    # LOCAL_WORLD_SIZE=2: two "nodes" of 2 ranks, for "ranks_per_replica": "local_world_size".
    return run_distributed(_install_scenarios, WORLD, timeout=420, pg_timeout=120, env={"LOCAL_WORLD_SIZE": "2"})


def test_installed_initialize_averages_with_the_section(installed_results):
    for rank, out in enumerate(installed_results):
        case = out["with_section"]
        assert case["averaging"] and case["count"] == 3 and case["dp_world_size"] == S, (rank, case)
        assert case["equal_after_round"], rank
        assert len(case["logs"]) == (1 if rank == 0 else 0), (rank, case["logs"])
    log = installed_results[0]["with_section"]["logs"][0]
    assert "2 replicas of 2 ranks" in log and "levels [(2, 4)]" in log, log


@pytest.mark.parametrize("case", ["no_section", "no_optimizer"])
def test_installed_initialize_is_plain_deepspeed_without_section_or_optimizer(installed_results, case):
    for rank, out in enumerate(installed_results):
        got = out[case]
        assert got["averaging"] == (False, False), (rank, got)
        assert got["dp_world_size"] == (WORLD, WORLD), (rank, got)
        assert got["optimizer"][0] == got["optimizer"][1], (rank, got)
        assert got["bitwise_equal"], (rank, got)


def test_train_batch_size_of_the_world_is_rewritten_to_one_replicas(installed_results):
    for rank, out in enumerate(installed_results):
        case = out["world_batch_size"]
        assert case["train_batch_size"] == 4 * 1 * S, (rank, case)
        assert len(case["logs"]) == (1 if rank == 0 else 0), (rank, case)
    assert "train_batch_size 16 counts the world (4 ranks)" in installed_results[0]["world_batch_size"]["logs"][0]


def test_local_world_size_spelling_and_model_parameters_iterator(installed_results):
    for rank, out in enumerate(installed_results):
        case = out["local_world_size_and_iterator"]
        assert case["ranks_per_replica"] == 2 and case["dp_world_size"] == 2 and case["count"] == 3, (rank, case)
        assert case["parameters_trained"] == 4 and case["equal_after_round"], (rank, case)


def test_model_built_under_zero_init_raises_on_every_rank_naming_the_fix(installed_results):
    for rank, out in enumerate(installed_results):
        message = out["zero_init_model"]
        assert message.startswith("NotImplementedError: the model was built under deepspeed.zero.Init"), message
        assert "zero3_init_flag=False" in message and "before TrainingArguments" in message, message


def test_checkpoint_of_the_earlier_layout_still_loads(installed_results):
    for rank, out in enumerate(installed_results):
        case = out["earlier_layout_loads"]
        top, in_tag = case["new_layout"]
        assert top == ["latest", "t3"] and {"replica_0", "replica_1"} <= set(in_tag), case
        assert case["loaded_from"].startswith(f"replica_{rank // S}/t3/"), case
        assert case["count"] == 3 and case["equal"], (rank, case)


def test_unknown_ranks_per_replica_string_names_the_accelerate_spelling():
    from hieravg_optim.deepspeed.section import parse_section

    with pytest.raises(ValueError, match='"local_world_size".*accelerate') as info:
        parse_section({"period_group_size": {"4": 4}, "ranks_per_replica": "node"})
    assert "'node'" in str(info.value)
    assert parse_section({"period_group_size": {"4": 4}, "ranks_per_replica": "local_world_size"}).ranks_per_replica is None


def test_install_and_uninstall_are_idempotent():
    import hieravg_optim.deepspeed as hds
    from hieravg_optim.deepspeed.initialize import plain_initialize

    original = deepspeed.initialize
    try:
        assert hds.install() is True and hds.installed()
        assert hds.install() is False and deepspeed.initialize is hds.initialize
        assert plain_initialize() is original
    finally:
        assert hds.uninstall() is True
    assert hds.uninstall() is False and not hds.installed()
    assert deepspeed.initialize is original and plain_initialize() is original


def test_uninstall_keeps_a_wrapper_set_after_install():
    """A wrapper another library sets over the installed function is not dropped by uninstall(), which warns."""
    import hieravg_optim.deepspeed as hds

    original = deepspeed.initialize
    hds.install()
    installed_fn = deepspeed.initialize

    def third_party_initialize(*args, **kwargs):
        return installed_fn(*args, **kwargs)

    deepspeed.initialize = third_party_initialize
    try:
        with pytest.warns(UserWarning, match=r"third_party_initialize, set after hieravg_optim\.deepspeed\.install"):
            assert hds.uninstall() is False
        assert deepspeed.initialize is third_party_initialize and hds.installed()
    finally:
        deepspeed.initialize = installed_fn
        assert hds.uninstall() is True
    assert deepspeed.initialize is original


def test_install_warns_about_initialize_bound_by_name():
    import hieravg_optim.deepspeed as hds

    user = types.ModuleType("user_train_script")
    user.initialize = deepspeed.initialize  # from deepspeed import initialize
    sys.modules[user.__name__] = user
    sys.modules["user_train_script_alias"] = user  # one module under two names, as __main__ and __mp_main__
    try:
        with pytest.warns(UserWarning, match=r"user_train_script\.initialize is deepspeed\.initialize, bound by name"):
            hds.install()
    finally:
        hds.uninstall()
        del sys.modules[user.__name__], sys.modules["user_train_script_alias"]

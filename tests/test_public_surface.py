"""The public surface, pinned: names, keywords and their defaults, JSON keys, state-dict keys.

A refactor of the package must leave all of this as it is. Each entry point may take a
keyword explicitly or forward it through ``**settings`` to :meth:`AveragingConfig.create`;
either way every keyword accepted here must stay accepted, with the same default.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import hieravg_optim
import hieravg_optim.ddp
import hieravg_optim.fsdp
from hieravg_optim import AveragingConfig, HierarchicalAverager, HierarchicalAveragingOptimizer
from hieravg_optim.fsdp import FSDPHierarchicalAveragingOptimizer
from tests.harness import run_distributed

REQUIRED = inspect.Parameter.empty

ALL = {
    "hieravg_optim": {
        "AveragingConfig",
        "AveragingLevel",
        "HierarchicalAverager",
        "HierarchicalAveragingOptimizer",
        "LevelMetrics",
        "level_at",
        "nesterov_outer",
        "rounds_per_level",
    },
    "hieravg_optim.deepspeed": {
        "SECTION",
        "CHECKPOINT_KEY",
        "DeepSpeedAveraging",
        "ReplicaParallelUnit",
        "SectionSettings",
        "get_averaging",
        "initialize",
        "install",
        "installed",
        "outer_state_file",
        "parse_section",
        "replica_checkpoint_dir",
        "uninstall",
    },
    "hieravg_optim.fsdp": {
        "REPLICATE_DIM",
        "SHARD_DIM",
        "FSDPHierarchicalAveragingOptimizer",
        "check_replicate_shard_mesh",
        "init_replicate_shard_mesh",
        "load_checkpoint",
        "save_checkpoint",
        "shard_replica",
    },
    "hieravg_optim.ddp": {"register_post_local_sgd_hook"},
    "hieravg_optim.lightning": {"CONFIG_ENV", "HierarchicalAveraging", "callbacks_factory"},
}

# Each entry point's keywords and their defaults (REQUIRED: no default).
CORE_KEYWORDS = {
    "optimizer": REQUIRED,
    "period_group_size_dict": REQUIRED,
    "warmup_steps": 0,
    "process_group": None,
    "ranks_per_replica": 1,
    "bucket_cap_mb": 25.0,
    "buffers": None,
    "log_metrics_every": None,
    "tensors_to_average": None,
    "synchronous_warmup": False,
    "average_frozen": False,
    "collective_timeout_s": None,
    "nonfinite": "raise",
    "comm_dtype": None,
    "delay_steps": 0,
    "fragments": 1,
    "delay_mixing": 0.0,
    "delay_correction": "eager",
    "ranks_per_node": None,
    "outer_optimizers": None,
    "outer_state_device": None,
}
FSDP_KEYWORDS = {
    "optimizer": REQUIRED,
    "module": REQUIRED,
    "mesh": REQUIRED,
    "period_group_size_dict": REQUIRED,
    "warmup_steps": 0,
    "bucket_cap_mb": 25.0,
    "synchronous_warmup": True,
    "average_frozen": False,
    "collective_timeout_s": None,
    "nonfinite": "raise",
    "comm_dtype": None,
    "delay_steps": 0,
    "fragments": 1,
    "delay_mixing": 0.0,
    "delay_correction": "eager",
    "ranks_per_node": None,
    "outer_optimizers": None,
    "outer_state_device": None,
}
AVERAGER_KEYWORDS = {
    "config": REQUIRED,
    "process_group": None,
    "log_metrics_every": None,
    "agreed": False,
    "outer_optimizers": None,
    "outer_state_device": None,
}
CREATE_KEYWORDS = {
    "period_group_size": REQUIRED,
    "warmup_steps": 0,
    "ranks_per_replica": 1,
    "bucket_cap_mb": 25.0,
    "synchronous_warmup": False,
    "collective_timeout_s": None,
    "nonfinite": "raise",
    "comm_dtype": None,
    "delay_steps": 0,
    "fragments": 1,
    "delay_mixing": 0.0,
    "delay_correction": "eager",
    "ranks_per_node": None,
}
DEEPSPEED_INITIALIZE_KEYWORDS = {
    "args": None,
    "model": None,
    "optimizer": None,
    "model_parameters": None,
    "training_data": None,
    "lr_scheduler": None,
    "distributed_port": None,
    "mpu": None,
    "dist_init_required": None,
    "collate_fn": None,
    "config": None,
    "mesh_param": None,
    "config_params": None,
    "average_buffers": None,
    "collective_timeout_s": None,
    "nonfinite": None,
}
SECTION_KEYS = {
    "enabled",
    "period_group_size",
    "warmup_steps",
    "ranks_per_replica",
    "bucket_cap_mb",
    "synchronous_warmup",
    "average_frozen",
    "average_buffers",
    "collective_timeout_s",
    "nonfinite",
    "comm_dtype",
    "delay_steps",
    "fragments",
    "delay_mixing",
    "delay_correction",
    "ranks_per_node",
    "outer_optimizer",
    "outer_state_device",
}


@pytest.mark.parametrize("module_name", sorted(ALL))
def test_all_names(module_name):
    if module_name == "hieravg_optim.lightning":
        pytest.importorskip("lightning")
    module = __import__(module_name, fromlist=["__all__"])
    assert set(module.__all__) == ALL[module_name]
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.{name} is in __all__ but not defined"


def _create_default(name):
    """The default a keyword forwarded through ``**settings`` gets: the one of AveragingConfig.create."""
    create = inspect.signature(AveragingConfig.create).parameters
    assert name in create, f"{name!r} is forwarded through **settings but AveragingConfig.create does not take it"
    return create[name].default


def _check_keywords(fn, pinned):
    params = inspect.signature(fn).parameters
    forwards = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, default in pinned.items():
        if name in params:
            assert params[name].kind is not inspect.Parameter.POSITIONAL_ONLY, name
            assert params[name].default == default or params[name].default is default, (
                f"{fn.__qualname__}: default of {name!r} changed from {default!r} to {params[name].default!r}"
            )
        else:
            assert forwards, f"{fn.__qualname__} no longer accepts the keyword {name!r}"
            assert default is not REQUIRED, f"{fn.__qualname__}: required {name!r} cannot be forwarded"
            assert _create_default(name) == default, f"{fn.__qualname__}: default of {name!r} changed"


@pytest.mark.parametrize(
    "fn, pinned",
    [
        (HierarchicalAveragingOptimizer.__init__, CORE_KEYWORDS),
        (FSDPHierarchicalAveragingOptimizer.__init__, FSDP_KEYWORDS),
        (HierarchicalAverager.__init__, AVERAGER_KEYWORDS),
        (AveragingConfig.create, CREATE_KEYWORDS),
        (hieravg_optim.nesterov_outer, {"lr": 0.7, "momentum": 0.9}),
        (hieravg_optim.ddp.register_post_local_sgd_hook, {"model": REQUIRED, "optimizer": REQUIRED, "subgroup": REQUIRED}),
    ],
    ids=["core", "fsdp", "averager", "create", "nesterov_outer", "ddp_hook"],
)
def test_entry_point_keywords(fn, pinned):
    _check_keywords(fn, pinned)


def test_core_positional_order():
    """torch's PostLocalSGDOptimizer/HierarchicalModelAverager order: optimizer, dict, warmup, group."""
    names = list(inspect.signature(HierarchicalAveragingOptimizer.__init__).parameters)[1:5]
    assert names == ["optimizer", "period_group_size_dict", "warmup_steps", "process_group"]


def test_deepspeed_surface():
    pytest.importorskip("deepspeed")
    import hieravg_optim.deepspeed as hds

    assert set(ALL["hieravg_optim.deepspeed"]) == set(hds.__all__)
    _check_keywords(hds.initialize, DEEPSPEED_INITIALIZE_KEYWORDS)
    assert hds.SECTION == "hierarchical_averaging"
    assert hds.CHECKPOINT_KEY == "hierarchical_averaging"
    # Every JSON key is accepted, and an unknown one is an error naming it.
    section = {
        "enabled": True,
        "period_group_size": {"2": 2, "4": 4},
        "warmup_steps": 1,
        "ranks_per_replica": 1,
        "bucket_cap_mb": 10,
        "synchronous_warmup": True,
        "average_frozen": False,
        "average_buffers": True,
        "collective_timeout_s": 30,
        "nonfinite": "skip_replica",
        "comm_dtype": "bfloat16",
        "delay_steps": {"4": 1},
        "fragments": {"4": 2},
        "delay_mixing": 0.5,
        "delay_correction": "none",
        "ranks_per_node": 2,
        "outer_optimizer": {"4": {"type": "SGD", "params": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}},
        "outer_state_device": "cpu",
    }
    assert set(section) == SECTION_KEYS
    hds.parse_section(section)
    with pytest.raises(ValueError, match="unknown key 'no_such_key'"):
        hds.parse_section({**section, "no_such_key": 1})


def _state_dict_keys(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = HierarchicalAveragingOptimizer(inner, {2: 2}, outer_optimizers={2: hieravg_optim.nesterov_outer()})
    for _ in range(3):
        inner.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    sd = opt.state_dict()
    state = sd["hierarchical_averaging"]
    outer = state["outer"][2]
    return {
        "top": sorted(map(str, sd)),
        "state": sorted(state),
        "outer": sorted(outer),
        "step": (sd["step"], state["step"]),
        "anchors": len(outer["anchors"]),
    }


def test_state_dict_keys():
    results = run_distributed(_state_dict_keys, 2, timeout=120)
    for r in results:
        assert r["top"] == ["hierarchical_averaging", "param_groups", "state", "step"]
        assert r["state"] == ["levels", "outer", "step", "synchronous_warmup", "warmup_steps"]
        assert r["outer"] == ["anchors", "optimizer", "synced"]
        assert r["step"] == (3, 3)
        assert r["anchors"] == 2


def test_importing_the_package_does_not_import_dynamo_or_dtensor():
    """``torch.compiler.disable`` (which imports ``torch._dynamo``, 0.8 s) is called at the first traced round, and
    ``torch.distributed.tensor`` (0.7 s) is imported by the FSDP adapter only, not by the core: a run that never
    compiles nor shards does not pay for them. A fresh interpreter, so that no other test imported them."""
    import subprocess
    import sys

    code = (
        "import sys, torch, hieravg_optim\n"
        "from hieravg_optim.tensors import local_tensor\n"
        "assert local_tensor(torch.ones(2)).sum() == 2\n"
        "core = ['torch._dynamo' in sys.modules, 'torch.distributed.tensor' in sys.modules]\n"
        "import hieravg_optim.fsdp\n"
        "print(core, 'torch._dynamo' in sys.modules, 'torch.distributed.tensor' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[False, False] False True", out

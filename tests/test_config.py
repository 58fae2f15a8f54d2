"""Every invalid setting raises ValueError naming the value, on every rank, before any collective.

The pure checks run here in the test process; one spawn of 2 gloo ranks checks that the
wrapper raises them on every rank with no collective left behind, the warnings'
attribution to the caller, and that ranks given different configs get a RuntimeError
instead of a hang.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest

from hieravg_optim import AveragingConfig, AveragingLevel
from hieravg_optim.config import parse_levels
from tests.harness import default_timeout, run_distributed

pytestmark = pytest.mark.timeout(default_timeout(180))  # scaled like the harness's deadline

# (kwargs for AveragingConfig.create, world size for check_world_size, regex the message must match)
INVALID = [
    ({"period_group_size": {}}, 4, r"must not be empty"),
    ({"period_group_size": []}, 4, r"must not be empty"),
    ({"period_group_size": {0: 4}}, 4, r"Period 0 .*positive integer"),
    ({"period_group_size": {-2: 4}}, 4, r"Period -2 .*positive integer"),
    ({"period_group_size": {2.5: 4}}, 4, r"Period 2\.5 .*positive integer"),
    ({"period_group_size": {"x": 4}}, 4, r"Period 'x' .*positive integer"),
    ({"period_group_size": {True: 4}}, 4, r"Period True .*positive integer"),
    ({"period_group_size": {4: 2, 2: 4}}, 4, r"strictly increasing, got \[4, 2\]"),
    ({"period_group_size": [(2, 2), (2, 4)]}, 4, r"strictly increasing, got \[2, 2\]"),
    ({"period_group_size": {2: 0, 4: 4}}, 4, r"Group size 0 of period 2 must be a positive integer"),
    ({"period_group_size": {2: -2, 4: 4}}, 4, r"Group size -2 of period 2 must be a positive integer"),
    ({"period_group_size": {2: 2.0, 4: 4}}, 4, r"Group size 2\.0 of period 2 .*positive integer"),
    ({"period_group_size": {2: "2", 4: 4}}, 4, r"Group size '2' of period 2 .*positive integer"),
    ({"period_group_size": {2: 3, 4: 6}}, 6, None),  # valid: 3 divides 6
    ({"period_group_size": {2: 3, 4: 8}}, 8, r"Group size 3 of period 2 must divide the size of the process group \(8\)"),
    ({"period_group_size": {2: 2, 4: 4}}, 8, r"last group size .*\(4, period 4\) must be equal to the size of the process group \(8\)"),
    ({"period_group_size": {2: 16}}, 8, r"Group size 16 of period 2 must divide .*\(8\)"),
    ({"period_group_size": {4: 8}, "warmup_steps": -1}, 8, r"warmup_steps .*got -1"),
    ({"period_group_size": {4: 8}, "warmup_steps": 1.5}, 8, r"warmup_steps .*got 1\.5"),
    ({"period_group_size": {4: 8}, "warmup_steps": True}, 8, r"warmup_steps .*got True"),
    ({"period_group_size": {2: 3, 4: 6}, "ranks_per_replica": 2}, 6, r"Group size 3 of period 2 must be a multiple of ranks_per_replica=2"),
    ({"period_group_size": {4: 8}, "ranks_per_replica": 3}, 8, r"ranks_per_replica=3 must divide the size of the process group \(8\)"),
    ({"period_group_size": {4: 8}, "ranks_per_replica": 0}, 8, r"ranks_per_replica .*got 0"),
    ({"period_group_size": {4: 8}, "bucket_cap_mb": 0}, 8, r"bucket_cap_mb .*got 0"),
    ({"period_group_size": {4: 8}, "bucket_cap_mb": -1.0}, 8, r"bucket_cap_mb .*got -1\.0"),
    ({"period_group_size": {4: 8}, "bucket_cap_mb": "25"}, 8, r"bucket_cap_mb .*got '25'"),
    ({"period_group_size": {4: 8}, "bucket_cap_mb": True}, 8, r"bucket_cap_mb .*got True"),
    ({"period_group_size": {4: 8}, "bucket_cap_mb": math.nan}, 8, r"bucket_cap_mb .*got nan"),
    ({"period_group_size": {4: 8}, "bucket_cap_mb": math.inf}, 8, r"bucket_cap_mb .*got inf"),
    ({"period_group_size": {4: 8}, "synchronous_warmup": 1}, 8, r"synchronous_warmup must be True or False, got 1"),
]  # fmt: skip


def _check(kwargs: dict, world_size: int) -> AveragingConfig:
    kwargs = dict(kwargs)
    config = AveragingConfig.create(kwargs.pop("period_group_size"), **kwargs)
    config.check_world_size(world_size)
    return config


@pytest.mark.parametrize(("kwargs", "world_size", "pattern"), INVALID, ids=[str(i) for i in range(len(INVALID))])
def test_invalid_config_names_the_value(kwargs, world_size, pattern):
    if pattern is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _check(kwargs, world_size)
        return
    with pytest.raises(ValueError, match=pattern):
        _check(kwargs, world_size)


def test_period_group_size_of_wrong_type():
    with pytest.raises(TypeError, match="mapping"):
        AveragingConfig.create(8)
    with pytest.raises(TypeError, match="pairs"):
        AveragingConfig.create([(2, 2, 2)])


def test_json_style_keys_and_levels_accepted():
    assert parse_levels({"4": 2, "16": 8}) == (AveragingLevel(4, 2), AveragingLevel(16, 8))
    assert parse_levels([AveragingLevel(4, 2), (16, 8)]) == (AveragingLevel(4, 2), AveragingLevel(16, 8))
    config = AveragingConfig.create({"4": 2, "16": 8}, warmup_steps=3, bucket_cap_mb=0.5)
    assert config.bucket_cap_bytes == 500_000
    config.check_world_size(8)


def test_largest_period_one_warns_at_the_caller():
    config = AveragingConfig.create({1: 4})
    with pytest.warns(UserWarning, match="largest period in period_group_size is 1") as record:
        config.check_world_size(4)
    assert record[0].filename == __file__


def test_non_nested_and_useless_levels_warn():
    with pytest.warns(UserWarning, match="do not nest"):
        AveragingConfig.create({2: 4, 4: 6, 8: 12}).check_world_size(12)
    with pytest.warns(UserWarning, match="never averages anything"):
        AveragingConfig.create({2: 2, 4: 8}, ranks_per_replica=2).check_world_size(8)
    with pytest.warns(UserWarning, match="single replica") as record:
        AveragingConfig.create({4: 4}, ranks_per_replica=4).check_world_size(4)
    assert record[0].filename == __file__


# --------------------------------------------------------------------------------------------------
def _spawned(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from hieravg_optim import HierarchicalAveragingOptimizer

    param = torch.nn.Parameter(torch.full((3,), float(rank)))
    inner = torch.optim.SGD([param], lr=0.1)
    out: dict = {"errors": []}
    bad = [
        ({}, {}),
        ({0: 2}, {}),
        ({2: 2, 1: 2}, {}),
        ({2: 3}, {}),
        ({2: 1}, {}),  # last group size 1 != 2
        ({2: 2}, {"warmup_steps": -5}),
        ({2: 2}, {"ranks_per_replica": 2, "bucket_cap_mb": 0}),
        ({2: 1, 4: 2}, {"ranks_per_replica": 2}),  # group size 1 not a multiple of 2
    ]
    for levels, kwargs in bad:
        try:
            HierarchicalAveragingOptimizer(inner, levels, **kwargs)
        except ValueError as e:
            out["errors"].append(str(e))
        else:
            raise AssertionError(f"no ValueError for {levels} {kwargs}")
    # No collective was left half-done by those: the group still works, in order.
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert float(t) == 3.0

    # The warning for a largest period of 1 points at this line (the caller), through the wrapper.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        HierarchicalAveragingOptimizer(inner, {1: 2})
    mine = [w for w in caught if "largest period" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    out["warning_file"] = mine[0].filename

    # Different configs on different ranks: RuntimeError on every rank, not a hang.
    for levels, warmup in (({2: 2}, 3 + rank), ({1: 1, 2: 2} if rank == 0 else {2: 2}, 0)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                HierarchicalAveragingOptimizer(inner, levels, warmup_steps=warmup)
        except RuntimeError as e:
            out["errors"].append(str(e))
        else:
            raise AssertionError(f"no RuntimeError for rank-dependent config {levels} warmup {warmup}")
    # And a good one still works afterwards.
    opt = HierarchicalAveragingOptimizer(inner, {2: 2})
    opt.step()
    assert torch.equal(param.detach(), torch.full((3,), 0.5))
    return out


def test_errors_on_every_rank_in_real_processes():
    results = run_distributed(_spawned, 2, timeout=120, pg_timeout=30)
    assert results[0]["errors"][:8] == results[1]["errors"][:8]
    expected = [
        r"must not be empty",
        r"Period 0 ",
        r"strictly increasing, got \[2, 1\]",
        r"Group size 3 of period 2 must divide the size of the process group \(2\)",
        r"last group size .*\(1, period 2\) must be equal to the size of the process group \(2\)",
        r"warmup_steps .*got -5",
        r"bucket_cap_mb .*got 0",
        r"Group size 1 of period 2 must be a multiple of ranks_per_replica=2",
    ]
    for rank, r in enumerate(results):
        for message, pattern in zip(r["errors"], expected):
            assert re.search(pattern, message), (pattern, message)
        assert r["warning_file"] == __file__, r["warning_file"]
        config_error, levels_error = r["errors"][8:]
        assert "Ranks disagree on the averaging config" in config_error
        assert "'warmup_steps': 3" in config_error and "'warmup_steps': 4" in config_error
        assert "Ranks disagree on the averaging config" in levels_error


def test_comm_dtype_mapping_keys_are_periods_given_once():
    """A period named twice ({"4": ..., 4: ...}: JSON strings mixed with ints) is a ValueError naming both keys,
    never the last one silently; numpy integer keys are periods, as in period_group_size."""
    import numpy as np

    with pytest.raises(ValueError, match=r"comm_dtype keys '4' and 4 both name period 4"):
        AveragingConfig.create({2: 2, 4: 4}, comm_dtype={"4": "bf16", 4: "fp16"})
    with pytest.raises(ValueError, match=r"comm_dtype keys 2 and ' 2' both name period 2"):
        AveragingConfig.create({2: 2, 4: 4}, comm_dtype={2: None, " 2": "bf16"})
    config = AveragingConfig.create({np.int64(2): 2, 4: 4}, comm_dtype={np.int64(4): "bf16"})
    assert config.comm_dtype == (None, "bfloat16")


# --------------------------------------------------------------------------------------------------
def _auto_without_local_world_size(rank: int, world_size: int) -> dict:
    """ranks_per_node="auto" where rank 1 has neither LOCAL_WORLD_SIZE nor LOCAL_SIZE: every rank raises at once."""
    import os
    import time

    import torch
    import torch.distributed as dist

    import hieravg_optim.deepspeed as hds
    from hieravg_optim import HierarchicalAverager, HierarchicalAveragingOptimizer
    from hieravg_optim.agreement import raise_on_every_rank
    from tests.test_deepspeed import _client_optimizer, _config, _model

    if rank == 1:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        os.environ.pop("LOCAL_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    out = {}
    param = torch.nn.Parameter(torch.zeros(3))
    section = {"period_group_size": {"2": 2}, "ranks_per_replica": 1, "ranks_per_node": "auto"}

    def averager():  # the recipe of docs/faults.md for a config built by hand
        try:
            config = AveragingConfig.create({2: 2}, ranks_per_node="auto")
        except ValueError as err:
            raise_on_every_rank(err, None, "the averaging config")
        return HierarchicalAverager(config)

    for name, build in (
        ("optimizer", lambda: HierarchicalAveragingOptimizer(torch.optim.SGD([param], lr=0.1), {2: 2},
                                                             ranks_per_node="auto")),
        ("averager", averager),
        ("deepspeed", lambda: hds.initialize(model=(m := _model()), optimizer=_client_optimizer(m),
                                             config=_config(1, "fp32", 1, section))),
    ):  # fmt: skip
        start = time.monotonic()
        try:
            build()
        except (ValueError, RuntimeError) as err:
            out[name] = (type(err).__name__, str(err), time.monotonic() - start)
        else:
            raise AssertionError(f"{name}: no error on rank {rank}")
    # Nothing was left half-done: the group still works, in order.
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert float(t) == 3.0
    return out


def test_auto_ranks_per_node_missing_on_one_rank_raises_on_every_rank_at_once():
    """Before any subgroup is built: rank 1 raises the ValueError naming both variables, rank 0 a RuntimeError
    naming rank 1 and that error, well within the process group's timeout (60 s here)."""
    results = run_distributed(_auto_without_local_world_size, 2, timeout=180, pg_timeout=60)
    for name in ("optimizer", "averager", "deepspeed"):
        kind, message, seconds = results[1][name]
        assert kind == "ValueError" and "LOCAL_WORLD_SIZE" in message and "LOCAL_SIZE" in message, message
        kind, message, seconds0 = results[0][name]
        assert kind == "RuntimeError" and "Rank 1 failed" in message and "LOCAL_WORLD_SIZE" in message, message
        assert max(seconds, seconds0) < default_timeout(20), (name, seconds, seconds0)

"""The settings ``compress`` and ``ef_decay``: user forms, canonical forms, bad values on every rank, JSON keys."""

from __future__ import annotations

import re

import pytest
import torch

from hieravg_optim import AveragingConfig
from hieravg_optim.compression import Int8Block, TopK
from hieravg_optim.outer import PLAIN_OUTER, nesterov_outer
from tests.harness import default_timeout, run_distributed

LEVELS = {4: 4, 32: 8}


def test_user_forms_become_one_codec_per_level():
    c = AveragingConfig.create(LEVELS, compress="int8")
    assert c.compress == (Int8Block(256), Int8Block(256)) and c.ef_decay == ()
    c = AveragingConfig.create(LEVELS, compress={"32": {"type": "topk", "density": 0.01, "values": "bf16"}})
    assert c.compress == (None, TopK(density=0.01, chunk=4096, values="bfloat16"))
    c = AveragingConfig.create(LEVELS, compress={"type": "int8", "block": 64}, ef_decay={32: 0.9})
    assert c.compress == (Int8Block(64),) * 2 and c.ef_decay == (1.0, 0.9)
    assert c.level_ef_decay(0) == 1.0 and c.level_ef_decay(1) == 0.9
    for none in (None, "none", {4: None}, {}):
        assert AveragingConfig.create(LEVELS, compress=none).compress == ()
    assert AveragingConfig.create(LEVELS, ef_decay=1).ef_decay == ()
    # comm_dtype is the dtype of top-k values that the spec does not name.
    c = AveragingConfig.create(LEVELS, compress={32: {"type": "topk", "density": 0.1}}, comm_dtype={32: "bf16"})
    assert c.compress[1].values == "bfloat16"
    # Hashable and comparable across ranks: the agreement compares the canonical specs.
    assert hash(c.compress) == hash(AveragingConfig.create(LEVELS, compress=c.compress).compress)
    assert "compress" in c.agreement_value() and "ef_decay" in c.agreement_value()


def test_a_compressed_level_keeps_anchors_through_its_outer_optimizer_or_outer_sgd_lr1():
    c = AveragingConfig.create(LEVELS, compress={32: "int8"})
    assert c.outer_factories == {32: PLAIN_OUTER} and c.outer_optimizers == {}
    nesterov = nesterov_outer()
    c = AveragingConfig.create(LEVELS, compress={32: "int8"}, outer_optimizers={4: nesterov})
    assert c.outer_factories == {4: nesterov, 32: PLAIN_OUTER}
    c = AveragingConfig.create(LEVELS, compress={32: "int8"}, outer_optimizers={32: nesterov})
    assert c.outer_factories == {32: nesterov}
    sgd = PLAIN_OUTER([torch.zeros(1)])
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["lr"] == 1.0 and sgd.defaults["momentum"] == 0


@pytest.mark.parametrize(
    "settings, pattern",
    [
        ({"compress": "int4"}, r"compress: must name a codec.*'int4'"),
        ({"compress": {"type": "zstd"}}, r"unknown codec 'zstd'"),
        ({"compress": {"type": "int8", "blocks": 8}}, r"unknown key 'blocks'"),
        ({"compress": {"type": "int8", "block": 0}}, r"block must be a positive integer"),
        ({"compress": {"type": "int8", "block": 2.5}}, r"block must be a positive integer"),
        ({"compress": "topk"}, r"needs a density"),
        ({"compress": {"type": "topk", "density": 0}}, r"density must be a number in \(0, 1\]"),
        ({"compress": {"type": "topk", "density": 1.01}}, r"density must be a number in \(0, 1\]"),
        ({"compress": {"type": "topk", "density": float("nan")}}, r"density must be a number in \(0, 1\]"),
        ({"compress": {"type": "topk", "density": 1e-5}}, r"keeps no element of a chunk of 4096"),
        ({"compress": {"type": "topk", "density": 0.1, "values": "int4"}}, r"values must be one of"),
        ({"compress": {8: "int8"}}, r"compress key 8 must be the period of a level"),
        ({"compress": {"32": "int8", 32: "int8"}}, r"both name period 32"),
        ({"compress": "int8", "comm_dtype": "bf16"}, r"int8, which is its own wire dtype"),
        ({"compress": {"type": "topk", "density": 0.1, "values": "int8"}, "comm_dtype": "bf16"}, r"give one of them"),
        ({"ef_decay": 1.5}, r"ef_decay must be a number in \[0, 1\]"),
        ({"ef_decay": "0.9"}, r"ef_decay must be a number in \[0, 1\]"),
        ({"compress": {32: "int8"}, "ef_decay": {4: 0.9}}, r"ef_decay\[4\]: the level of period 4 has no compress"),
    ],
)
def test_bad_settings_are_value_errors_naming_the_value(settings, pattern):
    with pytest.raises(ValueError, match=pattern):
        AveragingConfig.create(LEVELS, **settings)


def test_deepspeed_section_keys_are_the_field_names():
    from hieravg_optim.deepspeed import parse_section

    section = {"period_group_size": {"4": 4, "32": 8}, "compress": {"32": {"type": "topk", "density": 0.01}},
               "ef_decay": {"32": 0.9}, "outer_state_device": "cpu"}  # fmt: skip
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # outer_state_device has an effect on a compressed level: no warning
        parsed = parse_section(section)
    assert parsed.config.compress == (None, TopK(density=0.01))
    assert parsed.config.ef_decay == (1.0, 0.9)
    with pytest.raises(ValueError, match=r'DeepSpeed config section "hierarchical_averaging": key "compress"'):
        parse_section({"period_group_size": {"4": 4}, "compress": {"type": "topk", "density": 2}})


def _spawned(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from hieravg_optim import HierarchicalAveragingOptimizer

    errors = []
    param = torch.nn.Parameter(torch.zeros(3))
    # Bad on one rank only: that rank raises its ValueError, the other a RuntimeError naming it; never a hang.
    try:
        HierarchicalAveragingOptimizer(
            torch.optim.SGD([param], lr=1.0), {2: 2}, compress="int8" if rank == 0 else {"type": "topk", "density": 9}
        )
    except (ValueError, RuntimeError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    # Valid on each rank, but different: the agreement names the setting.
    try:
        HierarchicalAveragingOptimizer(torch.optim.SGD([param], lr=1.0), {2: 2}, compress="int8" if rank else None)
    except RuntimeError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    dist.barrier()
    return {"errors": errors}


@pytest.mark.timeout(default_timeout(180))
def test_bad_or_different_settings_raise_on_every_rank():
    results = run_distributed(_spawned, 2, timeout=150, pg_timeout=90)
    assert re.search(r"RuntimeError: Rank 1 failed .*density must be a number", results[0]["errors"][0])
    assert re.search(r"ValueError: compress: the top-k density", results[1]["errors"][0])
    for r in results:
        assert len(r["errors"]) == 2, r
        assert "Ranks disagree on the averaging config" in r["errors"][1] and "compress" in r["errors"][1]

"""The settings of delayed rounds and fragments: forms, canonical values, and every rejected combination.

Pure: AveragingConfig.create and the schedule's fragment offsets, in the test process (no process group).
"""

from __future__ import annotations

import numpy as np
import pytest

from hieravg_optim import AveragingConfig, nesterov_outer
from hieravg_optim.schedule import fragment_offsets, fragment_spacing

LEVELS = {4: 2, 32: 8}


def test_defaults_are_empty_tuples_and_forms_are_per_level():
    config = AveragingConfig.create(LEVELS)
    assert (config.delay_steps, config.fragments, config.delay_mixing, config.delay_correction) == ((),) * 4
    # The defaults given explicitly are the defaults: the same canonical ().
    same = AveragingConfig.create(LEVELS, delay_steps={32: 0}, fragments=1, delay_mixing=0, delay_correction="eager")
    assert same == config
    config = AveragingConfig.create(
        LEVELS, delay_steps={"32": np.int64(4)}, fragments={32: 4}, delay_mixing={32: 0.5}, delay_correction="none"
    )
    assert config.delay_steps == (0, 4) and type(config.delay_steps[1]) is int
    assert config.fragments == (1, 4)
    assert config.delay_mixing == (0.0, 0.5)
    assert config.delay_correction == ("none", "none")
    # updated() keeps them (canonical tuples go back through create) and the agreement value holds them.
    again = config.updated(nonfinite="ignore")
    assert again.delay_steps == (0, 4) and again.fragments == (1, 4) and again.delay_correction == ("none", "none")
    assert config.agreement_value()["delay_steps"] == (0, 4)
    # Every level may be delayed.
    both = AveragingConfig.create(LEVELS, delay_steps={4: 3, 32: 31})
    assert both.delay_steps == (3, 31)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"delay_steps": -1}, r"delay_steps must be a non-negative integer \(optimizer steps\).*got -1 \(int\)"),
        ({"delay_steps": 1.5}, r"delay_steps must be a non-negative integer.*got 1\.5 \(float\)"),
        ({"delay_steps": True}, r"delay_steps must be a non-negative integer.*got True \(bool\)"),
        ({"delay_steps": {32: "4"}}, r"delay_steps of period 32 must be a non-negative integer.*got '4' \(str\)"),
        ({"delay_steps": {5: 1}}, r"delay_steps key 5 must be the period of a level \(one of \[4, 32\]\)"),
        ({"delay_steps": {"32": 1, 32: 2}}, r"delay_steps keys '32' and 32 both name period 32"),
        ({"fragments": 0}, r"fragments must be a positive integer \(fragments\).*got 0"),
        ({"fragments": {32: 33}}, r"fragments of period 32 is 33, more than the period.*fragments=\{32: 32\}"),
        ({"delay_mixing": 1.5}, r"delay_mixing must be a number in \[0, 1\].*got 1\.5"),
        ({"delay_mixing": {4: -0.1}}, r"delay_mixing of period 4 must be a number in \[0, 1\]"),
        ({"delay_mixing": float("nan")}, r"delay_mixing must be a number in \[0, 1\].*got nan"),
        ({"delay_correction": "lazy"}, r"delay_correction must be one of \['eager', 'none'\].*got 'lazy'"),
        ({"delay_steps": 4}, r"delay_steps of period 4 is 4, but must be below the period \(4\).*\{4: 3\}"),
        ({"delay_steps": {32: 32}}, r"delay_steps of period 32 is 32, but must be below the period \(32\)"),
        (
            {"delay_steps": {32: 8}, "fragments": {32: 4}},
            r"delay_steps of period 32 is 8, but must be below the fragment spacing of period 32 \(8 counts, 4 "
            r"fragments\).*delay_steps=\{32: 7\}",
        ),
        (
            {"delay_steps": {32: 3}, "fragments": {32: 10}},
            r"fragment spacing of period 32 \(3 counts, 10 fragments\)",
        ),
    ],
)
def test_invalid_values_name_the_setting_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AveragingConfig.create(LEVELS, **kwargs)


def test_rejected_combinations_with_the_levels():
    # A higher period that is not a multiple of the delayed level's: a higher round could start in its window.
    with pytest.raises(ValueError, match=r"need every higher level's period to be a multiple of 4.*got \[6\]"):
        AveragingConfig.create({4: 2, 6: 4}, delay_steps={4: 1})
    with pytest.raises(ValueError, match=r"delay_steps / fragments at period 4"):
        AveragingConfig.create({4: 2, 6: 4}, fragments={4: 2})
    AveragingConfig.create({4: 2, 6: 4}, delay_steps={6: 1})  # the top level: nothing above it
    # An outer optimizer below a level with fragments.
    with pytest.raises(ValueError, match=r"fragments at period 32 with an outer optimizer or compress \(which keep anchors\) at the lower period\(s\) \[4\]"):
        AveragingConfig.create(LEVELS, fragments={32: 4}, outer_optimizers={4: nesterov_outer()})
    # On the level with fragments, or above it: supported.
    config = AveragingConfig.create(LEVELS, fragments={32: 4}, delay_steps={32: 2}, outer_optimizers={32: nesterov_outer()})
    assert config.fragments == (1, 4)
    AveragingConfig.create(LEVELS, fragments={4: 2}, outer_optimizers={32: nesterov_outer()})


def test_deepspeed_section_takes_the_json_forms():
    pytest.importorskip("deepspeed")
    from hieravg_optim.deepspeed import parse_section

    settings = parse_section(
        {"period_group_size": {"4": 2, "32": 8}, "delay_steps": {"32": 4}, "fragments": {"32": 4},
         "delay_mixing": {"32": 0.5}, "delay_correction": {"32": "none"}}  # fmt: skip
    )
    config = settings.config
    assert (config.delay_steps, config.fragments) == ((0, 4), (1, 4))
    assert (config.delay_mixing, config.delay_correction) == ((0.0, 0.5), ("eager", "none"))
    with pytest.raises(ValueError, match=r'key "delay_steps"'):
        parse_section({"period_group_size": {"4": 2, "32": 8}, "delay_steps": {"32": -1}})


def test_fragment_offsets_and_spacing():
    assert fragment_offsets(32, 1) == (0,)
    assert fragment_offsets(32, 4) == (0, 8, 16, 24)
    assert fragment_offsets(10, 3) == (0, 3, 7)  # 3.33 -> 3, 6.67 -> 7
    assert fragment_offsets(4, 4) == (0, 1, 2, 3)
    assert fragment_spacing(32, 1) == 32
    assert fragment_spacing(32, 4) == 8
    assert fragment_spacing(10, 3) == 3
    assert fragment_spacing(32, 10) == 3


def test_compress_with_a_delay_or_fragments_at_one_level():
    """They compose at one level, node-aware levels included."""
    config = AveragingConfig.create({4: 2, 32: 4}, compress={32: "int8"}, delay_steps={32: 4}, fragments={32: 2})
    assert config.level_compress(1) is not None and config.delay_steps == (0, 4) and config.fragments == (1, 2)
    # Node-aware (ranks_per_node=4: the groups of 8 span 2 nodes of 4), delayed and fragmented alike.
    for extra in ({"delay_steps": {32: 4}}, {"delay_steps": {32: 3}, "fragments": {32: 4}}, {"fragments": {32: 2}}):
        config = AveragingConfig.create({4: 2, 32: 8}, compress={32: "int8"}, ranks_per_node=4, **extra)
        assert config.level_compress(1) is not None and config.ranks_per_node == 4, extra
    # comm_dtype keeps its meaning there: the dtype of top-k's kept values (and of the buffers' average); int8 is
    # its own wire.
    topk = {"type": "topk", "density": 0.1}
    config = AveragingConfig.create({4: 2, 32: 4}, compress={32: topk}, delay_steps={32: 4}, comm_dtype={32: "bf16"})
    assert config.level_compress(1).values == "bfloat16"
    with pytest.raises(ValueError, match=r"compress of period 32 is int8, which is its own wire dtype.*drop comm_dtype"):
        AveragingConfig.create({4: 2, 32: 4}, compress={32: "int8"}, fragments={32: 2}, comm_dtype={32: "bf16"})
    # ranks_per_node that makes no level node-aware (one rank per node in the group) is fine.
    AveragingConfig.create({4: 2, 32: 4}, compress={32: "int8"}, fragments={32: 2}, ranks_per_node=1)
    with pytest.raises(ValueError, match=r"outer optimizer or compress \(which keep anchors\) at the lower period"):
        AveragingConfig.create({4: 2, 32: 4}, compress={4: "int8"}, fragments={32: 4})
    # On different levels they compose: the delayed level above, the compressed one below.
    config = AveragingConfig.create({4: 2, 32: 4}, compress={4: "int8"}, delay_steps={32: 4})
    assert config.level_compress(0) is not None and config.delay_steps == (0, 4)

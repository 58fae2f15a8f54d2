"""Golden tables for the pure schedule (no processes), cross-checked against torch's own rule."""

from __future__ import annotations

import random
from collections import OrderedDict
from types import SimpleNamespace

import pytest
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

from hieravg_optim.schedule import AveragingLevel, level_at, rounds_per_level

pytestmark = pytest.mark.timeout(60)

LEVELS_3 = (AveragingLevel(2, 2), AveragingLevel(4, 4), AveragingLevel(8, 8))

# Which level (index into LEVELS_3) averages at counts 0..16, written out by hand.
# warmup 3: counts 0, 1, 2 never average; then the largest period dividing the count wins.
GOLDEN_3_WARMUP_3 = {
    0: None, 1: None, 2: None, 3: None,
    4: 1, 5: None, 6: 0, 7: None,
    8: 2, 9: None, 10: 0, 11: None,
    12: 1, 13: None, 14: 0, 15: None,
    16: 2,
}  # fmt: skip

# warmup 0: count 0 is divisible by every period, so it averages at the top level, as torch does.
GOLDEN_3_WARMUP_0 = {
    0: 2, 1: None, 2: 0, 3: None,
    4: 1, 5: None, 6: 0, 7: None,
    8: 2, 9: None, 10: 0, 11: None,
    12: 1, 13: None, 14: 0, 15: None,
    16: 2,
}  # fmt: skip

# A period of 1 at the bottom: every count averages somewhere.
LEVELS_1_3 = (AveragingLevel(1, 2), AveragingLevel(3, 4))
GOLDEN_1_3_WARMUP_2 = {0: None, 1: None, 2: 0, 3: 1, 4: 0, 5: 0, 6: 1, 7: 0, 8: 0, 9: 1}

# Periods that do not divide each other: 6 is not a multiple of 4.
LEVELS_4_6 = (AveragingLevel(4, 2), AveragingLevel(6, 4))
GOLDEN_4_6_WARMUP_0 = {
    0: 1, 1: None, 2: None, 3: None, 4: 0, 5: None, 6: 1, 7: None,
    8: 0, 9: None, 10: None, 11: None, 12: 1, 13: None, 14: None, 15: None, 16: 0,
}  # fmt: skip


# The table of docs/semantics.md (also checked there by tests/test_docs.py): {2: 2, 4: 4}, counts 0..8.
LEVELS_README = (AveragingLevel(2, 2), AveragingLevel(4, 4))
GOLDEN_README_WARMUP_0 = {0: 1, 1: None, 2: 0, 3: None, 4: 1, 5: None, 6: 0, 7: None, 8: 1}
GOLDEN_README_WARMUP_1 = {0: None, 1: None, 2: 0, 3: None, 4: 1, 5: None, 6: 0, 7: None, 8: 1}


@pytest.mark.parametrize(
    ("levels", "warmup", "golden"),
    [
        (LEVELS_README, 0, GOLDEN_README_WARMUP_0),
        (LEVELS_README, 1, GOLDEN_README_WARMUP_1),
        (LEVELS_3, 3, GOLDEN_3_WARMUP_3),
        (LEVELS_3, 0, GOLDEN_3_WARMUP_0),
        (LEVELS_1_3, 2, GOLDEN_1_3_WARMUP_2),
        (LEVELS_4_6, 0, GOLDEN_4_6_WARMUP_0),
    ],
    ids=["readme-warmup-0", "readme-warmup-1", "3-levels-warmup-3", "3-levels-warmup-0", "period-1-warmup-2", "non-nested-periods"],
)
def test_level_at_golden(levels, warmup, golden):
    assert {k: level_at(k, levels, warmup) for k in golden} == golden


def test_single_level_is_periodic_averaging():
    levels = (AveragingLevel(4, 8),)
    assert [level_at(k, levels, 0) for k in range(9)] == [0, None, None, None, 0, None, None, None, 0]
    # warmup that is not a multiple of the period: the first averaging is the next multiple.
    assert [level_at(k, levels, 5) for k in range(13)] == [None] * 8 + [0, None, None, None, 0]


@pytest.mark.parametrize(
    ("start", "stop", "levels", "warmup", "expected"),
    [
        (0, 17, LEVELS_3, 3, [3, 2, 2]),  # 6, 10, 14 | 4, 12 | 8, 16
        (0, 17, LEVELS_3, 0, [4, 2, 3]),  # 2, 6, 10, 14 | 4, 12 | 0, 8, 16
        (5, 9, LEVELS_3, 0, [1, 0, 1]),  # 6 | - | 8
        (0, 0, LEVELS_3, 0, [0, 0, 0]),
        (0, 10, LEVELS_1_3, 2, [5, 3]),  # 2, 4, 5, 7, 8 | 3, 6, 9
        (0, 100, (AveragingLevel(4, 2), AveragingLevel(16, 8)), 10, [16, 6]),  # 22 multiples of 4 in 12..96, 6 of them (16..96) of 16
    ],
)
def test_rounds_per_level_golden(start, stop, levels, warmup, expected):
    assert rounds_per_level(start, stop, levels, warmup) == expected


def _torch_level(count: int, levels, warmup: int) -> int | None:
    """The level torch's HierarchicalModelAverager picks at ``count``, run through torch's own code."""
    if count < warmup:  # HierarchicalModelAverager.average_parameters: `if self.step >= self.warmup_steps`
        return None
    periods = [lv.period for lv in levels]
    fake = SimpleNamespace(
        step=count,
        _periods=periods,
        period_process_group_dict=OrderedDict((p, i) for i, p in enumerate(periods)),
    )
    return HierarchicalModelAverager._find_process_group(fake)


def test_matches_torch_rule_on_random_hierarchies():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 4)
        periods = sorted(rng.sample(range(1, 25), n))
        levels = tuple(AveragingLevel(p, 2**i) for i, p in enumerate(periods))
        warmup = rng.randint(0, 12)
        for count in range(60):
            assert level_at(count, levels, warmup) == _torch_level(count, levels, warmup), (levels, warmup, count)


def test_levels_accept_the_wrappers_mapping_and_pairs():
    from hieravg_optim.schedule import as_levels

    as_objects = (AveragingLevel(4, 2), AveragingLevel(16, 4))
    assert as_levels({4: 2, 16: 4}) == as_objects
    assert as_levels([(4, 2), (16, 4)]) == as_objects
    assert rounds_per_level(0, 100, {4: 2, 16: 4}, 0) == rounds_per_level(0, 100, as_objects, 0) == [18, 7]
    assert level_at(3, {4: 2}, 0) is None
    with pytest.raises(TypeError, match="got the item 4"):
        rounds_per_level(0, 10, [4], 0)

"""The non-finite guard fused into the division, on 4 real gloo ranks: what each policy leaves in every tensor.

A bucket of 1000 float32 elements (``bucket_cap_mb=0.004``), so that the pipelined path reduces tensors from
1000 elements on in their own storage (divided by the group size before the all-reduce, with the check in the
same pass, :func:`hieravg_optim.averaging.prescale_checked_`) and packs the others through several buckets.
Rank ``r`` holds ``2 r + 2`` (2, 4, 6, 8) everywhere: the mean of the four is 5, of three of them a float32
quotient compared bitwise with torch's own division.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import default_timeout, run_distributed, run_scenarios

WORLD = 4
CAP_MB = 0.004  # 1000 float32 elements
pytestmark = pytest.mark.timeout(default_timeout(300))


def _tensors(rank: int) -> list[torch.Tensor]:
    value = 2.0 * rank + 2.0
    return [
        torch.full((3000,), value),  # in place, three buckets large
        torch.full((40, 50), value).t(),  # in place, not contiguous
        torch.full((1500,), value, dtype=torch.float64),  # in place, float64
        torch.full((1200,), value, dtype=torch.bfloat16),  # packed: 2000 bfloat16 elements per bucket
        *[torch.full((600,), value) for _ in range(5)],  # packed: 3000 elements, one bucket half at a time
    ]


def _averager(nonfinite: str = "raise"):
    from hieravg_optim import AveragingConfig, HierarchicalAverager

    return HierarchicalAverager(AveragingConfig.create({1: WORLD}, bucket_cap_mb=CAP_MB, nonfinite=nonfinite))


def _expect_raise(averager, tensors: list[torch.Tensor], named: str) -> None:
    before = [t.clone() for t in tensors]
    try:
        averager.average(-1, tensors)
    except RuntimeError as exc:
        assert "Non-finite values" in str(exc) and named in str(exc), exc
    else:
        raise AssertionError("no error for a non-finite replica")
    for i, (t, b) in enumerate(zip(tensors, before)):
        # Bitwise, NaN included: no tensor of the round was written.
        assert torch.equal(t.view(torch.uint8) if t.is_contiguous() else t.contiguous().view(torch.uint8),
                           b.contiguous().view(torch.uint8)), (i, t.reshape(-1)[:3])


def _expect_mean(tensors: list[torch.Tensor], expected: float | torch.Tensor) -> None:
    for i, t in enumerate(tensors):
        want = torch.as_tensor(expected, dtype=torch.float64).to(t.dtype) if not torch.is_tensor(expected) else expected
        assert torch.equal(t, want.to(t.dtype).expand_as(t)), (i, t.dtype, t.reshape(-1)[:3], want)


def _scenario_finite_round_exact(rank: int):
    averager = _averager()
    tensors = _tensors(rank)
    averager.average(-1, tensors)
    _expect_mean(tensors, 5.0)
    # Random values: bitwise the round without the guard (the division after the SUM), in every dtype.
    generator = torch.Generator().manual_seed(rank)
    random = [torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.dtype) for t in _tensors(rank)]
    random[1] = random[1].t().contiguous().t()  # not contiguous, as in _tensors
    unchecked = [t.clone() for t in random]
    averager.average(-1, random)
    _averager("ignore").average(-1, unchecked)
    for i, (a, b) in enumerate(zip(random, unchecked)):
        assert torch.equal(a, b), (i, (a - b).abs().max())


def _scenario_raise_nan_in_last_bucket(rank: int):
    averager = _averager()
    tensors = _tensors(rank)
    if rank == 2:
        tensors[-1][-1] = float("nan")  # the last element of the last packed tensor: the last bucket
    _expect_raise(averager, tensors, "rank [2] (replica [2])")
    averager.average(-1, _tensors(rank))  # the group goes on: nothing left divided


def _scenario_raise_inf_on_one_rank_in_a_tensor_larger_than_a_bucket(rank: int):
    averager = _averager()
    tensors = _tensors(rank)
    if rank == 1:
        tensors[0][2500] = float("inf")  # in place, in its third bucket-sized stretch
    _expect_raise(averager, tensors, "rank [1] (replica [1])")
    tensors = _tensors(rank)
    if rank == 3:
        tensors[1][7, 3] = float("-inf")  # the non-contiguous one
        tensors[2][0] = float("nan")  # and float64
    _expect_raise(averager, tensors, "rank [3] (replica [3])")
    tensors = _tensors(rank)
    averager.average(-1, tensors)
    _expect_mean(tensors, 5.0)


def _scenario_skip_replica_in_place_and_packed(rank: int):
    averager = _averager("skip_replica")
    tensors = _tensors(rank)
    if rank == 1:
        tensors[0][0] = float("nan")  # in place
        tensors[4][10] = float("inf")  # packed
    replaced = averager.average(-1, tensors)
    assert replaced == (rank == 1)
    for t in tensors:  # the mean of ranks 0, 2, 3: (2 + 6 + 8) / 3, divided in each dtype
        _expect_mean([t], torch.tensor(16.0, dtype=t.dtype) / 3)
    tensors = _tensors(rank)
    if rank in (0, 3):
        tensors[-1][-1] = float("nan")  # the last bucket only
    averager.average(-1, tensors)
    for t in tensors:  # the mean of ranks 1 and 2
        _expect_mean([t], 5.0)


def _scenario_error_before_the_round_leaves_tensors_unchanged(rank: int):
    averager = _averager()
    tensors = _tensors(rank)
    before = [t.clone() for t in tensors]
    try:
        averager.average(-1, tensors, context={"setting": rank == 0})  # the ranks disagree
    except RuntimeError as exc:
        assert "setting" in str(exc), exc
    else:
        raise AssertionError("no error for a disagreement")
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)


def _scenario_coalesced_path(rank: int):
    """The coalesced path (the GPU default) takes no prescaled tensor: its guard is the separate check."""
    from hieravg_optim.averaging import BucketPool, average_tensors_, prescale_checked_

    tensors = _tensors(rank)
    cap = int(CAP_MB * 1e6)
    prescaled = prescale_checked_(tensors, WORLD, bucket_cap_bytes=cap, path="coalesced")
    assert prescaled.scaled == [] and not prescaled.nonfinite
    with torch.no_grad():
        average_tensors_(
            tensors, dist.group.WORLD, WORLD, bucket_cap_bytes=cap, pool=BucketPool(), path="coalesced",
            prescaled=prescaled,
        )
    _expect_mean(tensors, 5.0)
    tensors = _tensors(rank)
    if rank == 0:
        tensors[-1][-1] = float("nan")
    assert prescale_checked_(tensors, WORLD, bucket_cap_bytes=cap, path="coalesced").nonfinite == (rank == 0)


def _run_all(rank: int, world_size: int) -> dict:
    return run_scenarios(
        {
            "finite_round_exact": _scenario_finite_round_exact,
            "raise_nan_in_last_bucket": _scenario_raise_nan_in_last_bucket,
            "raise_inf_on_one_rank": _scenario_raise_inf_on_one_rank_in_a_tensor_larger_than_a_bucket,
            "skip_replica": _scenario_skip_replica_in_place_and_packed,
            "error_before_the_round": _scenario_error_before_the_round_leaves_tensors_unchanged,
            "coalesced_path": _scenario_coalesced_path,
        },
        rank,
    )


def test_guard_policies_on_both_kinds_of_tensor():
    run_distributed(_run_all, WORLD, timeout=180, pg_timeout=60)


# -- local: which tensors prescale_checked_ divides, and undo ---------------------------------------
def test_prescale_divides_the_in_place_tensors_only_and_undo_is_exact():
    from hieravg_optim.averaging import prescale_checked_

    torch.manual_seed(0)
    tensors = [torch.randn(3000), torch.randn(50, 40).t(), torch.randn(999), torch.randn(2000, dtype=torch.float64),
               torch.randn(1000, dtype=torch.complex64), torch.randn(4000).expand(2, 4000), torch.zeros(0)]
    before = [t.clone() for t in tensors]
    cap = int(CAP_MB * 1e6)
    prescaled = prescale_checked_(tensors, 4, bucket_cap_bytes=cap)
    # From 1000 elements of their own dtype (the bucket), real, not overlapping: divided by 4, exactly.
    assert [id(t) for t in prescaled.scaled] == [id(tensors[0]), id(tensors[1]), id(tensors[3])]
    assert not prescaled.nonfinite
    for i in (0, 1, 3):
        assert torch.equal(tensors[i], before[i] / 4)
    for i in (2, 4, 5):
        assert torch.equal(tensors[i], before[i])
    prescaled.undo()
    prescaled.undo()  # a second call does nothing
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    # A group size that is not a power of two (its division is not exact): nothing divided.
    for size in (3, 6, 1):
        assert prescale_checked_(tensors, size, bucket_cap_bytes=cap).scaled == []
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    # The flag covers every tensor, divided or not; a divided NaN stays NaN.
    tensors[0][5] = float("nan")
    prescaled = prescale_checked_(tensors, 2, bucket_cap_bytes=cap)
    assert prescaled.nonfinite and bool(tensors[0][5].isnan())
    prescaled.undo()
    tensors[0][5] = before[0][5]
    tensors[4][3] = complex(0, float("inf"))
    assert prescale_checked_(tensors, 3, bucket_cap_bytes=cap).nonfinite
    # A float16 wire is checked on its own (comm_dtype="float16"): float32 tensors sent as float16 are not divided.
    assert prescale_checked_([torch.ones(3000)], 4, bucket_cap_bytes=cap, comm_dtype="float16").scaled == []


def test_prescaled_with_another_divisor_is_refused_and_undone():
    from hieravg_optim.averaging import BucketPool, average_tensors_, prescale_checked_

    t = torch.full((3000,), 8.0)
    prescaled = prescale_checked_([t], 4, bucket_cap_bytes=4000)
    assert torch.equal(t, torch.full((3000,), 2.0))
    with pytest.raises(ValueError, match=r"prescaled holds tensors divided by 4.*divisor=3"):
        average_tensors_([t], None, 4, bucket_cap_bytes=4000, pool=BucketPool(), divisor=3, prescaled=prescaled)
    assert torch.equal(t, torch.full((3000,), 8.0))  # undone before raising, before any collective


def test_prescale_undo_is_bitwise_but_in_the_subnormal_range():
    from hieravg_optim.averaging import prescale_checked_

    tiny = 2.0**-149  # float32's smallest subnormal
    normal = torch.tensor([2.0**-126, 1.5, -3e38, float("inf"), 1e-30]).repeat(600)
    subnormal = torch.tensor([3 * tiny, 7 * tiny, 2.0**-127 + tiny]).repeat(1000)
    before = normal.clone(), subnormal.clone()
    prescaled = prescale_checked_([normal, subnormal], 4, bucket_cap_bytes=4000)
    assert prescaled.nonfinite and len(prescaled.scaled) == 2
    prescaled.undo()
    assert torch.equal(normal, before[0])  # every normal value and infinity bitwise
    # Below 2**-126 * 4, a quotient that is not representable is rounded: off by at most 4 * 2**-150 after undo.
    assert not torch.equal(subnormal, before[1])
    assert float((subnormal.double() - before[1].double()).abs().max()) <= 4 * 2.0**-150

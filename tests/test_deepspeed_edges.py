"""hieravg_optim.deepspeed at its edges, on real DeepSpeed engines: 4 ranks as 2 replicas of 2 (CPU, gloo).

* Buffers (BatchNorm running statistics), ZeRO-1, 2 and 3: by default broadcast from rank 0 at
  initialisation and, at each averaging round (scheduled or ``average_now``), replaced by their
  exact mean over the level's whole block of ranks (every buffer set to its rank: 1.5 on all 4
  ranks); ``"average_buffers": false`` and ``initialize(average_buffers=False)`` keep them local.
* An empty parameter group with a client LR scheduler (a ``LambdaLR`` instance): ``ValueError`` on every
  rank before DeepSpeed is called, naming the group; with the scheduler as a callable, training
  works.
* ZeRO-3 with a forward that takes a different branch in each replica: trains (DeepSpeed's
  trace check runs within the replica).
* ``"nonfinite": "skip_replica"`` under ZeRO-0 with a NaN gradient in one replica: that replica gets
  the other's weights, and the NaN of its Adam moments are zeroed, so it is skipped once only.
* A rank whose model has another set of buffers: a ``RuntimeError`` on every rank at
  initialisation, naming the broadcast from the first replica, before any broadcast (not a hang or
  a backend error); whether the odd rank's peers in the other replica differ too or not.

All scenarios run in one spawn of 4 ranks.
"""

from __future__ import annotations

import pytest

from tests.harness import run_distributed, run_scenarios

deepspeed = pytest.importorskip("deepspeed")

WORLD = 4
S = 2  # ranks per replica

pytestmark = pytest.mark.timeout(600)


def _config(stage, section=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
    }
    if section is not None:
        cfg["hierarchical_averaging"] = section
    return cfg


def _bn_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _forward_backward(engine, rank, index):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + index)
    x = torch.randn(4, 8, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)


def _buffers(engine):
    return [b.detach().clone() for b in engine.module.buffers() if b.is_floating_point()]


def _set_buffers(engine, value):
    import torch

    with torch.no_grad():
        for b in engine.module.buffers():
            if b.is_floating_point():
                b.fill_(value)


def _buffers_case(rank, stage, section_key=None, argument=None):
    """Buffers after initialisation, after a scheduled round (count 0) and after average_now(-1)."""
    import torch
    import torch.distributed as dist

    import hieravg_optim.deepspeed as hds

    section = {"period_group_size": {"2": WORLD}, "ranks_per_replica": S}
    if section_key is not None:
        section["average_buffers"] = section_key
    model = _bn_model()
    with torch.no_grad():  # different statistics on every rank before initialize
        model[1].running_mean.fill_(10.0 + rank)
    engine, *_ = hds.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        config=_config(stage, section),
        average_buffers=argument,
    )
    after_init = [b[0].item() for b in _buffers(engine)[:1]]
    _forward_backward(engine, rank, 0)
    _set_buffers(engine, float(rank))  # rank-valued just before the round at count 0
    engine.step()  # count 0: averages
    scheduled = {b.unique().tolist().__repr__() for b in _buffers(engine)}
    _forward_backward(engine, rank, 1)
    engine.step()  # count 1: no averaging; each rank's forward moved its statistics
    moved = _buffers(engine)[0]
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, moved)
    differ_between_rounds = all(not everyone[0].equal(e) for e in everyone[1:])
    _set_buffers(engine, float(rank))
    engine.hierarchical_averaging.average_now(-1)
    now = {b.unique().tolist().__repr__() for b in _buffers(engine)}
    return {
        "after_init": after_init,
        "scheduled": sorted(scheduled),
        "average_now": sorted(now),
        "differ_between_rounds": differ_between_rounds,
    }


def _empty_group_case(rank, as_callable):
    """An empty parameter group with a client LambdaLR: an instance raises, a callable trains.

    Plain DeepSpeed drops the empty group from the optimizer only; the instance's first step in
    ``engine.step()`` then fails on its two base learning rates for one group.
    """
    import torch

    import hieravg_optim.deepspeed as hds

    model = _bn_model()
    groups = [{"params": list(model.parameters())}, {"params": []}]
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    if as_callable:
        scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)  # noqa: E731
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    section = {"period_group_size": {"2": WORLD}, "ranks_per_replica": S}
    try:
        engine, _, _, sched = hds.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=_config(2, section)
        )
    except ValueError as exc:
        return {"error": f"ValueError: {exc}"}
    for i in range(2):
        _forward_backward(engine, rank, i)
        engine.step()
    return {"error": None, "lr": [g["lr"] for g in engine.optimizer.param_groups], "count": engine.global_steps}


class _Branchy:
    """A model whose forward uses ``a`` in replica 0 and ``b`` in replica 1 (then ``head``)."""

    @staticmethod
    def build(replica):
        import torch

        class Branchy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(8, 8)
                self.b = torch.nn.Linear(8, 8)
                self.head = torch.nn.Linear(8, 4)

            def forward(self, x):
                branch = self.a if replica == 0 else self.b
                return self.head(torch.relu(branch(x)))

        torch.manual_seed(0)
        return Branchy()


def _zero3_branch_case(rank):
    """ZeRO-3, one branch per replica: three steps, averaging at count 1; every rank ends equal."""
    import torch
    import torch.distributed as dist

    import hieravg_optim.deepspeed as hds

    model = _Branchy.build(rank // S)
    section = {"period_group_size": {"2": WORLD}, "ranks_per_replica": S}
    engine, *_ = hds.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1), config=_config(3, section)
    )
    for i in range(3):
        _forward_backward(engine, rank, i)
        engine.step()
    engine.hierarchical_averaging.average_now(-1)
    from deepspeed import zero

    with zero.GatheredParameters(list(engine.module.parameters())):
        full = [p.detach().clone().float() for p in engine.module.parameters()]
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, full)
    return {
        "count": engine.hierarchical_averaging.step,
        "equal_everywhere": all(all(a.equal(b) for a, b in zip(gathered[0], g)) for g in gathered),
    }


def _nonfinite_skip_case(rank):
    """ZeRO-0, replicas {0, 1} and {2, 3}, one level of all 4 ranks at every step, ``"skip_replica"``: a NaN input
    on rank 3 at count 0 makes replica 1's gradients, Adam moments and weights NaN. Count 0 gives replica 1 replica
    0's weights; its moments' NaN are set to 0, so it is averaged in again from count 1 on."""
    import torch
    import torch.distributed as dist

    import hieravg_optim.deepspeed as hds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    section = {"period_group_size": {"1": WORLD}, "ranks_per_replica": S, "nonfinite": "skip_replica"}
    engine, *_ = hds.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), config=_config(0, section)
    )
    averager = engine.hierarchical_averaging.averager
    replaced, equal = [], []
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + i))
        if rank == 3 and i == 0:
            x[0, 0] = float("nan")
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        replaced.append(averager.replaced_at_step)
        weights = [p.detach().clone() for p in engine.module.parameters()]
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, weights)
        equal.append(all(all(a.equal(b) for a, b in zip(gathered[0], g)) for g in gathered))
    state = list(engine.optimizer.state.values())
    assert len(state) == 4, state  # Adam's moments of the 4 parameters: the check below is not vacuous
    return {
        "replaced": replaced,
        "equal": equal,
        "finite": all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()),
        "state_finite": all(bool(torch.isfinite(t).all()) for entry in state for t in entry.values()),
    }


def _other_buffers_case(rank, odd_ranks):
    """One more float buffer on the ranks ``odd_ranks``: initialize raises on every rank, naming the broadcast."""
    import torch

    import hieravg_optim.deepspeed as hds

    model = _bn_model()
    if rank in odd_ranks:
        model[1].register_buffer("extra", torch.ones(3))  # a buffer only: DeepSpeed's parameters stay the same
    section = {"period_group_size": {"2": WORLD}, "ranks_per_replica": S}
    try:
        hds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=_config(1, section))
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def _all_scenarios(rank, world_size):
    import torch

    torch.set_num_threads(1)
    return run_scenarios(
        {
            "buffers_zero1_default": lambda r: _buffers_case(r, 1),
            "buffers_zero3_default": lambda r: _buffers_case(r, 3),
            "buffers_zero2_key_false": lambda r: _buffers_case(r, 2, section_key=False),
            "buffers_zero1_argument_false": lambda r: _buffers_case(r, 1, argument=False),
            "empty_group_scheduler_instance": lambda r: _empty_group_case(r, as_callable=False),
            "empty_group_scheduler_callable": lambda r: _empty_group_case(r, as_callable=True),
            "zero3_branch_per_replica": _zero3_branch_case,
            "nonfinite_skip_zero0": _nonfinite_skip_case,
            # Rank 3 only: its shard group {1, 3} disagrees, and ranks 0 and 2 learn it in the world's agreement.
            "other_buffers_one_rank": lambda r: _other_buffers_case(r, {3}),
            # Ranks 1 and 3, the same shard index: their shard group agrees; the world's agreement does not.
            "other_buffers_one_shard": lambda r: _other_buffers_case(r, {1, 3}),
        },
        rank,
    )


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_scenarios, WORLD, timeout=400, pg_timeout=200)


@pytest.mark.parametrize("case", ["buffers_zero1_default", "buffers_zero3_default"])
def test_buffers_are_averaged_over_the_whole_block(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        # Broadcast from rank 0 at initialisation (rank 0 had 10.0), as DDP does.
        assert r["after_init"] == [10.0], (rank, r)
        # (0 + 1 + 2 + 3) / 4 on every rank, both at a scheduled round and with average_now.
        assert r["scheduled"] == ["[1.5]"], (rank, r)
        assert r["average_now"] == ["[1.5]"], (rank, r)
        assert r["differ_between_rounds"], (rank, r)  # else the rounds above prove nothing


@pytest.mark.parametrize("case", ["buffers_zero2_key_false", "buffers_zero1_argument_false"])
def test_buffers_stay_local_when_disabled(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        assert r["after_init"] == [10.0 + rank], (rank, r)
        assert r["scheduled"] == [f"[{float(rank)}]"], (rank, r)
        assert r["average_now"] == [f"[{float(rank)}]"], (rank, r)


def test_empty_group_with_client_scheduler_instance_raises_on_every_rank(results):
    for rank, per_rank in enumerate(results):
        error = per_rank["empty_group_scheduler_instance"]["error"]
        assert error is not None and error.startswith("ValueError"), (rank, error)
        assert "parameter group 1" in error and "no parameters" in error, error
        assert "lr_scheduler=lambda" in error, error


def test_empty_group_with_client_scheduler_callable_trains(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["empty_group_scheduler_callable"]
        assert r["error"] is None, (rank, r)
        assert r["count"] == 2, (rank, r)
        assert r["lr"] == [0.1 * 0.5**2], (rank, r)  # DeepSpeed stepped the scheduler twice


def test_zero3_branch_per_replica_trains(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["zero3_branch_per_replica"]
        assert r == {"count": 3, "equal_everywhere": True}, (rank, r)


def test_a_skipped_replica_gets_finite_weights_and_moments(results):
    for rank, per_rank in enumerate(results):
        r = per_rank["nonfinite_skip_zero0"]
        # Replica 1 is replaced at count 0 only (without the moments' repair: at every count).
        assert r["replaced"] == ([0, 0, 0] if rank >= S else [None] * 3), (rank, r)
        assert r == {**r, "equal": [True] * 3, "finite": True, "state_finite": True}, (rank, r)


def test_average_buffers_key_is_validated():
    from hieravg_optim.deepspeed import parse_section

    assert parse_section({"period_group_size": {"2": 4}}).average_buffers is True
    assert parse_section({"period_group_size": {"2": 4}, "average_buffers": False}).average_buffers is False
    with pytest.raises(ValueError, match=r'"average_buffers" must be true or false, got 1'):
        parse_section({"period_group_size": {"2": 4}, "average_buffers": 1})


@pytest.mark.parametrize("case", ["other_buffers_one_rank", "other_buffers_one_shard"])
def test_other_buffers_on_some_ranks_raise_on_every_rank(results, case):
    for rank, per_rank in enumerate(results):
        error = per_rank[case]["error"]
        assert error is not None and error.startswith("RuntimeError"), (rank, error)
        assert "the tensors broadcast from the first replica at construction" in error, (rank, error)
        assert "failed on rank" not in error and "Connection" not in error, (rank, error)  # not a backend error
        assert "((3,), 'float32')" in error, (rank, error)  # the odd buffer, named

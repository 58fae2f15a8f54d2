"""A delayed round under DDP's post-local SGD (4 gloo ranks, gradients all-reduced within nodes of 2).

While the round started at count 4 is in flight on its own background groups, DDP's backward all-reduces the
gradients over the node groups at counts 5 and 6: the two never share a process group. After the step at count 6
every rank's parameters are ``mean(theta_4) + (theta_6 - theta_4)``, ``theta`` gathered right before the round's
start and apply (allclose 1e-6: gloo chooses the order of the 4-rank sum).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import default_timeout, run_distributed

pytestmark = pytest.mark.timeout(default_timeout(200))


def _params(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hieravg_optim import HierarchicalAveragingOptimizer
    from hieravg_optim.ddp import register_post_local_sgd_hook

    node, _ = dist.new_subgroups(2)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)))
    opt = HierarchicalAveragingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), {4: world}, warmup_steps=1, delay_steps=2
    )
    register_post_local_sgd_hook(model, opt, node)
    delayed = opt.averager._delayed
    captured = {}
    original_start, original_apply = delayed.start, delayed.apply

    def start(*args, **kwargs):
        captured["start"] = _params(model)
        return original_start(*args, **kwargs)

    def apply(*args, **kwargs):
        captured["apply"] = _params(model)
        return original_apply(*args, **kwargs)

    delayed.start, delayed.apply = start, apply
    for count in range(7):
        g = torch.Generator().manual_seed(1000 * rank + count)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    snap = _gathered(captured["start"])
    expected = sum(snap) / world + (captured["apply"] - captured["start"])
    after = _params(model)
    torch.testing.assert_close(after, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(snap[0], snap[2]) and not torch.equal(captured["apply"], captured["start"])
    return opt.metrics()[4]["rounds_applied"]


def test_ddp_delayed_round_overlaps_the_gradient_all_reduce():
    assert run_distributed(_ddp, 4, timeout=150) == [1] * 4

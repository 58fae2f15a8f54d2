"""DDP with post-local SGD: torch's ``post_localSGD_hook`` driven by the wrapper's step count.

torch's recipe (``torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook``) has DDP
all-reduce gradients over the whole group for the first ``start_localSGD_iter`` iterations,
then only within a subgroup (a node), while the optimizer wrapper averages the parameters
across subgroups periodically (post-local SGD, https://arxiv.org/abs/1808.07217). The hook
counts iterations in its own ``PostLocalSGDState.iter``, which no optimizer checkpoint holds:
after a resume it starts again at 0, and DDP all-reduces globally again for
``start_localSGD_iter`` steps. :func:`register_post_local_sgd_hook` reads the count from the
wrapper instead, so a resume through any ``load_state_dict`` path is exact.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.nn.parallel import DistributedDataParallel

from .optimizer import HierarchicalAveragingOptimizer

__all__ = ["register_post_local_sgd_hook"]


def register_post_local_sgd_hook(
    model: DistributedDataParallel,
    optimizer: HierarchicalAveragingOptimizer,
    subgroup: dist.ProcessGroup,
) -> PostLocalSGDState:
    """Register torch's ``post_localSGD_hook`` on ``model``, its iteration tied to ``optimizer``'s count.

    The hook all-reduces the gradients over the optimizer's process group while the count is
    below ``optimizer``'s ``warmup_steps``, and within ``subgroup`` from then on, exactly as
    ``model.register_comm_hook(PostLocalSGDState(process_group, subgroup, start_localSGD_iter=
    warmup_steps), post_localSGD_hook)`` does, except that before each bucket the state's ``iter``
    is set to ``optimizer.averaging_step``. The warm-up of DDP and that of the averaging therefore
    always end at the same step, also after ``optimizer.load_state_dict`` (any path: DCP's
    ``set_optimizer_state_dict`` included) or an assignment to ``optimizer.averaging_step``.
    Gradient accumulation over several backward passes per step counts one iteration per step.

    Register it before the first forward (DDP's rule for comm hooks).

    Args:
        model: The DDP model the optimizer steps.
        optimizer: The wrapper over the DDP model's parameters.
        subgroup: This rank's subgroup for the post-warm-up all-reduce, e.g. its node from
            ``torch.distributed.new_subgroups(group_size=ranks_per_node)``.

    Returns:
        The hook's ``PostLocalSGDState`` (its ``iter`` follows the optimizer's count).

    Raises:
        TypeError: if ``model`` is not a ``DistributedDataParallel``, ``optimizer`` not a
            :class:`~hieravg_optim.HierarchicalAveragingOptimizer`, or ``subgroup`` not a process group.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"model must be a DistributedDataParallel, got {type(model).__name__}.")
    if not isinstance(optimizer, HierarchicalAveragingOptimizer):
        raise TypeError(
            f"optimizer must be a hieravg_optim.HierarchicalAveragingOptimizer, got {type(optimizer).__name__}."
        )
    if not isinstance(subgroup, dist.ProcessGroup):
        raise TypeError(
            f"subgroup must be a torch.distributed.ProcessGroup (e.g. the first value of "
            f"torch.distributed.new_subgroups(group_size=ranks_per_node)), got {type(subgroup).__name__}."
        )
    process_group = optimizer.averager.process_group
    state = PostLocalSGDState(
        process_group=None if process_group is dist.group.WORLD else process_group,
        subgroup=subgroup,
        start_localSGD_iter=optimizer.averager.warmup_steps,
    )
    state.iter = optimizer.averaging_step

    # No annotations: DDP checks them against dist.GradBucket, and this module's are strings.
    def hook(hook_state, bucket):  # noqa: ANN001, ANN202
        hook_state.iter = optimizer.averaging_step
        return post_localSGD_hook(hook_state, bucket)

    model.register_comm_hook(state, hook)
    return state

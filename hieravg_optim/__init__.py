"""hieravg_optim: hierarchical model averaging (hierarchical SGD) for torch optimizers.

See https://arxiv.org/abs/2010.12998 (hierarchical SGD) and https://arxiv.org/abs/1808.07217
(post-local SGD). The DeepSpeed and FSDP adapters live in :mod:`hieravg_optim.deepspeed`
and :mod:`hieravg_optim.fsdp`; this package never imports deepspeed itself.
"""

from .averager import HierarchicalAverager, LevelMetrics
from .config import AveragingConfig
from .optimizer import HierarchicalAveragingOptimizer
from .outer import nesterov_outer
from .schedule import AveragingLevel, level_at, rounds_per_level

__all__ = [
    "AveragingConfig",
    "AveragingLevel",
    "HierarchicalAverager",
    "HierarchicalAveragingOptimizer",
    "LevelMetrics",
    "level_at",
    "nesterov_outer",
    "rounds_per_level",
]

__version__ = "0.1.0"

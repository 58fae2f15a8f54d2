"""DeepSpeed adapter: hierarchical averaging set in the DeepSpeed JSON config, ZeRO 0-3.

:func:`initialize` is a drop-in for :func:`deepspeed.initialize`. It reads a top-level
``"hierarchical_averaging"`` section of the DeepSpeed config::

    "hierarchical_averaging": {
        "period_group_size": {"4": 4, "16": 8},
        "warmup_steps": 100,
        "ranks_per_replica": "auto",
        "bucket_cap_mb": 25,
        "average_buffers": true
    }

and then

* restricts DeepSpeed's data parallelism to *replicas*: blocks of ``ranks_per_replica``
  consecutive ranks (by default the ranks of one node). Within a replica DeepSpeed works
  as usual: gradients are reduced every step and ZeRO partitions the optimizer state,
  gradients and (stage 3) parameters among the replica's ranks. This is done with an
  ``mpu`` (model parallel unit) whose data-parallel group is the replica and whose model
  parallel groups are single ranks;
* after every optimizer step of the engine (every gradient-accumulation boundary, skipped
  fp16/bf16 overflow steps included), drives a :class:`~hieravg_optim.HierarchicalAverager`:
  when the schedule says so, each rank averages *its own fp32 master partition* with the
  ranks that hold the same partition in the other replicas of its group (the core's
  ``ranks_per_replica`` layout), then DeepSpeed's own routine copies the averaged master
  weights into the live low-precision / partitioned parameters.

Without the section (or with ``"enabled": false``, or without an optimizer) :func:`initialize` is
exactly :func:`deepspeed.initialize`. :func:`install` makes ``deepspeed.initialize`` itself this
:func:`initialize`, for the frameworks that call it (HF ``Trainer``, ``accelerate``, Lightning);
``python -m hieravg_optim.run SCRIPT ARGS...`` runs a script with it installed.

Hierarchical SGD: https://arxiv.org/abs/2010.12998; post-local SGD:
https://arxiv.org/abs/1808.07217. Written against DeepSpeed 0.19.8.

The modules: :mod:`~hieravg_optim.deepspeed.section` (the config section),
:mod:`~hieravg_optim.deepspeed.mpu` (the replica mpu), :mod:`~hieravg_optim.deepspeed.engine`
(the fp32 masters and the step), :mod:`~hieravg_optim.deepspeed.hooks` (the engine patches),
:mod:`~hieravg_optim.deepspeed.checkpoint` (per-replica checkpoint files),
:mod:`~hieravg_optim.deepspeed.initialize` (with :func:`install`). Inside this package,
``import deepspeed`` is DeepSpeed itself (absolute imports).
"""

from .checkpoint import CHECKPOINT_KEY, outer_state_file, replica_checkpoint_dir
from .engine import DeepSpeedAveraging
from .hooks import get_averaging
from .initialize import initialize, install, installed, uninstall
from .mpu import ReplicaParallelUnit
from .section import SECTION, SectionSettings, parse_section

__all__ = [
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
]

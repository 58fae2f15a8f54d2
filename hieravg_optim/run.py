"""``python -m hieravg_optim.run SCRIPT ARGS...``: run a training script with the DeepSpeed section honoured.

Calls :func:`hieravg_optim.deepspeed.install`, then runs ``SCRIPT`` as ``__main__``, the way
``python -m coverage run`` does: ``sys.argv`` is ``[SCRIPT, *ARGS]`` and ``sys.path[0]`` the
script's folder, as ``python SCRIPT ARGS...`` would set them (a ``--local_rank=N`` that the
``deepspeed`` launcher puts before ``SCRIPT`` goes right after it, where it puts it without
``--module``). No line of the script changes.
It also exports :data:`INSTALL_ENV` (``HIERAVG_DEEPSPEED_INSTALL=1``) to the script and the processes it
starts: a framework that starts the other ranks of a node itself, by re-running the script as
``python train.py`` (Lightning's own launcher), gives them the variable, and Lightning's ``Trainer`` then
installs the hook on those ranks too (:func:`hieravg_optim.lightning.callbacks_factory`, loaded through
Lightning's entry points in every ``Trainer`` constructor). Fabric loads no such entry point: with Fabric
starting the ranks, call :func:`~hieravg_optim.deepspeed.install` in the script.
It also shows this library's INFO records (the levels each averaging engine logs on rank 0) on
stderr, unless the ``hieravg_optim`` logger already has a handler. Launch lines::

    torchrun --nproc_per_node 4 -m hieravg_optim.run train.py --deepspeed ds_config.json
    deepspeed --num_gpus 4 --module hieravg_optim.run train.py --deepspeed ds_config.json
    accelerate launch --num_processes 4 -m hieravg_optim.run train.py

Needs the ``deepspeed`` extra.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

__all__ = ["INSTALL_ENV", "main"]

INSTALL_ENV = "HIERAVG_DEEPSPEED_INSTALL"
"""Set to ``"1"`` by the runner: a ``Trainer`` built under it calls :func:`hieravg_optim.deepspeed.install`."""

_USAGE = "usage: python -m hieravg_optim.run SCRIPT [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    """Install the DeepSpeed hook and run ``argv[0]`` as ``__main__`` with ``argv[1:]`` as its arguments.

    Args:
        argv: ``[SCRIPT, *ARGS]``; default ``sys.argv[1:]``.

    Raises:
        SystemExit: with status 2 and the usage, without a script or for one that does not exist;
            else whatever the script raises (its own ``SystemExit`` included).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # The deepspeed launcher's --module puts --local_rank=N before the script: it belongs to the script.
    local_rank = []
    while argv and argv[0].startswith(("--local_rank=", "--local-rank=")):
        local_rank.append(argv.pop(0))
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        print(f"{_USAGE}\nhieravg_optim.run: no such script: {script!r}", file=sys.stderr)
        raise SystemExit(2)
    import hieravg_optim.deepspeed

    _show_info_records()
    hieravg_optim.deepspeed.install()
    os.environ[INSTALL_ENV] = "1"  # for the ranks a framework's own launcher starts as `python SCRIPT`
    sys.argv = [script, *local_rank, *argv[1:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _show_info_records() -> None:
    """A stderr handler at INFO on the ``hieravg_optim`` logger, unless it has one (never the root logger)."""
    package = logging.getLogger("hieravg_optim")
    if package.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)


if __name__ == "__main__":
    main()

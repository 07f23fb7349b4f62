"""``olmo-train-torch``: train (or resume) an Olmo 3 model from a recipe with PyTorch.

One process (CPU, or one GPU)::

    uv run --frozen olmo-train-torch [RECIPE.yaml] [--train.steps=200 --optim.lr=6e-4 ...]
    uv run --frozen python -m olmo_train_torch [RECIPE.yaml] [--key=value ...]
    uv run --frozen olmo-train-torch RECIPE.yaml --print-recipe

Several processes on one machine (one per GPU; on CPU the gloo backend)::

    uv run --frozen torchrun --nproc-per-node 8 -m olmo_train_torch RECIPE.yaml --torch.parallel=fsdp

Several machines: see ``olmo_train_torch.parallelize``. Check a recipe at its target scale on this
machine (rank 0's memory for one step on COUNT GPUs of KIND, a fake process group; exit 1 when it
does not fit, ``olmo_train_torch.dry_run``)::

    uv run --frozen olmo-train-torch RECIPE.yaml --dry-run --devices h100:512 [--json]

Without a recipe the defaults run
(model "small", the embedded sample mixture, 100 steps of 16 x 512 tokens). A bad recipe,
spec, mixture or checkpoint prints one line to stderr (rank 0) and exits with status 2,
before the run dir is touched. A run that diverges (a non-finite loss or state, or too many
skipped steps in a row) stops with one line and status 3, before any checkpoint of the bad
state is written.
The options and the exit statuses, all of them, follow in ``--help`` (``olmo_run.cli``).
"""

from __future__ import annotations

import torch.distributed as dist

from olmo_run.cli import INPUT_ERRORS, run_cli

from .hf_adapter import CheckpointMismatchError
from .parallelize import env_rank
from .train import train


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _dry_run():
    # torch's FSDP2 memory trackers (torch.distributed._tools) take seconds to import: only for --dry-run.
    from .dry_run import dry_run

    return dry_run


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        "olmo-train-torch",
        __doc__,
        argv,
        lambda: train,
        (*INPUT_ERRORS, CheckpointMismatchError),
        reports=lambda: env_rank() == 0,
        cleanup=_leave_process_group,
        dry_run=_dry_run,
    )

"""``olmo-train-jax``: train an Olmo 3 model with JAX from a recipe.

    uv run --frozen olmo-train-jax [RECIPE.yaml] [--section.key=value ...]
    uv run --frozen olmo-train-jax --train.steps=30 --jax.mesh.fsdp=2 --jax.mesh.data=-1
    uv run --frozen olmo-train-jax RECIPE.yaml --print-recipe

Check a recipe at its target scale on this machine (the train step compiled ahead of time for
COUNT devices of KIND, the compiler's per-device memory; exit 1 when it does not fit,
``olmo_train_jax.dry_run``)::

    uv run --frozen olmo-train-jax RECIPE.yaml --dry-run --devices v5p:512 [--json]

Without a recipe it runs the defaults (model "small", the embedded sample mixture, 100 steps
of 16 x 512 tokens). A recipe, spec, data or checkpoint problem prints one line to stderr
and exits with status 2, before anything is written to the run dir. A run that diverges (a
non-finite loss or state, or too many skipped steps in a row) stops with one line and status
3, before any checkpoint of the bad state is written.
The options and the exit statuses, all of them, follow in ``--help`` (``olmo_run.cli``).
"""

from __future__ import annotations

from olmo_run.cli import INPUT_ERRORS, run_cli

from .hf_adapter import CheckpointMismatchError


def _train():
    from .train import train  # imports jax: after the recipe parsed, so a typo fails fast

    return train


def _dry_run():
    from .dry_run import dry_run  # imports jax and libtpu only for --dry-run

    return dry_run


def main(argv: list[str] | None = None) -> int:
    return run_cli("olmo-train-jax", __doc__, argv, _train, (*INPUT_ERRORS, CheckpointMismatchError), dry_run=_dry_run)

"""``olmo-train-jax``: train an Olmo 3 model with JAX from a recipe.

    uv run --frozen olmo-train-jax [RECIPE.yaml] [--section.key=value ...]
    uv run --frozen olmo-train-jax --train.steps=30 --jax.mesh.fsdp=2 --jax.mesh.data=-1

Without a recipe it runs the defaults (model "small", the embedded sample mixture, 100 steps
of 16 x 512 tokens). A recipe, spec, data or checkpoint problem prints one line to stderr
and exits with status 2, before anything is written to the run dir. A run that diverges (a
non-finite loss or state, or too many skipped steps in a row) stops with one line and status
3, before any checkpoint of the bad state is written.
"""

from __future__ import annotations

import sys

from olmo_data.errors import DataError
from olmo_model import SpecError, UnknownDeviceError
from olmo_model.recipe import RecipeError, load_recipe
from olmo_model.runlog import TrainingDivergedError, TrainingStateError

from .hf_adapter import CheckpointMismatchError

# Bad input, as opposed to a bug: reported in one line, exit status 2.
INPUT_ERRORS = (RecipeError, SpecError, DataError, TrainingStateError, UnknownDeviceError, CheckpointMismatchError)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    path = args.pop(0) if args and not args[0].startswith("--") else None
    try:
        recipe = load_recipe(path, args)
        from .train import train  # imports jax: after the recipe parsed, so a typo fails fast

        train(recipe)
    except INPUT_ERRORS as err:
        print(f"olmo-train-jax: error: {err}", file=sys.stderr)
        return 2
    except TrainingDivergedError as err:
        print(f"olmo-train-jax: stopped: {err}", file=sys.stderr)
        return 3
    return 0

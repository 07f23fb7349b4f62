"""Where the run's metrics go besides ``metrics.jsonl``: the experiment trackers a recipe selects
with ``log.sinks`` (OLMo-core's callbacks and torchtitan's metric loggers have the same two).

Every sink gets the same records the driver writes to ``metrics.jsonl``, on process 0 only:

- ``tensorboard``: event files under ``<run dir>/tensorboard`` (tensorboardX, no torch or
  TensorFlow needed). Scalars are ``train/<key>`` at the optimizer step, and
  ``eval/<source>/<key>`` for each held-out source; a resumed run appends a new event file and
  TensorBoard merges them by step.
- ``wandb``: a Weights & Biases run named by the recipe (``log.wandb``); ``mode: offline`` writes
  under ``<run dir>/wandb`` with no network (``wandb sync`` uploads it later). The recipe goes
  in as the run config; a resumed run continues the same W&B run id, kept in the run dir.

The numeric values of a record are what a sink receives; strings (the peak's label, the memory
kind) and booleans become config or are left to ``metrics.jsonl``, which stays the complete record.
A sink whose package is missing fails at start-up with the extra to install, before any step.
"""

from __future__ import annotations

import math
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from olmo_run.recipe import Recipe, RecipeError

SINK_EXTRAS = {"tensorboard": ("tensorboardX", "olmo-run[tensorboard]"), "wandb": ("wandb", "olmo-run[wandb]")}
WANDB_ID_FILE = "wandb_run_id"  # in the run dir: the W&B run a resume continues


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(step, {tag: value}) for a metrics record: ``train/<key>`` for a train line,
    ``eval/<source>/<key>`` for an eval line; booleans, strings and non-finite values are left out
    (a tracker's chart of a NaN loss is drawn from metrics.jsonl's stop message instead)."""
    step = int(record["step"])
    kind = record.get("kind")
    out: dict[str, float] = {}
    if kind == "train":
        items = [(f"train/{k}", v) for k, v in record.items() if k not in ("kind", "step")]
    elif kind == "eval":
        items = [(f"eval/{src}/{k}", v) for src, vals in record["eval"].items() for k, v in vals.items()]
    else:
        return step, out
    for tag, value in items:
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[tag] = float(value)
    return step, out


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        step, values = scalars(record)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, recipe: Recipe):
        import wandb

        cfg = recipe.log.wandb
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        os.environ.setdefault("WANDB_SILENT", "true")  # its banner would interleave with the console
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or recipe.name,
            group=cfg.group,
            tags=list(cfg.tags) or None,
            mode=cfg.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=recipe.model_dump(mode="json"),
        )
        id_file.write_text(run_id + "\n")

    def write(self, record: dict[str, Any]) -> None:
        step, values = scalars(record)
        if values:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def check_sinks(recipe: Recipe) -> None:
    """Refuse (one line) a sink whose package is not installed, before anything is written."""
    import importlib.util

    for name in recipe.log.sinks:
        module, extra = SINK_EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            raise RecipeError(f"log.sinks: {name!r} needs the {module} package; install {extra}, or drop {name!r}")


def open_sinks(recipe: Recipe, run_dir: Path, enabled: bool) -> list[Sink]:
    """The recipe's sinks on process 0 (none elsewhere)."""
    if not enabled:
        return []
    check_sinks(recipe)
    out: list[Sink] = []
    for name in recipe.log.sinks:
        out.append(TensorBoardSink(run_dir) if name == "tensorboard" else WandbSink(run_dir, recipe))
    return out

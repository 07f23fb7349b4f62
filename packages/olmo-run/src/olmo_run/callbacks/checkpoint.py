"""Checkpoints every ``checkpoint.every`` steps and at the last step (``Run.save``: the state
checked finite, the module's save, the metrics log flushed with it)."""

from __future__ import annotations

from ..loop import Callback, Run, Step


class Checkpoint(Callback):
    order = 30

    def after_step(self, run: Run, step: Step) -> None:
        if step.number % run.recipe.checkpoint.every == 0 or step.number == run.total_steps:
            run.save(step.number)

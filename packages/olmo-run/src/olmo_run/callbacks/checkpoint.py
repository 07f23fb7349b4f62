"""Checkpoints every ``checkpoint.every`` steps and at the last step (``Run.save``: the state
checked finite, the module's save, the metrics log flushed with it)."""

from __future__ import annotations

from ..loop import Callback, Run, Step


class Checkpoint(Callback):
    order = 30

    def reads(self, run: Run, number: int) -> bool:
        return number % run.recipe.checkpoint.every == 0 or number == run.total_steps

    def after_step(self, run: Run, step: Step) -> None:
        if self.reads(run, step.number):
            run.save(step.number)

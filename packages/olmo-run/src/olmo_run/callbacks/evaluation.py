"""Held-out evaluation every ``eval.every`` steps and at the last step (``measure.evaluate``
over the module's eval step): one "eval" record and a console line. A run resumed at a step
that was due an evaluation and lacks its line (stopped between that checkpoint and its eval)
evaluates it first, so no point of the held-out curve is lost; the final one included."""

from __future__ import annotations

from ..loop import Callback, Run, Step
from ..measure import evaluate
from ..metrics import eval_logged


class Evaluation(Callback):
    order = 50

    def on_start(self, run: Run) -> None:
        if pending(run, run.setup.start_step):
            self.evaluate(run, run.setup.start_step)

    def reads(self, run: Run, number: int) -> bool:
        """A state is evaluated only once its steps are read (a non-finite one stops first)."""
        return due(run, number) and bool(run.setup.mixture.held_out_sources)

    def after_step(self, run: Run, step: Step) -> None:
        if due(run, step.number):
            self.evaluate(run, step.number)

    def evaluate(self, run: Run, step: int) -> None:
        setup = run.setup
        if not setup.mixture.held_out_sources:
            return
        result = evaluate(run.module.eval_sums, setup.loader, run.recipe.eval.batch_size)
        allowed = {"leakage_allowed": True} if run.recipe.data.allow_leakage else {}
        run.write({"kind": "eval", "step": step, "eval": result, **allowed})
        run.console.line(
            f"eval step {step}: "
            + ", ".join(f"{k} loss {v['loss']:.4f} ppl {v['perplexity']:.2f}" for k, v in result.items())
        )


def due(run: Run, step: int) -> bool:
    return step % run.recipe.eval.every == 0 or step == run.total_steps


def pending(run: Run, step: int) -> bool:
    """Whether the resumed-at ``step`` was due an evaluation that the run dir lacks."""
    if step == 0 or not run.setup.mixture.held_out_sources:
        return False
    return due(run, step) and not eval_logged(run.setup.run_dir, step)

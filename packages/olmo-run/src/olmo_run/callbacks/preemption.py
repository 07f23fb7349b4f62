"""The preemption check (``olmo_run.preempt``): after a step in which this or any process saw
SIGTERM / SIGINT, that step is checkpointed (unless the cadence just did) and the run stops
with ``Preempted``; its eval, if one was due, runs when the run resumes there. Placed after
``Checkpoint`` and before ``Evaluation``."""

from __future__ import annotations

from ..loop import Callback, Run, Step
from ..preempt import Preempted


class PreemptionCheck(Callback):
    order = 40

    def after_step(self, run: Run, step: Step) -> None:
        stop = requested(run, step.number)
        if stop:
            run.save(step.number)
            raise Preempted(stop, step.number, str(run.checkpoint_path(step.number)))


def requested(run: Run, step: int) -> str:
    """The signal that stops the run after ``step`` ("" for none), the same on every process:
    one process's flag stops them all. With several processes they agree by a gather every
    ``checkpoint.preempt_check_every`` steps (and at the last step); one process needs none."""
    local = (run.watch.signal_name if run.watch is not None else None) or ""
    if run.n_processes == 1:
        return local
    every = run.recipe.checkpoint.preempt_check_every
    if step % every != 0 and step != run.total_steps:
        return ""
    return next((name for name in run.module.all_gather_text(local) if name), "")

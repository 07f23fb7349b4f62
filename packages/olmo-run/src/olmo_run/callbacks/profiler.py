"""The profiler trace of ``profile.steps`` steps from ``profile.start_step``: the module's
profiler starts before the first traced step and stops after the last one (or when the loop
raises inside them, keeping what was traced), writing under RUN/profile/steps_A-B (uploaded
for a URL run dir)."""

from __future__ import annotations

from ..loop import Callback, Run
from ..run_dir import local_copy


class ProfilerTrace(Callback):
    order = 10

    def __init__(self) -> None:
        self.tracing = False

    def before_step(self, run: Run, step: int) -> None:
        """Start the profiler at ``profile.start_step``; stop it after the last traced step
        (``step`` is then the one after it, or total + 1 at the loop's end)."""
        p = run.recipe.profile
        if p.start_step is None:
            return
        last = min(p.start_step + p.steps - 1, run.total_steps)
        if step == p.start_step and not self.tracing and step <= last:
            folder = local_copy(run.setup.run_dir) / "profile" / f"steps_{p.start_step}-{last}"
            folder.mkdir(parents=True, exist_ok=True)
            run.module.start_trace(folder)
            self.tracing = True
            run.console.line(f"profiling steps {p.start_step}-{last} into {folder}")
        elif self.tracing and step > last:
            self.stop(run)

    def on_end(self, run: Run) -> None:
        self.before_step(run, run.total_steps + 1)

    def close(self, run: Run) -> None:
        if self.tracing:  # the loop raised inside the traced steps: keep what was traced
            self.stop(run)

    def stop(self, run: Run) -> None:
        run.module.stop_trace()
        self.tracing = False
        run.upload_local("profile")

"""The run-dir lock's heartbeat from the loop (``olmo_run.lock``: a write at most every
``lock.HEARTBEAT_S``; its thread covers restoring and compiling, before the first step)."""

from __future__ import annotations

from ..loop import Callback, Run, Step


class LockHeartbeat(Callback):
    order = 60

    def after_step(self, run: Run, step: Step) -> None:
        if run.lock is not None:
            run.lock.refresh()

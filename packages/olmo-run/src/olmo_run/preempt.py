"""Preemption: SIGTERM (what Slurm, Kubernetes and TPU maintenance send before a kill) and
SIGINT (Ctrl-C) end a run with its work saved, not lost.

- The first signal only raises a flag (``PreemptionWatch.signal_name``). The driver loop lets
  the step in flight finish, then the processes agree on the step to stop at (any process's
  flag stops all of them at the same step: ``olmo_run.callbacks.preemption``), save and
  commit a checkpoint there unless the cadence just did, release the run-dir lock, and the CLI
  prints one line and exits with ``EXIT_PREEMPTED``. Rerunning the same command resumes from it.
- A second signal, or ``checkpoint.preempt_timeout_s`` seconds after the first without the run
  having ended, exits at once: one line on stderr, the run-dir lock released (best effort), exit
  status 128 + the signal number (143 for SIGTERM, 130 for SIGINT), as a process killed by it.
  The newest committed checkpoint stays the latest (a save cut short has no meta.json).

Handlers are installed only from the main thread (Python delivers signals there) and restored
when the run ends, so a library caller's own handlers come back.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

# The CLIs' exit status for a run stopped by a signal with its checkpoint committed
# (0 finished, 2 bad input, 3 diverged; see olmo_run.cli).
EXIT_PREEMPTED = 4
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped at ``step`` because of ``signal_name``, its checkpoint committed."""

    def __init__(self, signal_name: str, step: int, checkpoint: str):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(
            f"{signal_name} received: stopped after step {step} with its checkpoint committed ({checkpoint}); "
            "rerun the same command to resume"
        )


class PreemptionWatch:
    """Installs the handlers for the duration of a ``with`` block. ``abort`` (releasing the
    run-dir lock) runs before an exit at once; ``timeout_s`` counts from the first signal."""

    def __init__(self, prog: str, timeout_s: float, abort: Callable[[], None] | None = None):
        self.prog, self.timeout_s, self.abort = prog, timeout_s, abort
        self.signal_name: str | None = None
        self._signum = 0
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            self.exit_now(f"second signal ({name}) while stopping")
        self.signal_name, self._signum = name, signum  # the CLI's one line comes at the end
        self._timer = threading.Timer(self.timeout_s, self.exit_now, (f"no end {self.timeout_s:g} s after {name}",))
        self._timer.daemon = True
        self._timer.start()

    def exit_now(self, why: str) -> None:
        """Leave at once (a second signal, the timeout): no checkpoint beyond the committed ones.
        Its line is printed, not logged: in a signal handler, the thread it interrupted may hold
        logging's locks."""
        print(
            f"{self.prog}: {why}: exiting at once without a new checkpoint; the newest committed one is kept",
            file=sys.stderr,
            flush=True,
        )
        if self.abort is not None:
            # In a thread with a bound wait: the main thread may hold the lock's own mutex.
            releaser = threading.Thread(target=self.abort, daemon=True)
            releaser.start()
            releaser.join(timeout=5)
        os._exit(128 + self._signum)

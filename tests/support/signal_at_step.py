"""Test-only hook for the preemption tests: the process sends itself a signal while step N is in
flight, as a scheduler's SIGTERM would arrive (only the process of rank ``rank``, so that a
multi-process test shows the others stop at the same step). The trainers carry no such hook;
this wraps the loop's call into the trainer's step."""

from __future__ import annotations

import os
import signal


def install(step: int, signum: int = signal.SIGTERM, rank: int = 0) -> None:
    """From now on, a run's ``module.train_step`` for ``step`` first signals this process."""
    from olmo_run import loop

    if int(os.environ.get("RANK", "0")) != rank:
        return
    init = loop.Run.__init__

    def wrapped_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        train_step = self.module.train_step

        def signalled_step(batch, at, lr, guard, metrics):
            if at == step:
                os.kill(os.getpid(), signum)  # handled at once: the step below is the one in flight
            return train_step(batch, at, lr, guard, metrics)

        self.module.train_step = signalled_step

    loop.Run.__init__ = wrapped_init

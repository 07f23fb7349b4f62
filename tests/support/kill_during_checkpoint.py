"""Test-only entry point: a trainer's CLI that SIGKILLs its own process while the step-N
checkpoint is being written: after the framework wrote (and, for a URL run dir, uploaded)
every file of it, before meta.json commits it, the last moment a crash can leave a
checkpoint that looks whole but is not. The trainers carry no such hook; this wraps their
checkpointers' commit call.

    python tests/support/kill_during_checkpoint.py {jax|torch} N [RECIPE.yaml] [--key=value ...]
"""

from __future__ import annotations

import importlib
import os
import signal
import sys


def install(framework: str, kill_step: int) -> None:
    """Make this process SIGKILL itself right before the step-``kill_step`` checkpoint commits."""
    checkpoint = importlib.import_module(f"olmo_train_{framework}.checkpoint")
    commit = checkpoint.commit_checkpoint

    def kill_before_commit(ckpt, meta):
        if meta["step"] == kill_step:
            print(f"kill_during_checkpoint: SIGKILL before committing step {kill_step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        commit(ckpt, meta)

    checkpoint.commit_checkpoint = kill_before_commit


def main() -> int:
    framework, kill_step, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    install(framework, kill_step)
    return importlib.import_module(f"olmo_train_{framework}.cli").main(args)


if __name__ == "__main__":
    sys.exit(main())

"""Test-only entry point for crash-resume tests: a trainer's CLI that SIGKILLs its own process
right after the step-N checkpoint is committed (and pruned), as a host failure would, with no
chance to clean up. The trainers carry no such hook; this wraps their checkpointers' prune
call, which follows every commit.

    python tests/support/kill_after_checkpoint.py {jax|torch} N [RECIPE.yaml] [--key=value ...]
    torchrun --nproc-per-node 2 --standalone tests/support/kill_after_checkpoint.py torch N ...
"""

from __future__ import annotations

import importlib
import os
import signal
import sys


def install(framework: str, kill_step: int) -> None:
    """Make this process SIGKILL itself right after the step-``kill_step`` checkpoint commits."""
    checkpoint = importlib.import_module(f"olmo_train_{framework}.checkpoint")
    prune = checkpoint.prune_checkpoints

    def prune_then_kill(run_dir, keep, committed=None, **kwargs):
        prune(run_dir, keep, committed=committed, **kwargs)
        if committed == kill_step:
            print(f"kill_after_checkpoint: SIGKILL after the step-{kill_step} checkpoint", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.prune_checkpoints = prune_then_kill


def main() -> int:
    framework, kill_step, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    install(framework, kill_step)
    return importlib.import_module(f"olmo_train_{framework}.cli").main(args)


if __name__ == "__main__":
    sys.exit(main())

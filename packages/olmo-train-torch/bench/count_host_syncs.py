"""Host synchronisations per training step of the torch trainer, counted by trapping every
tensor-to-host read torch exposes to Python.

    uv run --frozen python packages/olmo-train-torch/bench/count_host_syncs.py [--steps 6] [--json]

Runs the real trainer in this process (``olmo_train_torch.cli.main``: driver, loop, callbacks,
module) on the embedded sample mixture, one process, fp32, for a dense model (``tiny``) and an
MoE model (``tiny-moe``), with ``log.every`` = the step count, so every step but the last is a
non-log step (checkpoint and eval only at the end). ``torch.Tensor.item``, ``tolist``, ``cpu``,
``numpy``, ``__bool__``, ``__float__``, ``__int__`` and ``__index__`` are wrapped to count their
calls, each call attributed to the step being trained (from the start of its ``train_step`` to
the start of the next: its callbacks included). Printed: the calls of a non-log step (the
median over steps 2 .. N-1; step 1 also holds one-off start-up work) and of the final, logged
step, by kind; the host reads counted leave out torch.optim's reads of the host tensors in which
AdamW keeps its step counts (the foreach path's; no sync). A read that torch's C++ does without Python (a boolean mask's nonzero, say) is
not seen here; on CUDA ``torch.cuda.set_sync_debug_mode`` sees those too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from olmo_train_torch.cli import main
from olmo_train_torch.train import TorchTrainModule

TRAPPED = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def kind(name: str, tensor: torch.Tensor) -> str:
    """The call's kind; AdamW's step counts apart: torch keeps them on the host when the update
    is not fused or capturable (the CPU's foreach path), so reading them costs no sync."""
    caller = sys._getframe(2).f_code.co_filename
    if tensor.device.type == "cpu" and tensor.dim() == 0 and f"torch{os.sep}optim{os.sep}" in caller:
        return f"{name} of torch.optim's host step count (no sync)"
    return name


def count_run(model: str, steps: int, run_dir: Path) -> dict[int, Counter]:
    """{step: Counter of trapped calls by kind} of one run of ``model``."""
    calls: dict[int, Counter] = {}
    current = [0]
    originals = {name: getattr(torch.Tensor, name) for name in TRAPPED}

    def counting(name):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            calls.setdefault(current[0], Counter())[kind(name, self)] += 1
            return original(self, *args, **kwargs)

        return wrapper

    step = TorchTrainModule.train_step

    def marked_step(self, *args, **kwargs):
        current[0] = args[1]
        return step(self, *args, **kwargs)

    TorchTrainModule.train_step = marked_step  # type: ignore[method-assign]
    for name in TRAPPED:
        setattr(torch.Tensor, name, counting(name))
    try:
        main(
            [
                f"--model={model}",
                "--train.sequence_length=64",
                "--train.global_batch_tokens=512",
                f"--train.steps={steps}",
                "--train.precision=fp32",
                f"--log.every={steps}",
                f"--checkpoint.every={steps}",
                f"--eval.every={steps}",
                "--log.progress=false",
                "--torch.parallel=none",
                f"--run_dir={run_dir}",
            ]
        )
    finally:
        TorchTrainModule.train_step = step  # type: ignore[method-assign]
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return calls


def syncs(counts: Counter) -> int:
    return sum(n for k, n in counts.items() if "no sync" not in k)


def summary(calls: dict[int, Counter], steps: int) -> dict[str, object]:
    middle = [syncs(calls.get(s, Counter())) for s in range(2, steps)]
    return {
        "non_log_step": statistics.median(middle),
        "non_log_step_by_kind": dict(calls.get(steps - 1, Counter())),
        "log_step": syncs(calls.get(steps, Counter())),
        "log_step_by_kind": dict(calls.get(steps, Counter())),
    }


def run(steps: int) -> dict[str, dict[str, object]]:
    out = {}
    for model in ("tiny", "tiny-moe"):
        with tempfile.TemporaryDirectory() as tmp:
            out[model] = summary(count_run(model, steps, Path(tmp) / "run"), steps)
    return out


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.steps)
    if args.json:
        print(json.dumps(result))
        return
    for model, s in result.items():
        print(f"{model}: non-log step: {s['non_log_step']} host reads; all calls {s['non_log_step_by_kind']}")
        print(f"{model}: log step: {s['log_step']} host reads; all calls {s['log_step_by_kind']}")


if __name__ == "__main__":
    cli()

"""A run-dir write that fails mid-run (a full disk) through the shared command line: one line on
stderr naming the file and "No space left on device", exit status 5, nothing logged after it,
and a rerun without the fault resumes from the last committed checkpoint.

The trainer is a stand-in whose "weights" are one number (its checkpoint is meta.json alone);
the disk fills under ``metrics.jsonl`` at step 3 by turning the file into a link to
``/dev/full``, where every write fails with ENOSPC from the kernel. Both trainers' failed
checkpoint writes go through the same exit path (their own tests/test_save_failure.py).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from olmo_run import StepMetrics, read_inputs, resolve_run, run
from olmo_run.checkpoints import checkpoint_dir, commit_checkpoint, complete_checkpoints
from olmo_run.cli import EXIT_WRITE_FAILED, INPUT_ERRORS, run_cli
from olmo_run.metrics import read_metrics
from olmo_run.spike_guard import SpikeGuard
from olmo_run.write_failure import os_error_code

FULL_AT = 3
ARGS = [
    "--model=tiny",
    "--train.sequence_length=32",
    "--train.global_batch_tokens=128",
    "--train.steps=6",
    "--checkpoint.every=2",
    "--eval.every=1000",
    "--log.progress=false",
    "--data.prefetch=0",
]


class OneNumber:
    """A trainer whose state is one number that each step lowers by the LR; saved synchronously."""

    framework = "numpy"
    n_devices = 1

    def __init__(self, plan, on_step):
        self.plan, self.on_step = plan, on_step
        self.weight = plan.resume[2]["weight"] if plan.resume is not None else 1.0

    def train_step(self, batch: dict, step: int, lr: float, guard: SpikeGuard, metrics: StepMetrics) -> None:
        self.on_step(self.plan.run_dir, step)
        self.weight -= lr
        for name, value in (("loss", self.weight), ("ce_loss", self.weight), ("z_loss", 0.0), ("grad_norm", 1.0)):
            metrics.record(name, value)
        metrics.record("skipped", False)

    def save(self, step: int, meta: dict[str, Any]) -> None:
        ckpt = checkpoint_dir(self.plan.run_dir, step)
        ckpt.mkdir(parents=True)
        commit_checkpoint(ckpt, meta)

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"weight": self.weight}

    def state_is_finite(self) -> bool:
        return True

    def eval_sums(self, batch: dict) -> tuple[float, float]:
        return 0.0, 0.0

    def poll(self) -> None:
        pass

    def device_memory(self) -> None:
        return None

    def device_kind(self) -> None:
        return None

    def matmul(self, size: int):
        a = np.ones((size, size), np.float32)
        return lambda: a @ a

    def start_trace(self, folder: Path) -> None:
        pass

    def stop_trace(self) -> None:
        pass

    def close(self) -> None:
        pass

    def all_gather_text(self, text: str) -> list[str]:
        return [text]

    def to_host(self, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return values  # host values already


def cli(argv: list[str], on_step=lambda run_dir, step: None) -> int:
    def train(recipe):
        plan = resolve_run(read_inputs(recipe), "numpy")
        return run(plan, lambda: OneNumber(plan, on_step), is_main=True, describe=[], title="olmo-test")

    return run_cli("olmo-test", None, argv, lambda: train, INPUT_ERRORS)


def train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_the_metrics_log_stops_the_run_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = [*ARGS, f"--run_dir={run_dir}"]
    kept: list[str] = []

    def fill_the_disk(run_dir: Path, step: int) -> None:
        if step == FULL_AT:
            log = run_dir / "metrics.jsonl"
            kept.append(log.read_text())
            log.unlink()
            log.symlink_to("/dev/full")

    capsys.readouterr()
    assert cli(args, fill_the_disk) == EXIT_WRITE_FAILED == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"olmo-test: error: appending to {run_dir / 'metrics.jsonl'} failed: "), err[0]
    assert "No space left on device" in err[0] and "step_00000002 stays the latest checkpoint" in err[0], err[0]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2]  # no save after the failed append

    (run_dir / "metrics.jsonl").unlink()  # room again: the file as it was before the disk filled
    (run_dir / "metrics.jsonl").write_text(kept[0])
    assert train_steps(run_dir) == [1, 2]
    assert cli(args) == 0
    assert f"resumed from {checkpoint_dir(run_dir, 2)} at step 2" in capsys.readouterr().out
    assert train_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2, 4, 6]


def test_the_errno_is_found_behind_wrapping_errors():
    def raised(make):
        try:
            make()
        except Exception as err:
            return err
        raise AssertionError("nothing raised")

    def wrapped_by_cause():
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("unexpected pos 704 vs 598") from err

    def wrapped_by_context():
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("writing failed")  # its __context__: the OSError

    assert os_error_code(raised(wrapped_by_cause)) == errno.ENOSPC
    assert os_error_code(raised(wrapped_by_context)) == errno.EDQUOT
    # TensorStore's error, as Orbax raises it on a full disk: the errno only in its text.
    tensorstore = ValueError("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']")
    assert os_error_code(RuntimeError("save failed"), tensorstore) == errno.ENOSPC
    assert os_error_code(ValueError("shapes differ"), KeyError("params")) is None

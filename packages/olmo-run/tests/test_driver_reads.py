"""Where the driver reads a module's figures (issue 36): test_driver.py's numpy module, 6 steps,
``log.every`` 5, a checkpoint at step 4, evaluation only at the end, so reads are due at steps
4 (checkpoint), 5 (log) and 6 (last) and steps 1-3 are read with step 4, in one transfer.

The run's guarantees hold at the reads: a non-finite loss at step 2 without the guard stops the
run at the step-4 read with the step-2 line, before the step-4 checkpoint; with the guard (which
skips a non-finite step whatever its history), two skips in a row past
``max_consecutive_skips`` 1 stop it the same way; a single skipped step
without a train line gets a console line, and the step-4 checkpoint's guard history holds the
accepted steps only."""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path

import pytest

from olmo_run.checkpoints import checkpoint_dir, complete_checkpoints
from olmo_run.errors import TrainingDivergedError
from olmo_run.metrics import read_metrics

# test_driver.py's numpy module, mixture and recipe (importlib mode puts no test folder on sys.path).
_spec = importlib.util.spec_from_file_location("olmo_run_test_driver", Path(__file__).with_name("test_driver.py"))
assert _spec is not None and _spec.loader is not None
driver_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver_tests)

CADENCE = ["--log.every=5", "--checkpoint.every=4", "--eval.every=100"]


class Spiky(driver_tests.NumpyModule):
    """The numpy module with a chosen loss at some steps; notes how many steps each read held."""

    losses: dict[int, float] = {}
    reads: list[int] = []
    device_seconds = 0.0  # what a read waits for a device still running the steps it reads

    def train_step(self, batch, step, lr, guard, metrics) -> None:
        super().train_step(batch, step, lr, guard, metrics)
        if step in self.losses:
            metrics.record("loss", self.losses[step])
            metrics.record("skipped", guard.should_skip(self.losses[step], 1.0))

    def to_host(self, values):
        self.reads.append(len(values))
        time.sleep(self.device_seconds * len(values))
        return super().to_host(values)


def go(mixture: Path, run_dir: Path, losses: dict[int, float], *extra: str, device_seconds: float = 0.0) -> list[str]:
    Spiky.losses, Spiky.reads, Spiky.device_seconds = losses, [], device_seconds
    calls: list[str] = []
    recipe = driver_tests.recipe_for(mixture, run_dir, *CADENCE, *extra)
    plan = driver_tests.resolve_run(driver_tests.read_inputs(recipe), "numpy", loader_ranks=(0, 1), dp_size=2)
    driver_tests.run(plan, lambda: Spiky(plan, calls), is_main=True, describe=[], title="test")
    return calls


@pytest.fixture(autouse=True)
def test_peak(monkeypatch):
    from olmo_run import loop

    monkeypatch.setattr(loop, "device_peak", lambda kind, matmul: (1e12, "test peak"))


@pytest.fixture
def mixture(tmp_path) -> Path:
    (tmp_path / "mix").mkdir()
    return driver_tests.write_mixture(tmp_path / "mix")


def test_steps_are_read_at_checkpoint_log_and_last_steps_only(mixture, tmp_path):
    go(mixture, tmp_path / "run", {})
    assert Spiky.reads == [4, 1, 1]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"] == [5, 6]


def test_the_steps_read_together_share_the_wait_for_the_device(mixture, tmp_path):
    """A device 0.2 s behind per step: the step-5 line (steps 1-5 read at once, no checkpoint
    before) and the step-6 line each carry at least 0.2 s, not the host's dispatch time alone."""
    go(mixture, tmp_path / "run", {}, "--checkpoint.every=100", device_seconds=0.2)
    assert Spiky.reads == [5, 1]
    lines = {r["step"]: r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"}
    assert lines[5]["step_time"] >= 0.2 and lines[6]["step_time"] >= 0.2


def test_a_non_finite_loss_between_reads_stops_the_run_before_the_next_checkpoint(mixture, tmp_path):
    with pytest.raises(TrainingDivergedError, match=r"^step 2: loss nan / grad norm 1.0 is not finite"):
        go(mixture, tmp_path / "run", {2: math.nan})
    assert Spiky.reads == [4]  # found at the step-4 read, the first after it
    assert complete_checkpoints(tmp_path / "run") == []


def test_too_many_skips_between_reads_stop_the_run_at_the_read(mixture, tmp_path):
    guard = ["--spike_guard.enabled=true", "--spike_guard.max_consecutive_skips=1"]
    with pytest.raises(TrainingDivergedError, match=r"^step 3: the spike guard skipped 2 steps in a row"):
        go(mixture, tmp_path / "run", {2: math.nan, 3: math.nan}, *guard)
    assert complete_checkpoints(tmp_path / "run") == []


def test_a_skipped_step_without_a_train_line_gets_a_console_line(mixture, tmp_path, capsys):
    calls = go(mixture, tmp_path / "run", {2: math.nan}, "--spike_guard.enabled=true")
    assert "save 4" in calls
    assert "step 2: skipped by the spike guard (loss nan, grad norm 1.000)" in capsys.readouterr().out
    meta = json.loads((checkpoint_dir(tmp_path / "run", 4) / "meta.json").read_text())
    assert meta["spike_guard"]["losses"] == [7.9, 7.7, 7.6]  # steps 1, 3 and 4: 8 - step / 10
    assert meta["spike_guard"]["consecutive_skips"] == 0

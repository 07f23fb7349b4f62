"""The loop's extension points with test_driver.py's numpy module: the default cadenced jobs and
their order, a job of one's own (every hook, a metric recorded by name on the train line), and
where olmo_run's log lines reach the terminal."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest

from olmo_run import read_inputs, resolve_run, run
from olmo_run.callbacks import default_callbacks
from olmo_run.loop import Callback, Run, Step
from olmo_run.metrics import TRAIN_KEYS
from olmo_run.terminal import SUMMARY_LOGGER, CurrentStream, show_on_terminal

# test_driver.py's numpy module, mixture and recipe (importlib mode puts no test folder on sys.path).
_spec = importlib.util.spec_from_file_location("olmo_run_test_driver", Path(__file__).with_name("test_driver.py"))
assert _spec is not None and _spec.loader is not None
driver_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver_tests)


class Recorder(Callback):
    """Notes every hook, and records one figure per step before the train line is written."""

    order = 15

    def __init__(self) -> None:
        self.hooks: list[str] = []

    def on_start(self, run: Run) -> None:
        self.hooks.append("start")

    def before_step(self, run: Run, step: int) -> None:
        self.hooks.append(f"before {step}")

    def after_step(self, run: Run, step: Step) -> None:
        self.hooks.append(f"after {step.number}")
        step.metrics.record("twice_loss", 2 * step.metrics["loss"])

    def on_end(self, run: Run) -> None:
        self.hooks.append("end")

    def close(self, run: Run) -> None:
        self.hooks.append("close")


def test_the_default_jobs_in_their_order_within_a_step():
    names = [type(job).__name__ for job in default_callbacks()]
    assert names == ["ProfilerTrace", "TrainLine", "Checkpoint", "PreemptionCheck", "Evaluation", "LockHeartbeat"]


def test_a_job_of_ones_own_gets_every_hook_and_its_metric_lands_on_the_train_line(tmp_path):
    (tmp_path / "mix").mkdir()
    recipe = driver_tests.recipe_for(driver_tests.write_mixture(tmp_path / "mix"), tmp_path / "run", "--train.steps=2")
    setup = resolve_run(read_inputs(recipe), "numpy", loader_ranks=(0, 1), dp_size=2)
    recorder = Recorder()
    jobs = sorted([*default_callbacks(), recorder], key=lambda job: job.order)
    run(setup, lambda: driver_tests.NumpyModule(setup, []), is_main=True, describe=[], title="t", callbacks=jobs)
    assert recorder.hooks == ["start", "before 1", "after 1", "before 2", "after 2", "end", "close"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # TRAIN_KEYS, then the module's extra, then the job's figure, as recorded
        assert tuple(r) == (*TRAIN_KEYS, "weight", "twice_loss") and r["twice_loss"] == 2 * r["loss"]


def test_log_lines_reach_the_current_stdout_and_the_summary_stderr(capsys):
    show_on_terminal()
    show_on_terminal()  # a second call adds no second pair of handlers
    handlers = logging.getLogger("olmo_run").handlers
    assert sum(isinstance(h, CurrentStream) for h in handlers) == 2
    logging.getLogger("olmo_run.anything").info("a run line")
    logging.getLogger(SUMMARY_LOGGER).info("the summary table")
    logging.getLogger("olmo_run.anything").warning("a warning")
    logging.getLogger("olmo_run.anything").debug("not shown")
    out, err = capsys.readouterr()
    assert out == "a run line\n"
    assert err == "the summary table\na warning\n"


@pytest.fixture(autouse=True)
def test_peak(monkeypatch):
    """No CPU matmul timed for the MFU peak: these runs check hooks and keys, not throughput."""
    from olmo_run import loop

    monkeypatch.setattr(loop, "device_peak", lambda kind, matmul: (1e12, "test peak"))


def test_the_console_train_line_shows_data_wait_and_memory():
    """Hand-made figures: 2 GiB in use of a 3.3 GiB peak on the device, 12.5 ms of the step
    waiting for the batch; on CPU the same figures are the host process's resident set."""
    from olmo_run.callbacks.train_line import console_line
    from olmo_run.loop import StepMetrics

    m = StepMetrics()
    figures = dict(loss=2.5, grad_norm=0.75, tokens_per_second=12345.6, mfu=0.4125, data_wait=0.0125)
    figures.update(memory_gib=2.0, memory_peak_gib=3.3, memory_kind="device", skipped=False)
    for name, value in figures.items():
        m.record(name, value)
    assert console_line(7, 100, 3e-4, m) == (
        "step 7/100 loss 2.5000 lr 3.000e-04 grad_norm 0.750 12,346 tok/s mfu 41.2% wait 0.01s mem 2.0/3.3 GiB"
    )
    m.record("memory_kind", "host_rss")
    m.record("skipped", True)
    assert console_line(7, 100, 3e-4, m).endswith(" wait 0.01s rss 2.0/3.3 GiB SKIPPED")


def test_every_console_train_line_carries_the_records_data_wait_and_memory(tmp_path, capsys):
    (tmp_path / "mix").mkdir()
    mixture = driver_tests.write_mixture(tmp_path / "mix")
    recipe = driver_tests.recipe_for(mixture, tmp_path / "run", "--train.steps=2", "--log.every=1")
    setup = resolve_run(read_inputs(recipe), "numpy", loader_ranks=(0, 1), dp_size=2)
    show_on_terminal()
    run(setup, lambda: driver_tests.NumpyModule(setup, []), is_main=True, describe=[], title="t")
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    train = [r for r in records if r["kind"] == "train"]
    assert len(lines) == len(train) == 2
    for line, r in zip(lines, train):
        assert r["memory_kind"] == "host_rss"  # the numpy module has no device memory
        want = f" wait {r['data_wait']:.2f}s rss {r['memory_gib']:.1f}/{r['memory_peak_gib']:.1f} GiB"
        assert line.endswith(want), line

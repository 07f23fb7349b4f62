"""The run driver with a numpy train module: what it logs, when it saves and evaluates, how a
run ends when the module fails, and the rerun of a run killed before its final eval. The
module's "loss" is a known function of the step, so every logged number is checked against a
value computed here from the recipe (both trainers' end-to-end tests run the driver for real).

The metrics sinks, the profiler window, data-wait and memory on the train line: TensorBoard's
own event reader and a reader of W&B's offline run file (written here, from the record format
W&B documents: LevelDB log blocks of protobuf Records) must give back exactly the values of
metrics.jsonl."""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from olmo_data import load_mixture
from olmo_model import flops_per_token
from olmo_run import StepMetrics, announce_finished, loop, read_inputs, resolve_run, run
from olmo_run.checkpoints import checkpoint_dir, commit_checkpoint, complete_checkpoints
from olmo_run.console import throughput
from olmo_run.errors import TrainingDivergedError
from olmo_run.measure import host_memory
from olmo_run.metrics import TRAIN_KEYS, read_metrics
from olmo_run.recipe import RecipeError, load_recipe
from olmo_run.sinks import check_sinks, scalars
from olmo_run.terminal import show_on_terminal

STEPS = 6


def write_mixture(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for name, n in (("train", 20_000), ("held", 2_000)):
        docs = [np.append(rng.integers(1, 500, int(rng.integers(20, 80))), 0) for _ in range(n // 40)]
        np.concatenate(docs)[: n - 1].astype(np.uint16).tofile(root / f"{name}.bin")
        with open(root / f"{name}.bin", "ab") as f:
            f.write(np.uint16(0).tobytes())
    (root / "mixture.yaml").write_text(
        "name: driver\nsequence_length: 32\nseed: 1\neos_token_id: 0\nvocab_size: 512\n"
        "sources:\n  - {name: train, paths: [train.bin], format: numpy, dtype: uint16, ratio: 1.0}\n"
        "held_out:\n  - {name: held, paths: [held.bin], format: numpy, dtype: uint16}\n"
        "eval: {sequences_per_source: 4}\n"
    )
    return root / "mixture.yaml"


class NumpyModule:
    """A stand-in trainer: its "weights" are one number that each step moves by -lr."""

    framework = "numpy"
    n_devices = 2

    def __init__(
        self,
        plan,
        calls: list[str],
        fail_at: int | None = None,
        nan_at: int | None = None,
        signals_at: dict[int, list[int]] | None = None,
        peer_signal_at: int | None = None,
        sleep_at: dict[int, float] | None = None,
        eval_fail_at: int | None = None,
    ):
        self.plan, self.calls, self.fail_at, self.nan_at = plan, calls, fail_at, nan_at
        self.signals_at = signals_at or {}  # step -> signals this process sends itself during it
        self.peer_signal_at = peer_signal_at  # step after which the other "process" reports SIGTERM
        self.sleep_at = sleep_at or {}  # step -> seconds the step takes
        self.eval_fail_at = eval_fail_at  # the eval after this step dies (a kill before its line)
        self.step = 0
        self.weight = 1.0
        if plan.resume is not None:
            self.weight = plan.resume[2]["weight"]
        self.pending: int | None = None

    def train_step(self, batch, step, lr, guard, metrics: StepMetrics) -> None:
        self.calls.append(f"step {step}")
        self.step = step
        for signum in self.signals_at.get(step, []):
            os.kill(os.getpid(), signum)  # delivered mid-step, as a scheduler's would be
        time.sleep(self.sleep_at.get(step, 0.0))
        if step == self.fail_at:
            raise RuntimeError("module failed")
        assert batch["input_ids"].shape == (self.plan.layout.global_batch, 32)
        loss = 8.0 - step / 10
        skipped = guard.should_skip(loss, 1.0)  # decided as on a device; the driver's read replays it
        if step == self.nan_at:
            self.weight = math.nan
        elif not skipped:
            self.weight -= lr
        for name, value in (("loss", loss), ("ce_loss", loss - 0.5), ("z_loss", 50.0), ("grad_norm", 1.0)):
            metrics.record(name, value)
        metrics.record("skipped", skipped)
        metrics.record("weight", self.weight)

    def eval_sums(self, batch):
        # The one batch of the held-out source: a loss of ``weight`` over 128 tokens.
        self.calls.append("eval")
        if self.step == self.eval_fail_at:
            raise RuntimeError("killed before the eval line")
        return self.weight * 128, 128.0

    def state_is_finite(self) -> bool:
        return math.isfinite(self.weight)

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"weight": self.weight}

    def save(self, step, meta) -> None:
        self.calls.append(f"save {step}")
        self.close()
        checkpoint_dir(self.plan.run_dir, step).mkdir(parents=True)
        self.pending, self.meta = step, meta  # committed by the next poll/close, like an async save

    def poll(self) -> None:
        if self.pending is not None:
            self.close()

    def device_memory(self):
        return None  # no device: the driver reports this process's RSS

    def device_kind(self):
        return None

    def matmul(self, size: int):
        a = np.ones((size, size), np.float32)
        return lambda: a @ a

    def start_trace(self, folder: Path) -> None:
        self.calls.append(f"trace {folder.name}")
        (folder / "trace.json").write_text("{}")

    def stop_trace(self) -> None:
        self.calls.append("trace stop")

    def to_host(self, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return values  # host values already

    def all_gather_text(self, text: str) -> list[str]:
        # Two processes reading the same rows (a context-parallel pair) send the same line.
        if self.peer_signal_at is not None and self.step >= self.peer_signal_at and text == "":
            return [text, "SIGTERM"]  # the other process was signalled; this one was not
        return [text, text]

    def close(self) -> None:
        if self.pending is not None:
            commit_checkpoint(checkpoint_dir(self.plan.run_dir, self.pending), self.meta)
            self.calls.append(f"commit {self.pending}")
            self.pending = None


def reference_digest(batch: dict[str, np.ndarray], step: int) -> str:
    """olmo_data.digest's definition, written out: the sum of the rows' sha256 of (step, row,
    int64) then input_ids, labels, doc_ids, positions (int32), modulo 2**256."""
    total = 0
    for row in range(batch["input_ids"].shape[0]):
        data = np.array([step, row], "<i8").tobytes()
        data += b"".join(batch[k][row].astype("<i4").tobytes() for k in ("input_ids", "labels", "doc_ids", "positions"))
        total += int(hashlib.sha256(data).hexdigest(), 16)
    return format(total % 2**256, "064x")


def recipe_for(mixture: Path, run_dir: Path, *extra: str):
    return load_recipe(
        None,
        [
            f"--data.mixture={mixture}",
            f"--run_dir={run_dir}",
            "--model=tiny",
            f"--train.steps={STEPS}",
            "--train.global_batch_tokens=256",
            "--checkpoint.every=4",
            "--eval.every=3",
            "--log.progress=false",
            "--data.prefetch=0",
            *extra,
        ],
    )


def go(recipe, calls, **module_args) -> Path:
    plan = resolve_run(read_inputs(recipe), "numpy", loader_ranks=(0, 1), dp_size=2)
    if announce_finished(plan, True):
        calls.append("finished")
        return plan.run_dir
    return run(
        plan, lambda: NumpyModule(plan, calls, **module_args), is_main=True, describe=["numpy module"], title="test"
    )


@pytest.fixture(autouse=True)
def test_peak(monkeypatch):
    """The peak MFU divides by: 1e12 FLOP/s per device, whatever this machine's matmul does."""
    monkeypatch.setattr(loop, "device_peak", lambda kind, matmul: (1e12, "test peak 1 TFLOP/s"))


@pytest.fixture
def mixture(tmp_path) -> Path:
    (tmp_path / "mix").mkdir()
    return write_mixture(tmp_path / "mix")


def test_train_lines_cadence_and_checkpoints(mixture, tmp_path, capsys):
    recipe = recipe_for(mixture, tmp_path / "run")
    calls: list[str] = []
    run_dir = go(recipe, calls)
    # Saves at 4 and 6 (the last step), evals at 3 and 6; a save is committed by the next poll.
    assert calls == [
        "step 1",
        "step 2",
        "step 3",
        "eval",
        "step 4",
        "save 4",
        "step 5",
        "commit 4",
        "step 6",
        "save 6",
        "eval",
        "commit 6",
    ]
    records = read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    weight = 1.0
    order = load_mixture(mixture).order
    for r in train:
        assert tuple(r)[: len(TRAIN_KEYS)] == TRAIN_KEYS and tuple(r)[len(TRAIN_KEYS) :] == ("weight",)
        assert r["batch_digest"] == reference_digest(order.global_batch(r["step"] - 1, 8), r["step"] - 1)
        lr = recipe.schedule.lr(r["step"], recipe.optim.lr, STEPS)
        weight -= lr
        assert r["lr"] == lr and r["weight"] == pytest.approx(weight, abs=1e-15)
        assert r["loss"] == 8.0 - r["step"] / 10 and r["ce_loss"] == r["loss"] - 0.5
        assert r["tokens_seen"] == r["step"] * 8 * 32  # 256 tokens per step of 32-token sequences
        assert r["tokens_per_second_per_device"] == r["tokens_per_second"] / 2
        tflops = flops_per_token(recipe.model_spec(), 32) * r["tokens_per_second"] / 2 / 1e12
        assert r["tflops_per_device"] == pytest.approx(tflops, rel=1e-12)
        # A peak of 1e12 FLOP/s per device: the MFU equals the TFLOP/s per device.
        assert r["mfu"] == pytest.approx(tflops, rel=1e-12) and r["mfu_peak"] == "test peak 1 TFLOP/s"
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [4, 6]
    meta = json.loads((checkpoint_dir(run_dir, 6) / "meta.json").read_text())
    assert meta["loader_state"]["step"] == 6 and meta["weight"] == pytest.approx(weight)
    assert meta["layout"]["global_batch"] == 8 and meta["spike_guard"]["consecutive_skips"] == 0
    out = capsys.readouterr().out
    assert "numpy module" in out and "batch layout: global batch 8 = 4 per device x 2 data-parallel" in out


def test_a_failing_step_still_commits_the_save_in_flight(mixture, tmp_path):
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="module failed"):
        go(recipe_for(mixture, tmp_path / "run"), calls, fail_at=5)
    assert calls[-3:] == ["save 4", "step 5", "commit 4"]
    assert [s for s, _ in complete_checkpoints(tmp_path / "run")] == [4]


def test_a_non_finite_state_is_never_checkpointed(mixture, tmp_path):
    calls: list[str] = []
    with pytest.raises(TrainingDivergedError, match="step 4: parameters or optimizer moments are not finite"):
        go(recipe_for(mixture, tmp_path / "run"), calls, nan_at=4)
    assert "save 4" not in calls and complete_checkpoints(tmp_path / "run") == []


def test_a_rerun_writes_a_missing_final_eval_and_then_has_nothing_to_do(mixture, tmp_path):
    recipe = recipe_for(mixture, tmp_path / "run")
    calls: list[str] = []
    run_dir = go(recipe, calls)
    # As if killed between the final checkpoint and its eval: drop the step-6 eval and the plot.
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("".join(x + "\n" for x in lines if '"eval"' not in x or '"step": 3' in x))
    (run_dir / "loss.png").unlink()
    rerun: list[str] = []
    go(recipe, rerun)
    assert rerun == ["eval"]  # no step trained again, no save
    evals = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert (run_dir / "loss.png").exists()
    again: list[str] = []
    go(recipe, again)
    assert again == ["finished"]


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(folder.glob("events.out.tfevents.*")):  # a resume appends a new file
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """{step: {key: value}} from a W&B offline .wandb file: a 7-byte header (':W&B', magic,
    version), then LevelDB log records (crc32c u32, length u16, type u8: 1 full, 2 first,
    3 middle, 4 last) in 32 KiB blocks, each payload a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, payload, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(payload)
            payload = b""
    out: dict[int, dict[str, float]] = {}
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def test_tensorboard_and_wandb_get_the_jsonl_values(mixture, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = recipe_for(
        mixture,
        tmp_path / "run",
        "--log.sinks=[tensorboard, wandb]",
        "--log.wandb.mode=offline",
        "--log.wandb.project=sinks-test",
    )
    calls: list[str] = []
    run_dir = go(recipe, calls)
    records = read_metrics(run_dir)
    expected: dict[str, dict[int, float]] = {}
    for r in records:
        step, values = scalars(r)
        for tag, v in values.items():
            expected.setdefault(tag, {})[step] = v
    # Every numeric key of the train line and of the eval lines, at its step.
    assert {"train/loss", "train/data_wait", "train/memory_peak_gib", "train/weight"} <= set(expected)
    assert {"eval/held/loss", "eval/held/perplexity"} <= set(expected)
    assert set(expected["train/loss"]) == set(range(1, STEPS + 1)) and set(expected["eval/held/loss"]) == {3, 6}

    board = tensorboard_scalars(run_dir / "tensorboard")
    assert set(board) == set(expected)
    for tag, by_step in expected.items():
        # Event files store float32: equal to the float64 value rounded to float32.
        assert board[tag] == pytest.approx(by_step, rel=2**-23, abs=0), tag

    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    assert set(history) == set(range(1, STEPS + 1))
    for tag, by_step in expected.items():
        assert {s: history[s][tag] for s in by_step} == by_step, tag  # JSON: exact float64
    assert (run_dir / "wandb_run_id").read_text().strip() in run_file.name


def test_train_line_data_wait_and_memory(mixture, tmp_path):
    run_dir = go(recipe_for(mixture, tmp_path / "run"), [])
    train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    kernel_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    now, peak_now, _ = host_memory()
    for r in train:
        assert 0 <= r["data_wait"] <= r["step_time"]
        assert r["memory_kind"] == "host_rss"
        # The resident set and its peak so far: positive, the peak never below it and never above
        # the peak read after the run (a peak only grows).
        assert 0 < r["memory_gib"] <= r["memory_peak_gib"] <= peak_now / 2**30
    # The peak is never below the kernel's own high-water mark.
    assert peak_now >= kernel_peak and now > 0


def test_summary_throughput_is_tokens_over_the_steps_time(mixture, tmp_path, capsys):
    """The summary's tokens/s/device is the timed steps' tokens over their summed step_time (step 1,
    which compiles, left out), not the mean of per-step rates; its MFU the same tokens/time over
    the peak; the per-step rates' p10-p90 beside them."""
    show_on_terminal()
    sleeps = {2: 0.02, 3: 0.3, 4: 0.05, 5: 0.1, 6: 0.02}  # uneven: a mean of rates would be ~2.5x off
    run_dir = go(recipe_for(mixture, tmp_path / "run"), [], sleep_at=sleeps)
    train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    timed = [r for r in train if r["step"] >= 2]
    assert [r["step"] for r in timed] == [2, 3, 4, 5, 6]
    assert all(r["step_time"] >= sleeps[r["step"]] for r in timed)
    seconds = sum(r["step_time"] for r in timed)
    # 5 steps of 8 sequences x 32 tokens, over 2 devices
    expected = 5 * 8 * 32 / 2 / seconds
    mean_of_rates = sum(r["tokens_per_second_per_device"] for r in timed) / 5
    assert mean_of_rates > 1.2 * expected  # the figure the summary used to print
    got = throughput(train)
    assert got.steps == "steps 2-6"
    assert got.tokens_per_second == pytest.approx(expected, rel=1e-12)
    # The test peak is 1e12 FLOP/s per device.
    fpt = flops_per_token(recipe_for(mixture, tmp_path / "run").model_spec(), 32)
    assert got.mfu == pytest.approx(fpt * expected / 1e12, rel=1e-12)
    rates = sorted(8 * 32 / 2 / r["step_time"] for r in timed)
    # p10 / p90 of 5 values, linearly interpolated: 0.4 / 3.6 of the way along the sorted list
    p10, p90 = rates[0] + 0.4 * (rates[1] - rates[0]), rates[3] + 0.6 * (rates[4] - rates[3])
    assert got.rate_spread == f"p10-p90 {p10:,.0f}-{p90:,.0f}"
    assert got.peak == "test peak 1 TFLOP/s"
    summary = capsys.readouterr().err
    (row,) = [line for line in summary.splitlines() if "tokens/s/device, steps 2-6" in line]
    assert f" {expected:,.0f} (per step p10-p90 {p10:,.0f}-{p90:,.0f})" in row
    (row,) = [line for line in summary.splitlines() if "MFU, steps 2-6" in line]
    assert f" {fpt * expected / 1e12:.1%} (per step p10-p90 " in row
    (row,) = [line for line in summary.splitlines() if "MFU of" in line]
    assert "test peak 1 TFLOP/s" in row


def test_profile_window(mixture, tmp_path):
    calls: list[str] = []
    run_dir = go(recipe_for(mixture, tmp_path / "run", "--profile.start_step=2", "--profile.steps=2"), calls)
    assert calls[:5] == ["step 1", "trace steps_2-3", "step 2", "step 3", "eval"]
    assert calls[5] == "trace stop" and calls.count("trace stop") == 1
    assert (run_dir / "profile" / "steps_2-3" / "trace.json").exists()
    # A window past the end stops with the loop.
    calls = []
    go(recipe_for(mixture, tmp_path / "run2", "--profile.start_step=6", "--profile.steps=5"), calls)
    assert calls.index("trace steps_6-6") < calls.index("step 6") < calls.index("trace stop")


def test_a_missing_sink_package_is_one_line(monkeypatch):
    import importlib.util

    from olmo_run.recipe import Recipe

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RecipeError, match=r"log.sinks: 'wandb' needs the wandb package; install olmo-run\[wandb\]"):
        check_sinks(Recipe.model_validate({"log": {"sinks": ["wandb"]}}))


# ---- preemption (olmo_run.preempt) and the eval a stop left unwritten ------------------------------


def comparable(records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The numbers of the metrics that do not depend on timing (loss, weight, lr, digest, eval)."""
    keep = ("kind", "step", "loss", "lr", "weight", "batch_digest", "eval")
    return [tuple(r.get(k) for k in keep) for r in records]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_step_checkpoints_that_step_and_the_rerun_continues_exactly(mixture, tmp_path, signum):
    """The signal arrives during step 2 (no checkpoint due before 4): the step finishes, a
    checkpoint of step 2 is committed, the lock is released, Preempted names the step; the
    rerun resumes at 2 and its metrics equal an uninterrupted run's."""
    from olmo_run.preempt import Preempted

    reference = go(recipe_for(mixture, tmp_path / "reference"), [])
    recipe = recipe_for(mixture, tmp_path / "run")
    calls: list[str] = []
    with pytest.raises(Preempted) as stopped:
        go(recipe, calls, signals_at={2: [signum]})
    assert stopped.value.step == 2 and stopped.value.signal_name == signal.Signals(signum).name
    assert calls == ["step 1", "step 2", "save 2", "commit 2"]  # no step 3, no eval
    assert [s for s, _ in complete_checkpoints(tmp_path / "run")] == [2]
    assert not (tmp_path / "run" / "RUN_LOCK").exists()
    assert (
        signal.getsignal(signum) is not None
        and signal.getsignal(signum)
        == {
            signal.SIGTERM: signal.SIG_DFL,
            signal.SIGINT: signal.default_int_handler,
        }[signum]
    )  # the handlers are given back
    rerun: list[str] = []
    go(recipe, rerun)
    assert rerun[0] == "step 3"
    assert comparable(read_metrics(tmp_path / "run")) == comparable(read_metrics(reference))


def test_a_stop_at_an_eval_step_and_a_kill_before_a_middle_eval_get_that_eval_on_resume(mixture, tmp_path):
    """Preempted after step 3 (eval due at 3, checkpoint every 3): the checkpoint is written and
    the eval skipped; the rerun evaluates step 3 before training on. A kill between the step-3
    checkpoint and its eval line (the eval dies): the same."""
    from olmo_run.preempt import Preempted

    reference = go(recipe_for(mixture, tmp_path / "reference", "--checkpoint.every=3"), [])
    for name, stop in (("preempted", {"signals_at": {3: [signal.SIGTERM]}}), ("killed", {"eval_fail_at": 3})):
        recipe = recipe_for(mixture, tmp_path / name, "--checkpoint.every=3")
        with pytest.raises((Preempted, RuntimeError)):
            go(recipe, [], **stop)
        assert [s for s, _ in complete_checkpoints(tmp_path / name)] == [3], name
        assert not any(r["kind"] == "eval" for r in read_metrics(tmp_path / name)), name
        rerun: list[str] = []
        go(recipe, rerun)
        assert rerun[:2] == ["eval", "step 4"], name
        assert comparable(read_metrics(tmp_path / name)) == comparable(read_metrics(reference)), name


def test_processes_stop_together_when_only_another_one_was_signalled(mixture, tmp_path):
    """This process never sees a signal; the gather after step 2 says the other one did: it stops
    at the same step, with the checkpoint, as the signalled one does."""
    from olmo_run.preempt import Preempted

    calls: list[str] = []
    with pytest.raises(Preempted, match="after step 2"):
        go(recipe_for(mixture, tmp_path / "run"), calls, peer_signal_at=2)
    assert calls == ["step 1", "step 2", "save 2", "commit 2"]


@pytest.mark.parametrize(
    "case, expected",
    [("second", "second signal (SIGTERM) while stopping"), ("timeout", "no end 0.5 s after SIGTERM")],
)
def test_a_second_signal_or_the_timeout_exits_at_once(mixture, tmp_path, case, expected):
    """In a child process (it leaves with os._exit): a second SIGTERM during the stop, or a step
    that outlasts checkpoint.preempt_timeout_s after the first, ends it at once: status 143, one
    line, the lock released, no checkpoint of the interrupted stop."""
    child = subprocess.run(
        [sys.executable, __file__, case, str(mixture), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 128 + signal.SIGTERM, child.stderr
    assert f"{expected}: exiting at once without a new checkpoint" in child.stderr
    assert complete_checkpoints(tmp_path / "run") == []
    assert not (tmp_path / "run" / "RUN_LOCK").exists()


if __name__ == "__main__":  # the child of test_a_second_signal_or_the_timeout_exits_at_once
    case, mixture_path, run_path = sys.argv[1:]
    args = ("--checkpoint.preempt_timeout_s=0.5",)
    stop: dict[str, Any] = (
        {"signals_at": {2: [signal.SIGTERM, signal.SIGTERM]}}
        if case == "second"
        else {"signals_at": {2: [signal.SIGTERM]}, "sleep_at": {2: 5.0}}
    )
    go(recipe_for(Path(mixture_path), Path(run_path), *args), [], **stop)

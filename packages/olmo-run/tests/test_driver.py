"""The run driver with a numpy train module: what it logs, when it saves and evaluates, how a
run ends when the module fails, and the rerun of a run killed before its final eval. The
module's "loss" is a known function of the step, so every logged number is checked against a
value computed here from the recipe (both trainers' end-to-end tests run the driver for real)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from olmo_model import flops_per_token
from olmo_model.recipe import load_recipe
from olmo_model.runlog import (
    TRAIN_KEYS,
    TrainingDivergedError,
    checkpoint_dir,
    commit_checkpoint,
    complete_checkpoints,
    read_metrics,
)
from olmo_run import StepResult, announce_finished, plan_run, run

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
    peak = (1e12, "test peak 1 TFLOP/s")

    def __init__(self, plan, calls: list[str], fail_at: int | None = None, nan_at: int | None = None):
        self.plan, self.calls, self.fail_at, self.nan_at = plan, calls, fail_at, nan_at
        self.weight = 1.0
        if plan.resume is not None:
            self.weight = plan.resume[2]["weight"]
        self.pending: int | None = None

    def train_step(self, batch, step, lr, guard) -> StepResult:
        self.calls.append(f"step {step}")
        if step == self.fail_at:
            raise RuntimeError("module failed")
        assert batch["input_ids"].shape == (self.plan.layout.global_batch, 32)
        loss = 8.0 - step / 10
        skipped = guard.decide(step, loss, 1.0)
        if step == self.nan_at:
            self.weight = math.nan
        elif not skipped:
            self.weight -= lr
        return StepResult(loss, loss - 0.5, 50.0, 1.0, skipped, {"weight": self.weight})

    def evaluate(self):
        self.calls.append("eval")
        return {"held": {"loss": self.weight, "perplexity": math.exp(self.weight), "tokens": 128}}

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

    def close(self) -> None:
        if self.pending is not None:
            commit_checkpoint(checkpoint_dir(self.plan.run_dir, self.pending), self.meta)
            self.calls.append(f"commit {self.pending}")
            self.pending = None


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
    plan = plan_run(recipe, "numpy", dp_size=2)
    if announce_finished(plan, True):
        calls.append("finished")
        return plan.run_dir
    return run(
        plan, lambda: NumpyModule(plan, calls, **module_args), is_main=True, describe=["numpy module"], title="test"
    )


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
    for r in train:
        assert tuple(r)[: len(TRAIN_KEYS)] == TRAIN_KEYS and tuple(r)[len(TRAIN_KEYS) :] == ("weight",)
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

"""The run plumbing's stop rules and its tolerance of a damaged metrics log."""

from __future__ import annotations

import json
import math

import pytest

from olmo_run.runlog import (
    MetricsLog,
    SpikeGuard,
    TrainingDivergedError,
    TrainingStateError,
    final_eval_pending,
    perplexity,
    read_metrics,
)


def test_without_the_guard_a_non_finite_step_stops_the_run():
    g = SpikeGuard(enabled=False)
    assert g.decide(1, 8.3, 1.2) is False
    for loss, norm in ((math.nan, 1.0), (8.3, math.inf), (-math.inf, 1.0)):
        with pytest.raises(TrainingDivergedError, match="step 7: .* not finite"):
            g.decide(7, loss, norm)


def test_the_guard_skips_then_stops_after_max_consecutive_skips():
    g = SpikeGuard(enabled=True, min_history=2, sigma=6.0, max_consecutive_skips=3)
    assert [g.decide(s, 2.0 + 0.01 * s, 1.0) for s in range(1, 5)] == [False] * 4
    assert g.decide(5, math.nan, 1.0) is True  # skipped, not fatal: the update is never applied
    assert g.decide(6, 50.0, 1.0) is True
    assert g.decide(7, 2.03, 1.0) is False  # an accepted step resets the count
    assert g.consecutive_skips == 0
    assert [g.decide(s, 1e9, 1.0) for s in (8, 9, 10)] == [True] * 3
    state = g.state_dict()
    assert state["consecutive_skips"] == 3
    resumed = SpikeGuard(enabled=True, min_history=2, sigma=6.0, max_consecutive_skips=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as meta.json carries it
    with pytest.raises(TrainingDivergedError, match="skipped 4 steps in a row"):
        resumed.decide(11, 1e9, 1.0)
    assert len(resumed.losses) == 5  # skipped steps never enter the history


def test_perplexity_does_not_overflow():
    assert perplexity(2.0) == pytest.approx(7.38905609893065)
    assert perplexity(709.0) == math.exp(709.0)
    assert perplexity(710.0) == math.inf


def test_a_cut_off_last_metrics_line_is_dropped_and_a_damaged_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"kind": "train", "step": 1, "loss": 8.0}, {"kind": "train", "step": 2, "loss": 7.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"kind": "train", "st')
    assert read_metrics(tmp_path) == good
    MetricsLog(tmp_path, resume_step=2).write({"kind": "train", "step": 3, "loss": 7.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]

    path.write_text(json.dumps(good[0]) + "\n{oops\n" + json.dumps(good[1]) + "\n")
    with pytest.raises(TrainingStateError, match=r"metrics.jsonl: line 2 is not JSON"):
        MetricsLog(tmp_path, resume_step=2)


def test_final_eval_pending(tmp_path):
    # The workspace installs matplotlib, so the plot is part of a run's end.
    def write(*records: dict) -> None:
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    write({"kind": "train", "step": 20}, {"kind": "eval", "step": 10, "eval": {}})
    assert final_eval_pending(tmp_path, 20, ["held"])
    write({"kind": "train", "step": 20}, {"kind": "eval", "step": 20, "eval": {}})
    assert final_eval_pending(tmp_path, 20, ["held"])  # no loss.png yet
    (tmp_path / "loss.png").write_bytes(b"png")
    assert not final_eval_pending(tmp_path, 20, ["held"])
    write({"kind": "train", "step": 20})
    assert not final_eval_pending(tmp_path, 20, [])  # no held-out sources: nothing to evaluate


def test_a_resume_keeps_the_started_recipe_and_records_each_change_with_its_step(tmp_path, capsys):
    from olmo_run.recipe import load_recipe
    from olmo_run.runlog import RECIPE_HISTORY_FILE, prepare_run_dir

    run = tmp_path / "run"
    first = load_recipe(None, [f"--run_dir={run}", "--eval.every=50"])
    spec = first.model_spec()
    prepare_run_dir(first, spec)
    started = (run / "recipe.yaml").read_text()
    assert started == first.to_yaml()

    prepare_run_dir(first, spec, resumed_at=20)  # the same recipe: nothing to record
    assert not (run / RECIPE_HISTORY_FILE).exists()

    second = load_recipe(None, [f"--run_dir={run}", "--eval.every=10", "--log.every=5"])
    prepare_run_dir(second, spec, resumed_at=40)
    third = load_recipe(None, [f"--run_dir={run}", "--eval.every=10", "--log.every=2"])
    prepare_run_dir(third, spec, resumed_at=70)
    assert (run / "recipe.yaml").read_text() == started
    history = [json.loads(line) for line in (run / RECIPE_HISTORY_FILE).read_text().splitlines()]
    # Each record holds what that launch changed from the one before it, and its whole recipe.
    assert [(h["step"], h["changes"]) for h in history] == [
        (40, {"eval.every": [50, 10], "log.every": [1, 5]}),
        (70, {"log.every": [5, 2]}),
    ]
    assert history[-1]["recipe"] == third.to_yaml()
    out = capsys.readouterr().out
    assert "recipe change at step 40: eval.every: 50 -> 10" in out

    prepare_run_dir(third, spec)  # a fresh start in the same dir records its own recipe
    assert (run / "recipe.yaml").read_text() == third.to_yaml()
    assert not (run / RECIPE_HISTORY_FILE).exists()

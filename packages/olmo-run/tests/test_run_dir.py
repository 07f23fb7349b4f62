"""The run dir's record of its recipe: the one it started with, and each resume's changes."""

from __future__ import annotations

import json

import pytest

from olmo_run.recipe import load_recipe
from olmo_run.run_dir import RECIPE_HISTORY_FILE, prepare_run_dir
from olmo_run.terminal import show_on_terminal


@pytest.fixture(autouse=True)
def terminal() -> None:
    show_on_terminal()  # olmo_run's log lines reach the captured stdout / stderr, as under the CLI


def test_a_resume_keeps_the_started_recipe_and_records_each_change_with_its_step(tmp_path, capsys):
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

"""The metrics log: perplexity, its tolerance of a damaged metrics.jsonl, and a run's pending end."""

from __future__ import annotations

import json
import math

import pytest

from olmo_run.errors import TrainingStateError
from olmo_run.metrics import MetricsLog, final_eval_pending, perplexity, read_metrics


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

"""olmo-compare-runs on hand-made curves: run dirs, JSONL and a W&B-style CSV."""

import json

import numpy as np
import pytest

from olmo_tools.compare_runs import load_curve, main, smooth


def _run_dir(path, losses, offset=0.0):
    path.mkdir()
    lines = [json.dumps({"kind": "train", "step": i + 1, "loss": loss + offset}) for i, loss in enumerate(losses)]
    lines.insert(3, json.dumps({"kind": "eval", "step": 3, "eval": {"code": {"loss": 9.0, "perplexity": 8103.0}}}))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_run_dirs_and_csv(tmp_path, capsys):
    losses = [5.0, 4.0, 3.5, 3.2, 3.0, 2.9]
    a = _run_dir(tmp_path / "a", losses)
    b = _run_dir(tmp_path / "b", losses, offset=0.25)
    csv = tmp_path / "wandb.csv"
    # a W&B export: its own step column name, the metric under another name, a missing value
    csv.write_text("Step,train/CE loss\n1,5.5\n2,\n3,3.0\n6,2.4\n")
    rc = main(
        [
            str(a),
            str(b),
            str(csv),
            "--column",
            "loss",
            "--column",
            "loss",
            "--column",
            "train/CE loss",
            "--json",
            "--png",
            str(tmp_path / "c.png"),
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["shared_steps"] == 3  # steps 1, 3, 6 are in all three
    assert out["max_abs_diff"][0] == pytest.approx(0.25)
    # csv - a at steps 1, 3, 6: +0.5, -0.5, -0.5
    assert out["max_abs_diff"][1] == pytest.approx(0.5)
    assert out["mean_abs_diff"][1] == pytest.approx(0.5)
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert main([str(a), str(b), "--max-diff", "0.1"]) == 1
    assert main([str(a), str(b), "--max-diff", "0.3"]) == 0


def test_resumed_run_keeps_the_last_value_of_a_step(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(
        "\n".join(json.dumps({"step": s, "loss": loss}) for s, loss in [(1, 3.0), (2, 2.0), (2, 2.5), (3, 1.0)])
    )
    steps, values = load_curve(str(p))
    assert steps.tolist() == [1, 2, 3] and values.tolist() == [3.0, 2.5, 1.0]


def test_smooth_is_a_trailing_mean():
    v = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    # window 2: [1, (1+2)/2, (2+3)/2, (3+4)/2, (4+5)/2]
    assert smooth(v, 2).tolist() == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert smooth(v, 1) is v


def test_bad_inputs(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), str(tmp_path / "missing2")]) == 2
    assert "no such run dir or file" in capsys.readouterr().err
    csv = tmp_path / "x.csv"
    csv.write_text("Step,acc\n1,0.5\n")
    other = _run_dir(tmp_path / "r", [1.0])
    assert main([str(other), str(csv)]) == 2
    assert "no 'loss' column" in capsys.readouterr().err

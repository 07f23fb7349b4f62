"""olmo-compare-runs on hand-made curves: run dirs, JSONL and a W&B-style CSV."""

import json
import math

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


def _eval_run(path, evals, moe=False):
    """A run dir with train lines at steps 1-6 (loss 3.0) and eval lines {step: (code loss, prose loss)}."""
    path.mkdir()
    lines = []
    for step in range(1, 7):
        train = {"kind": "train", "step": step, "loss": 3.0, "grad_norm": 0.5, "mfu_peak": "measured"}
        if moe:
            train["moe_tokens_per_expert"] = [4, 4]
        lines.append(train)
        if step in evals:
            code, prose = evals[step]
            sources = {"code": {"loss": code, "perplexity": math.exp(code)}, "prose": {"loss": prose}}
            lines.append({"kind": "eval", "step": step, "eval": sources})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_eval_keys_compare_at_the_steps_both_runs_evaluated(tmp_path, capsys):
    a = _eval_run(tmp_path / "a", {2: (4.0, 5.0), 4: (3.5, 4.5), 6: (3.0, 4.0)})
    b = _eval_run(tmp_path / "b", {2: (4.25, 5.0), 3: (9.0, 9.0), 4: (3.25, 4.75)})
    assert main([str(a), str(b), "--metric", "eval/code/loss", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # shared eval steps 2 and 4: b - a = +0.25, -0.25 (step 3 is b's alone, 6 a's alone)
    assert out["shared_steps"] == 2 and sorted(out["at"]) == ["2", "4"]
    assert out["at"]["2"] == [4.0, 4.25] and out["at"]["4"] == [3.5, 3.25]
    assert out["max_abs_diff"] == [pytest.approx(0.25)] and out["mean_abs_diff"] == [pytest.approx(0.25)]
    assert main([str(a), str(b), "--metric", "eval/prose/loss", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_abs_diff"] == [pytest.approx(0.25)] and out["mean_abs_diff"] == [pytest.approx(0.125)]
    steps, values = load_curve(str(b), "eval/code/perplexity")
    assert steps.tolist() == [2, 3, 4] and values == pytest.approx([70.105412, 8103.083928, 25.790340])
    # a train key bare or as the sinks tag it
    for key in ("grad_norm", "train/grad_norm"):
        steps, values = load_curve(str(a), key)
        assert steps.tolist() == [1, 2, 3, 4, 5, 6] and values.tolist() == [0.5] * 6


def test_help_lists_the_keys(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for key in ("loss", "grad_norm", "tokens_per_second_per_device", "data_wait", "memory_peak_gib"):
        assert f" {key}," in out or f" {key}\n" in out
    assert "eval/<held-out source>/loss" in out and "eval/<held-out source>/perplexity" in out
    assert "batch_digest" not in out and "memory_kind" not in out  # labels, not curves


def test_unknown_key_lists_the_keys_found(tmp_path, capsys):
    a = _eval_run(tmp_path / "a", {2: (4.0, 5.0)}, moe=True)
    b = _eval_run(tmp_path / "b", {2: (4.0, 5.0)})
    assert main([str(a), str(b), "--metric", "code/loss"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == (
        f"olmo-compare-runs: {a / 'metrics.jsonl'}: no 'code/loss' values; did you mean 'eval/code/loss'? keys found:"
        " loss, grad_norm, eval/code/loss, eval/code/perplexity, eval/prose/loss\n"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"kind": "eval", "step": 1, "eval": 2.0}) + "\n")
    assert main([str(bad), str(a)]) == 2
    assert f"{bad}:1: not a metrics record" in capsys.readouterr().err

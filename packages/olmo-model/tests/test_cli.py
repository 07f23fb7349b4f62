"""`olmo-model describe` and `olmo-model presets`."""

from __future__ import annotations

import json
import subprocess
import sys

from olmo_model.cli import main


def test_describe_olmo3_7b_json_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "olmo_model.cli", "describe", "olmo3-7b", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(out.stdout)
    assert info["params_total"] == 7_298_617_344  # docs/design.md
    # Head and embedding: 2 * 100352 * 4096; dense, so every parameter is active.
    assert info["params_non_embedding"] == 7_298_617_344 - 2 * 100_352 * 4096
    assert info["params_active"] == info["params_total"]
    assert info["seq_len"] == 8192
    # 6 x (params - embedding lookup) + attention: 8 global layers see 4096.5 keys on
    # average and 24 sliding ones 3072.25, at 12 * 4096 FLOPs per key per layer.
    matmul = 7_298_617_344 - 100_352 * 4096 - 32 * (2 * 4096 + 4096 + 4096) - 4096
    attention = 12 * 4096 * (8 * 4096.5 + 24 * 3072.25)
    assert info["flops_per_token"] == 6 * matmul + attention


def test_describe_tables_and_memory(capsys):
    assert main(["describe", "olmo3-7b", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "7,298,617,344" in out and "maths at seq_len 4096" in out
    # fp32 weights: 7,298,617,344 * 4 bytes = 27.19 GiB; AdamW moments 8 bytes/param = 54.38 GiB.
    assert "27.19 GiB" in out and "54.38 GiB" in out


def test_describe_spec_file(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text("preset: tiny\nn_layers: 2\n")
    assert main(["describe", str(path), "--seq-len", "64", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # 2 * 4096 * 64 embedding + head, per layer 4 * 64^2 + 128 qk-norm + 128 norms
    # + 3 * 64 * 192 MLP, + 64 final norm.
    assert info["params_total"] == 2 * 4096 * 64 + 2 * (4 * 64 * 64 + 128 + 128 + 3 * 64 * 192) + 64


def test_bad_preset_and_file_exit_2(tmp_path, capsys):
    assert main(["describe", "olmo3-9b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown preset 'olmo3-9b'" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: tiny\nwindow: 8\n")
    assert main(["describe", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}: unknown field 'window'" in err
    assert main(["describe", "tiny", "--seq-len", "0"]) == 2
    assert "--seq-len 0 must be a positive" in capsys.readouterr().err


def test_presets_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("olmo3-14m", "olmo3-7b", "olmo3-32b", "tiny-yarn", "tiny-moe"):
        assert name in out

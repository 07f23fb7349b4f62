"""Bad input stops the trainer before it writes anything: a one-line error on stderr, exit
status 2, and the run dir exactly as it was (absent, or byte-identical)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from olmo_train_torch.cli import main


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() + str(p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_unknown_recipe_key(harness, mixture, tmp_path, capsys):
    run_dir = tmp_path / "run"
    harness.refused(capsys, harness.args(mixture, run_dir, "--optim.lrr=1e-3"), "optim.lrr", "did you mean 'optim.lr'")
    assert not run_dir.exists()


def test_global_batch_the_world_size_cannot_divide(harness, mixture, tmp_path, capsys, monkeypatch):
    # torchrun's environment for rank 0 of 3: the layout is refused before joining any group.
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    harness.refused(capsys, harness.args(mixture, run_dir), "16 sequences", "3 data-parallel")
    assert not run_dir.exists()


@pytest.fixture
def finished_copy(one_process_run, tmp_path) -> Path:
    run_dir = tmp_path / "copy"
    shutil.copytree(one_process_run, run_dir)
    return run_dir


def test_checkpoint_of_another_spec(harness, mixture, finished_copy, capsys):
    before = _snapshot(finished_copy)
    harness.refused(
        capsys,
        harness.args(mixture, finished_copy, "--model=tiny-gqa", "--train.steps=30"),
        "n_kv_heads",
        "step_00000020",
    )
    assert _snapshot(finished_copy) == before


def test_changed_mixture_on_resume(harness, finished_copy, tmp_path, capsys):
    other = harness.make_mixture(tmp_path / "other-data", seed=99)  # same layout, other tokens
    before = _snapshot(finished_copy)
    harness.refused(
        capsys, harness.args(other, finished_copy, "--train.steps=30"), "fingerprint", "allow_fingerprint_mismatch"
    )
    assert _snapshot(finished_copy) == before


def test_finished_run_exits_zero_untouched(harness, mixture, finished_copy, capsys):
    before = _snapshot(finished_copy)
    assert main(harness.args(mixture, finished_copy)) == 0
    assert "already complete" in capsys.readouterr().out
    assert _snapshot(finished_copy) == before

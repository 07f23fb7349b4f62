"""A global batch the torchrun world size cannot split stops the trainer before it joins a
process group or writes anything: one line on stderr, exit status 2, no run dir. The bad input
both trainers refuse alike (an unknown key, another spec's checkpoint, a changed mixture, a
finished run restarted) is the root tests/test_trainer_contract.py."""

from __future__ import annotations


def test_global_batch_the_world_size_cannot_divide(harness, mixture, tmp_path, capsys, monkeypatch):
    # torchrun's environment for rank 0 of 3: the layout is refused before joining any group.
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    harness.refused(capsys, harness.args(mixture, run_dir), "16 sequences", "3 data-parallel")
    assert not run_dir.exists()

"""Checks on a trainer CLI's exit, shared by the cross-package tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from olmo_run.checkpoints import checkpoint_dir, complete_checkpoints
from olmo_run.metrics import read_metrics


def refused(main: Callable[[list[str]], int], capsys, args: list[str], *needles: str) -> str:
    """``main(args)`` exits 2 with exactly one stderr line holding every needle; returns it."""
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def train_losses(run: Path) -> dict[int, float]:
    """The run's train losses by step; a step logged twice fails here."""
    lines = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert len(lines) == len({r["step"] for r in lines}), "a step logged twice"
    return {r["step"]: r["loss"] for r in lines}


def full_disk_then_rerun(
    main: Callable[[list[str]], int], prog: str, args: list[str], run: Path, capsys, monkeypatch, fail_at: int
) -> None:
    """With the step-``fail_at`` checkpoint write failing for a full disk (the caller's
    monkeypatches; checkpoints every 2 steps of 6): exit 5 and exactly one stderr line naming
    that checkpoint, "No space left on device" and the checkpoint that stays the latest; no
    train line past it; its partial folder left without meta.json. Then, the fault removed
    (``monkeypatch.undo``): the rerun removes that folder, resumes from the one before, logs each
    step once, and the re-trained steps are bitwise the failed run's."""
    capsys.readouterr()
    assert main(args) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"{prog}: error: saving checkpoint "), err[0]
    assert str(checkpoint_dir(run, fail_at)) in err[0] and "No space left on device" in err[0], err[0]
    before = fail_at - 2
    assert f"step_{before:08d} stays the latest checkpoint" in err[0], err[0]
    failed = train_losses(run)
    assert sorted(failed) == list(range(1, fail_at + 1))
    assert [s for s, _ in complete_checkpoints(run)] == [before]
    partial = checkpoint_dir(run, fail_at)
    assert partial.is_dir() and not (partial / "meta.json").exists()

    monkeypatch.undo()  # the disk has room again
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"removed {partial}: no meta.json" in out
    assert f"resumed from {checkpoint_dir(run, before)} at step {before}" in out
    again = train_losses(run)
    assert sorted(again) == list(range(1, 7))
    assert [again[s] for s in range(1, fail_at + 1)] == [failed[s] for s in range(1, fail_at + 1)]  # bitwise
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4, 6]

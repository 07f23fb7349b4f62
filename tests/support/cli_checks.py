"""Checks on a trainer CLI's exit, shared by the cross-package tests."""

from __future__ import annotations

from collections.abc import Callable


def refused(main: Callable[[list[str]], int], capsys, args: list[str], *needles: str) -> str:
    """``main(args)`` exits 2 with exactly one stderr line holding every needle; returns it."""
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err

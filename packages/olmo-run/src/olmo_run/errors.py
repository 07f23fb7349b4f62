"""The errors a run stops with (the CLIs map each to an exit status, ``olmo_run.cli``), and
``loud``, the one-line warning nobody may miss."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class TrainingStateError(ValueError):
    """A checkpoint that does not fit this run (another spec, framework or mixture)."""


class TrainingDivergedError(RuntimeError):
    """The run cannot go on: a non-finite loss, grad norm, parameter or moment, or more skipped
    steps in a row than the spike guard allows. Raised before any checkpoint of that state is
    written, so the newest checkpoint is the last good state; the CLIs exit with status 3."""


class RunDirWriteError(RuntimeError):
    """A write into the run dir failed mid-run (a full disk, a quota, an I/O error): the run
    stops at once with one line naming the file, the OS's reason and the fix, and the newest
    complete checkpoint stays the one a rerun resumes from; the CLIs exit with status 5."""


class CheckpointWriteError(RunDirWriteError):
    """A checkpoint could not be written or committed. It has no meta.json, so resume ignores
    it, and the next start removes what it left (``clean_orphans``)."""


class CheckpointDamagedError(TrainingStateError):
    """A checkpoint whose files are not the ones it was committed with, or whose meta.json cannot
    be read; ``checkpoint.fallback`` resumes from an older one instead."""


def loud(text: str) -> None:
    """A warning nobody may miss: one line, starting with "!!!", logged as a warning (the
    terminal shows warnings on stderr)."""
    log.warning(f"!!! {text}")

"""The one-line error for a run-dir write that failed mid-run (a full disk, a quota, an I/O
error): the file, the OS's reason, the room left, the checkpoint a rerun resumes from and the fix."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import TypeVar

from olmo_data.fileio import URLPath

from .checkpoints import complete_checkpoints
from .errors import CheckpointWriteError, RunDirWriteError
from .run_dir import RunPath

# TensorStore (Orbax's array writer) reports a failed system call as a ValueError whose text
# carries the errno ("... No space left on device [os_error_code='28']"), not as an OSError.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
# The reasons whose fix is room on the file system: none left, or the quota used up.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_WriteError = TypeVar("_WriteError", bound=RunDirWriteError)


def _exception_chain(errors: tuple[BaseException, ...]) -> list[BaseException]:
    """Each exception, then what it was raised from or during (__cause__, __context__), once each."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = list(errors)
    while todo:
        err = todo.pop(0)
        if err is not None and not any(err is s for s in seen):
            seen.append(err)
            todo += [err.__cause__, err.__context__]
    return seen


def os_error_code(*errors: BaseException) -> int | None:
    """The errno of the failed system call behind ``errors``: an OSError anywhere in their
    __cause__ / __context__ chains, or TensorStore's ``os_error_code`` in an exception's text."""
    for err in _exception_chain(errors):
        if isinstance(err, OSError) and err.errno:
            return err.errno
        if (found := _OS_ERROR_CODE.search(str(err))) is not None:
            return int(found[1])
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _free_space(path: RunPath) -> str:
    """The room left where ``path`` is, as " (N MiB free there)", for a local path (its nearest
    existing folder); "" for a URL."""
    if isinstance(path, URLPath):
        return ""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f" ({_size(shutil.disk_usage(folder).free)} free there)"
    except OSError:
        return ""


def write_failure(
    kind: type[_WriteError],
    doing: str,
    target: RunPath,
    run_dir: RunPath,
    code: int | None,
    reason: str | None = None,
    after: str = "",
) -> _WriteError:
    """The one-line error for a write of ``target`` that failed (``doing``: "saving checkpoint",
    "appending to"): the reason (``reason``, else the OS's words for the errno ``code``, such as
    "No space left on device" for ENOSPC), the room left there, the checkpoint a rerun resumes
    from and the fix, then ``after``."""
    reason = reason or (os.strerror(code) if code is not None else "an unknown failure")
    try:
        done: list[tuple[int, RunPath]] | None = complete_checkpoints(run_dir)
    except Exception:  # the listing may fail as the write did: the line then names no step
        done = None
    fix = "free space there (or lower checkpoint.keep)" if code in _NO_ROOM else "fix that"
    if done is None:
        latest = f"{fix}, then rerun to resume from the newest complete checkpoint"
    elif done:
        latest = f"{done[-1][1].name} stays the latest checkpoint: {fix}, then rerun to resume from it"
    else:
        latest = f"no checkpoint was committed yet: {fix}, then rerun to start again"
    return kind(f"{doing} {target} failed: {reason}{_free_space(target)}; {latest}{after}")


def checkpoint_write_failure(
    ckpt: RunPath, run_dir: RunPath, code: int | None, reason: str | None = None
) -> CheckpointWriteError:
    """``write_failure`` for a checkpoint that could not be saved or committed (no meta.json)."""
    after = f" (the unfinished {ckpt.name} is removed when it starts)"
    return write_failure(CheckpointWriteError, "saving checkpoint", ckpt, run_dir, code, reason, after)

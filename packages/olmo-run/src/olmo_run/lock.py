"""One live run per run dir: ``RUN_LOCK``, taken by the main process in ``olmo_run.driver.run``.

Two runs writing one run dir (a Slurm requeue or a second launch while the first job still
lives) would interleave metrics.jsonl and checkpoints, and one's keep-N pruning would delete the
other's checkpoints, with nothing to show for it. So before its first write the main process
takes ``<run dir>/RUN_LOCK``, a small JSON record::

    {"host", "pid", "started", "heartbeat", "token", "argv"}   # times in UTC, ISO 8601

- A local run dir: the file is created with ``O_CREAT | O_EXCL``, so of two starts exactly
  one creates it.
- A ``gs://`` / ``s3://`` run dir: through ``olmo_data.fileio``, the record is
  written and read back, and the token must be ours. The stores have no create-if-absent
  here, so this is best effort: two starts within one round trip of each other can both
  believe they hold it. The heartbeat check below catches that within one interval.
- A lock someone else holds is a one-line `RunLockError` (a RecipeError: exit status 2),
  naming the run dir, its holder (host, pid, start) and the fix, with nothing written.
- A stale lock is taken over, with one stdout line: the same host and its pid is not alive
  (a SIGKILLed run, rerun at once), or its heartbeat is older than `STALE_S` (a host that
  died, whatever host it was). Other hosts' clocks are trusted to within that margin.
- The holder refreshes the heartbeat (`RunLock.refresh`, at most every `HEARTBEAT_S`): one
  small write, after reading the lock back, from a daemon thread (`RunLock.start`, so that a
  long phase without steps, restoring and compiling a large model, keeps it fresh) and from
  the driver loop. When the token read back is not ours, another run took the lock over (this
  one was silent longer than `STALE_S`, or lost a race on object storage) and this run stops
  with a `RunLockError` at its next step instead of going on writing beside it.
- `RunLock.release` deletes the lock if it is still ours (a normal end, an error, Ctrl-C;
  the driver's ``finally``). A SIGKILL leaves it, which is what the stale rules are for.
- A lock file that does not parse is refused as held (the message names the file to delete).
- Only the main process takes it; the others never read it nor wait on it. A refusal stops
  process 0 before it writes; in a multi-process job the others stop as they do for any
  error of process 0 alone at start-up (their first collective fails, or the launcher ends them).

Tests shorten `HEARTBEAT_S` and `STALE_S` with ``monkeypatch.setattr`` on this module; both
are read at each use.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from olmo_data import fileio
from olmo_data.fileio import StorageError
from olmo_run.checkpoints import pid_alive
from olmo_run.recipe import RecipeError
from olmo_run.run_dir import RunPath

log = logging.getLogger(__name__)

RUN_LOCK_FILE = "RUN_LOCK"
# Seconds between the holder's heartbeat writes (the driver loop calls refresh every step).
HEARTBEAT_S = 60.0
# Seconds without a heartbeat after which a lock counts as abandoned, whatever its host.
STALE_S = 600.0
# Attempts at taking a lock that keeps changing under us (stale, then taken by another start).
_ATTEMPTS = 3


class RunLockError(RecipeError):
    """The run dir is another live run's, or this run lost its lock to another run."""


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(moment: datetime) -> str:
    return moment.isoformat()


def _read(path: RunPath) -> dict[str, Any] | None:
    """The lock's record; None when there is no lock. A file that does not parse (being
    written this instant, or damaged) is a record of its own, held by nobody known."""
    try:
        raw = fileio.read_bytes(path)
    except FileNotFoundError:  # fileio's StorageNotFoundError is one too
        return None
    try:
        record = json.loads(raw)
        if isinstance(record, dict):
            return record
    except ValueError:
        pass
    return {"unreadable": raw[:200].decode(errors="replace")}


def _stale(record: dict[str, Any], host: str) -> str | None:
    """Why the lock ``record`` may be taken over ("dead" or "silent"), or None while it holds."""
    if "unreadable" in record:
        return None
    try:
        beat = datetime.fromisoformat(str(record["heartbeat"]))
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    if beat.tzinfo is None:  # written by hand without a zone: UTC, as this module writes
        beat = beat.replace(tzinfo=UTC)
    if record.get("host") == host and pid != os.getpid() and not pid_alive(pid):
        return "dead"
    if _now() - beat > timedelta(seconds=STALE_S):
        return "silent"
    return None


def _refusal(path: RunPath, record: dict[str, Any]) -> RunLockError:
    if "unreadable" in record:
        holder = f"an unreadable {RUN_LOCK_FILE} ({record['unreadable']!r})"
    else:
        holder = (
            f"a live run holds it (host {record.get('host')}, pid {record.get('pid')}, "
            f"started {record.get('started')}, last heartbeat {record.get('heartbeat')})"
        )
    return RunLockError(f"run_dir={path.parent}: {holder}; stop that run, or delete {path} if that run is gone")


def _create_local(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` if nothing is there (atomically); False if something is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


@dataclass
class RunLock:
    """The lock this process holds (``acquire``'s result)."""

    path: RunPath
    record: dict[str, Any]
    last_beat: float = field(default_factory=time.monotonic)
    lost: RunLockError | None = None  # set by the heartbeat thread, raised by the next refresh
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def token(self) -> str:
        return str(self.record["token"])

    def start(self) -> None:
        """Refresh from a daemon thread as well, every `HEARTBEAT_S` (at least 1 s apart) until
        ``release``; a lock lost meanwhile is raised by the loop's next ``refresh``."""

        def beat() -> None:
            while not self._stop.wait(max(HEARTBEAT_S, 1.0)):
                try:
                    self.refresh()
                except RunLockError as err:
                    self.lost = err
                    return

        self._thread = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def refresh(self, force: bool = False) -> None:
        """Write a new heartbeat when `HEARTBEAT_S` has passed since the last (or ``force``).
        Raises RunLockError when the lock read back is another run's. A storage failure is a
        warning line and a retry at the next interval: a network blip does not stop the run."""
        if self.lost is not None:
            raise self.lost
        with self._guard:
            self._refresh(force)

    def _refresh(self, force: bool) -> None:
        if not force and time.monotonic() - self.last_beat < HEARTBEAT_S:
            return
        self.last_beat = time.monotonic()
        try:
            held = _read(self.path)
            if held is not None and held.get("token") != self.token:
                raise RunLockError(
                    f"run_dir={self.path.parent}: another run took over this run's lock "
                    f"(host {held.get('host')}, pid {held.get('pid')}, started {held.get('started')}); "
                    "this run stops so that two runs never write one run dir"
                )
            self.record["heartbeat"] = _iso(_now())
            fileio.write_text(self.path, json.dumps(self.record))  # also restores a deleted lock
        except (OSError, StorageError) as err:
            log.info(f"warning: {self.path}: heartbeat not written ({err}); retrying in {HEARTBEAT_S:.0f} s")

    def release(self) -> None:
        """Delete the lock if it is still ours; a failure is one warning line, never an error
        that would hide the one the run is ending with."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)  # one refresh in flight at most
        try:
            with self._guard:
                held = _read(self.path)
                if held is not None and held.get("token") == self.token:
                    fileio.delete(self.path)
        except Exception as err:
            # INFO: with the run's lines on stdout; stderr keeps the one line of the error the run ends with
            log.info(f"warning: {self.path}: run-dir lock not released ({err}); delete it by hand")


def acquire(run_dir: RunPath, argv: list[str] | None = None) -> RunLock:
    """Take ``run_dir``'s lock (creating the run dir if needed), taking over a stale one with
    one stdout line; a live one is a RunLockError with nothing written."""
    path = run_dir / RUN_LOCK_FILE
    host = socket.gethostname()
    started = _iso(_now())
    record = {
        "host": host,
        "pid": os.getpid(),
        "started": started,
        "heartbeat": started,
        "token": secrets.token_hex(16),
        "argv": list(sys.argv if argv is None else argv),
    }
    text = json.dumps(record)
    for _ in range(_ATTEMPTS):
        held = _read(path)
        took_over = ""
        if held is not None:
            why = _stale(held, host)
            if why is None:
                raise _refusal(path, held)
            took_over = (
                f"took over the run-dir lock of pid {held.get('pid')} on host {held.get('host')}, "
                f"{why} since {held.get('heartbeat')} ({path})"
            )
        if isinstance(path, Path):
            if held is not None:
                # Remove the stale lock only if it is still the one judged stale (this narrows
                # the race between two restarts that both judged it; the loser's create fails).
                if _read(path) != held:
                    continue
                fileio.delete(path)
            fileio.makedirs(run_dir)
            if not _create_local(path, text):
                continue  # another start created it first: judge that one
        else:
            fileio.write_text(path, text)
        back = _read(path)
        if back is None:
            continue
        if back.get("token") != record["token"]:
            raise _refusal(path, back)
        if took_over:
            log.info(took_over)
        return RunLock(path, record)
    held = _read(path)
    raise _refusal(path, held if held is not None else {"unreadable": "it kept changing during this start"})

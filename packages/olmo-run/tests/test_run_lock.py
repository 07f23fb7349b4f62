"""The run-dir lock (``olmo_run.lock``): one live run per run dir.

A live holder is a real process (a child that takes the lock with ``acquire`` and sleeps); a
dead one is a child that has exited, its pid written into the lock. The driver runs use
test_driver.py's numpy module, whose steps look at the lock while the run holds it. The URL
branch runs against the moto S3 emulator (tests/support/object_store.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_run import lock, read_inputs, resolve_run, run
from olmo_run.checkpoints import complete_checkpoints
from olmo_run.cli import INPUT_ERRORS, run_cli
from olmo_run.lock import RUN_LOCK_FILE, RunLockError, acquire
from olmo_run.terminal import show_on_terminal

pytest_plugins = ["object_store"]

# test_driver.py's numpy module, mixture and recipe (importlib mode puts no test folder on sys.path).
_spec = importlib.util.spec_from_file_location("olmo_run_test_driver", Path(__file__).with_name("test_driver.py"))
assert _spec is not None and _spec.loader is not None
driver_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver_tests)
NumpyModule, recipe_for, write_mixture = driver_tests.NumpyModule, driver_tests.recipe_for, driver_tests.write_mixture

HOST = socket.gethostname()
HOLD = (
    "import sys, time; from pathlib import Path; from olmo_run.lock import acquire; "
    "acquire(Path(sys.argv[1]), ['holder']); print('held', flush=True); time.sleep(120)"
)


@pytest.fixture(autouse=True)
def terminal() -> None:
    show_on_terminal()  # olmo_run's log lines reach the captured stdout / stderr, as under the CLI


@pytest.fixture
def mixture(tmp_path) -> Path:
    (tmp_path / "mix").mkdir()
    return write_mixture(tmp_path / "mix")


@pytest.fixture
def holder(tmp_path):
    """Start a process holding a run dir's lock: ``holder(run_dir) -> Popen``; killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(run_dir: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under ``folder``: a file's sha256 and mtime, a folder's mtime."""
    out = {".": f"dir {folder.stat().st_mtime_ns}"}
    for p in sorted(folder.rglob("*")):
        kind = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        out[str(p.relative_to(folder))] = f"{kind} {p.stat().st_mtime_ns}"
    return out


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_lock(run_dir: Path, *, host: str, pid: int, age_s: float) -> dict:
    beat = (datetime.now(UTC) - timedelta(seconds=age_s)).isoformat()
    record = {"host": host, "pid": pid, "started": beat, "heartbeat": beat, "token": "ab" * 16, "argv": ["old"]}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_LOCK_FILE).write_text(json.dumps(record))
    return record


class LockWatcher(NumpyModule):
    """The numpy module, reading the lock file at every step (and optionally replacing it)."""

    def __init__(self, plan, seen: list[dict], steal_at: int | None = None, interrupt_at: int | None = None):
        super().__init__(plan, [], fail_at=None)
        self.seen, self.steal_at, self.interrupt_at = seen, steal_at, interrupt_at

    def train_step(self, batch, step, lr, guard, metrics):
        path = self.plan.run_dir / RUN_LOCK_FILE
        self.seen.append(json.loads(path.read_text()))
        if step == self.steal_at:  # another run takes the lock over
            path.write_text(json.dumps({**self.seen[-1], "pid": 1, "token": "cd" * 16}))
        if step == self.interrupt_at:
            raise KeyboardInterrupt
        super().train_step(batch, step, lr, guard, metrics)


def go(recipe, module=NumpyModule, **module_args) -> Path:
    plan = resolve_run(read_inputs(recipe), "numpy", loader_ranks=(0, 1), dp_size=2)
    return run(plan, lambda: module(plan, **module_args), is_main=True, describe=[], title="test")


def test_a_live_holder_refuses_with_one_line_and_nothing_written(mixture, tmp_path, holder, capsys):
    run_dir = tmp_path / "run"
    go(recipe_for(mixture, run_dir), calls=[])
    assert not (run_dir / RUN_LOCK_FILE).exists()  # released at the end
    proc = holder(run_dir)
    held = json.loads((run_dir / RUN_LOCK_FILE).read_text())
    assert (held["host"], held["pid"], held["argv"]) == (HOST, proc.pid, ["holder"])
    before = snapshot(run_dir)
    capsys.readouterr()
    # A longer run of the same recipe (a resume from step 6), through the CLI's error path.
    longer = recipe_for(mixture, run_dir, "--train.steps=8")
    status = run_cli("olmo-train-x", None, [], lambda: lambda _: go(longer, calls=[]), INPUT_ERRORS)
    out, err = capsys.readouterr()
    # resolve_run's note on the longer schedule, then nothing from the driver.
    assert status == 2 and out.startswith("train.steps: 6 -> 8") and len(out.splitlines()) == 1, out
    assert err == (
        f"olmo-train-x: error: run_dir={run_dir}: a live run holds it (host {HOST}, pid {proc.pid}, "
        f"started {held['started']}, last heartbeat {held['heartbeat']}); stop that run, "
        f"or delete {run_dir / RUN_LOCK_FILE} if that run is gone\n"
    )
    assert snapshot(run_dir) == before
    assert [s for s, _ in complete_checkpoints(run_dir)] == [4, 6]


def test_a_dead_pid_on_this_host_is_taken_over_at_once(tmp_path, capsys):
    run_dir = tmp_path / "run"
    pid = dead_pid()
    old = write_lock(run_dir, host=HOST, pid=pid, age_s=5)
    taken = acquire(run_dir, ["new"])
    assert capsys.readouterr().out == (
        f"took over the run-dir lock of pid {pid} on host {HOST}, dead since {old['heartbeat']} "
        f"({run_dir / RUN_LOCK_FILE})\n"
    )
    now = json.loads((run_dir / RUN_LOCK_FILE).read_text())
    assert now == taken.record and now["pid"] == os.getpid() and now["token"] != old["token"]
    assert now["argv"] == ["new"] and now["started"] == now["heartbeat"]
    taken.release()
    assert list(run_dir.iterdir()) == []


def test_another_host_is_refused_while_its_heartbeat_is_fresh_and_taken_over_after(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # pid 1 is alive here, and on another host it would not be looked at anyway.
    fresh = write_lock(run_dir, host="other-host", pid=1, age_s=lock.STALE_S - 60)
    with pytest.raises(RunLockError, match=r"a live run holds it \(host other-host, pid 1, started"):
        acquire(run_dir)
    assert json.loads((run_dir / RUN_LOCK_FILE).read_text()) == fresh
    old = write_lock(run_dir, host="other-host", pid=1, age_s=lock.STALE_S + 60)
    taken = acquire(run_dir)
    assert capsys.readouterr().out.startswith(
        f"took over the run-dir lock of pid 1 on host other-host, silent since {old['heartbeat']} "
    )
    assert json.loads((run_dir / RUN_LOCK_FILE).read_text())["token"] == taken.token
    taken.release()
    # The same host and a live pid, but silent past the timeout: taken over too.
    write_lock(run_dir, host=HOST, pid=1, age_s=lock.STALE_S + 60)
    acquire(run_dir).release()


def test_released_at_the_end_on_an_exception_and_on_ctrl_c(mixture, tmp_path):
    for name, raises, args in (
        ("ok", None, {}),
        ("failed", RuntimeError, {"fail_at": 3}),
    ):
        run_dir = tmp_path / name
        calls: list[str] = []
        recipe = recipe_for(mixture, run_dir)
        if raises is None:
            go(recipe, calls=calls, **args)
        else:
            with pytest.raises(raises):
                go(recipe, calls=calls, **args)
        assert not (run_dir / RUN_LOCK_FILE).exists(), name
    seen: list[dict] = []
    with pytest.raises(KeyboardInterrupt):
        go(recipe_for(mixture, tmp_path / "ctrl-c"), LockWatcher, seen=seen, interrupt_at=2)
    assert [r["pid"] for r in seen] == [os.getpid()] * 2  # held while it ran
    assert not (tmp_path / "ctrl-c" / RUN_LOCK_FILE).exists()
    # A finished run dir holds what it held before the lock existed.
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == [
        "checkpoints",
        "loss.png",
        "metrics.jsonl",
        "recipe.yaml",
        "spec.json",
    ]


def test_the_heartbeat_advances_every_interval_and_a_stolen_lock_stops_the_run(mixture, tmp_path, monkeypatch):
    seen: list[dict] = []
    go(recipe_for(mixture, tmp_path / "default"), LockWatcher, seen=seen)
    # A 60 s interval: no heartbeat is due during this short run; every step sees the first one.
    assert len({r["heartbeat"] for r in seen}) == 1 and len({r["token"] for r in seen}) == 1

    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.0)
    seen = []
    go(recipe_for(mixture, tmp_path / "every-step"), LockWatcher, seen=seen)
    beats = [datetime.fromisoformat(r["heartbeat"]) for r in seen]
    assert len(beats) == 6 and all(a < b for a, b in zip(beats, beats[1:], strict=False)), beats
    assert len({(r["started"], r["token"], r["pid"]) for r in seen}) == 1

    seen = []
    with pytest.raises(RunLockError, match=r"another run took over this run's lock \(host .*, pid 1,"):
        go(recipe_for(mixture, tmp_path / "stolen"), LockWatcher, seen=seen, steal_at=3)
    assert len(seen) == 3  # stopped at the refresh after step 3
    # The other run's lock is left in place.
    assert json.loads((tmp_path / "stolen" / RUN_LOCK_FILE).read_text())["token"] == "cd" * 16


def test_the_heartbeat_thread_keeps_a_stepless_phase_fresh_and_reports_a_lost_lock(tmp_path, monkeypatch):
    # Interval 0: the thread's floor of 1 s between refreshes applies.
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.0)
    held = acquire(tmp_path / "run", ["slow-restore"])
    path = tmp_path / "run" / RUN_LOCK_FILE
    first = json.loads(path.read_text())["heartbeat"]
    held.start()
    deadline = time.monotonic() + 10
    while json.loads(path.read_text())["heartbeat"] == first and time.monotonic() < deadline:
        time.sleep(0.1)  # no refresh call from here: only the thread writes
    assert json.loads(path.read_text())["heartbeat"] > first
    held.release()
    assert held._thread is not None and not held._thread.is_alive() and not path.exists()

    held = acquire(tmp_path / "stolen", ["slow-restore"])
    held.start()
    stolen = {**held.record, "pid": 1, "token": "cd" * 16}
    (tmp_path / "stolen" / RUN_LOCK_FILE).write_text(json.dumps(stolen))
    deadline = time.monotonic() + 10
    while held.lost is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(RunLockError, match="another run took over this run's lock"):
        held.refresh()  # the loop's next step learns what the thread found
    held.release()  # not ours: left in place
    assert json.loads((tmp_path / "stolen" / RUN_LOCK_FILE).read_text())["token"] == "cd" * 16


def test_a_url_run_dir(s3_store, capsys):
    run_dir = URLPath(s3_store.url("runs/a"))
    url = str(run_dir / RUN_LOCK_FILE)
    first = acquire(run_dir, ["first"])
    assert json.loads(fileio.read_bytes(url)) == first.record
    with pytest.raises(RunLockError, match=rf"run_dir={run_dir}: a live run holds it \(host {HOST}, pid {os.getpid()}"):
        acquire(run_dir)  # this process's own pid counts as alive
    first.refresh(force=True)
    assert json.loads(fileio.read_bytes(url))["heartbeat"] > first.record["started"]
    first.release()
    assert not fileio.exists(url)

    pid = dead_pid()
    beat = datetime.now(UTC).isoformat()
    fileio.write_text(url, json.dumps({"host": HOST, "pid": pid, "started": beat, "heartbeat": beat, "token": "ef"}))
    second = acquire(run_dir)
    assert f"took over the run-dir lock of pid {pid} on host {HOST}, dead since {beat}" in capsys.readouterr().out
    assert json.loads(fileio.read_bytes(url))["token"] == second.token
    second.release()
    assert not fileio.exists(url)

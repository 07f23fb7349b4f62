"""Start the ranks of a gloo test as fresh processes, whatever the pytest worker ran before.

A rank forked from the pytest worker inherits everything the worker did: autograd's worker
threads (torch refuses fork-based multiprocessing after a backward), and DTensor's cached
meshes of an earlier dry run (a forked rank then placed every shard as rank 0). Here the ranks
come from multiprocessing's fork server instead: a process started clean once per pytest
worker, which imports torch and the trainer once and forks each rank from that clean state.

The test module itself is not importable by name under ``--import-mode=importlib``, so a rank
loads it from its file and calls the named function: ``start_ranks(fn, n, *args)`` runs
``fn(rank, port, *args)`` in ``n`` processes (each gets its own copy of ``args``) and raises
if any fails.

``run_cli_forked(framework, args, nproc)`` runs a trainer's real entry point (``cli.main``)
the same way, forked with the framework and the trainer already imported, which is most of a
tiny CPU run's start-up (several seconds per process). torch: one process, or ``nproc`` ranks
with the environment torchrun gives them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and,
like torchrun, the first rank to fail stops the others. JAX: one process; the fork server
imports JAX without starting a backend, so the child's ``XLA_FLAGS`` (its simulated device
count) still apply, while other ``JAX_*`` settings are the fork server's (JAX reads them at
import). Each run is its own process, so clients a run creates (object-storage clients and
their settings from the environment) are that run's, as in a launched one.

``start_forked(fn, *args, env=, out=)`` / ``run_forked`` run any module-level function of a
test file that way, with exactly ``env`` as its environment (the JAX multi-process jobs: each
process's coordinator or Slurm variables are read when the trainer starts JAX, not at import).

The tests that are about the launch itself keep real launchers: the contract's elastic test
(torchrun) and the JAX run-dir test whose second process runs in a mount namespace of its own.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

# Imported once by the fork server, so that each rank starts with them loaded.
PRELOAD = [
    "ranks",
    "kill_after_checkpoint",
    "kill_during_checkpoint",
    "signal_at_step",
    "torch",
    "torch.distributed",
    "olmo_train_torch.train",
    "olmo_train_torch.checkpoint",
    "olmo_train_torch.cli",
    "olmo_train_jax.train",
    "olmo_train_jax.checkpoint",
    "olmo_train_jax.cli",
    "matplotlib.pyplot",  # every run ends with its loss plot (olmo_run.metrics.plot_loss)
]

_loaded: dict[str, ModuleType] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module(file: str) -> ModuleType:
    if file not in _loaded:
        name = f"_ranks_{len(_loaded)}"
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec and spec.loader, file
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        spec.loader.exec_module(module)
        _loaded[file] = module
    return _loaded[file]


def _entry(rank: int, file: str, name: str, port: int, args: tuple[Any, ...]) -> None:
    # torch's pickler hands tensors over in shared memory: without a private copy, every rank
    # would update the same parameters (a forked rank had copy-on-write pages of its own).
    getattr(_module(file), name)(rank, port, *copy.deepcopy(args))


def start_ranks(fn: Callable[..., None], nprocs: int, *args: Any) -> None:
    """``fn(rank, port, *args)`` on ranks 0..nprocs-1, each a fresh process; ``port`` is a free
    127.0.0.1 port for the process group's rendezvous. ``fn`` must be a module-level function."""
    import torch.multiprocessing as mp

    # The fork server takes the preload list and this process's sys.path when it starts (once).
    multiprocessing.set_forkserver_preload(PRELOAD)
    file = inspect.getfile(fn)
    mp.start_processes(
        _entry,
        args=(file, fn.__name__, free_port(), args),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


def _as_child(env: Mapping[str, str], out: str, err: str) -> None:
    """A forked child's set-up: exactly ``env`` as its environment, no stdin, stdout and stderr
    to the files ``out`` and ``err`` (one file when they are the same path)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for path, fds in [(out, (1, 2))] if out == err else [(out, (1,)), (err, (2,))]:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd in fds:
            os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)


def _cli_entry(
    framework: str,
    argv: list[str],
    env: dict[str, str],
    kill_after: int | None,
    out: str,
    err: str,
    kill_during: int | None = None,
    signal_at: int | None = None,
) -> None:
    """One process of ``run_cli_forked``: this run's environment, stdout/stderr to files, the CLI."""
    _as_child(env, out, err)
    if framework == "torch" and env.get("OMP_NUM_THREADS"):
        import torch  # read OMP_NUM_THREADS at import, in the fork server: apply it here

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if kill_after is not None:
        import kill_after_checkpoint

        kill_after_checkpoint.install(framework, kill_after)
    if kill_during is not None:
        import kill_during_checkpoint

        kill_during_checkpoint.install(framework, kill_during)
    if signal_at is not None:
        import signal_at_step

        signal_at_step.install(signal_at)
    sys.exit(importlib.import_module(f"olmo_train_{framework}.cli").main(argv))


def _call_entry(file: str, name: str, env: dict[str, str], out: str, err: str, args: tuple[Any, ...]) -> None:
    """The child of ``start_forked``: set up as ``_as_child`` says, then exit with ``fn(*args)``."""
    _as_child(env, out, err)
    sys.exit(getattr(_module(file), name)(*args))


def start_forked(
    fn: Callable[..., Any], *args: Any, env: Mapping[str, str], out: Path, err: Path | None = None
) -> multiprocessing.process.BaseProcess:
    """Start ``fn(*args)`` (a module-level function of a test file, loaded in the child by path)
    in a child of the fork server: the framework and the trainers imported, no JAX backend
    started, so the child's ``XLA_FLAGS`` and the variables JAX or the trainer read when they
    start (a coordinator, Slurm's) still apply. ``env`` is the child's whole environment; its
    stdout and stderr go to ``out`` and ``err`` (``out`` when not given). Returns the started
    process: its exit code is what ``fn`` returned, 1 for an exception, minus the signal for a
    signal. A forked child leaves with ``os._exit``, past ``atexit``: what ``fn`` needs done at
    exit (``jax.distributed.shutdown``) it does itself."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    call = (inspect.getfile(fn), fn.__name__, dict(env), str(out), str(err or out), args)
    proc = multiprocessing.get_context("forkserver").Process(target=_call_entry, args=call)
    proc.start()
    return proc


def run_forked(
    fn: Callable[..., Any],
    *args: Any,
    env: Mapping[str, str],
    out: Path,
    err: Path | None = None,
    timeout: float = 900,
) -> int:
    """``start_forked`` and wait: the child's exit code (``TimeoutExpired`` after ``timeout`` s)."""
    proc = start_forked(fn, *args, env=env, out=out, err=err)
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise subprocess.TimeoutExpired(fn.__name__, timeout)
    return proc.exitcode


def run_cli_forked(
    framework: str,
    args: list[str],
    nproc: int = 1,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    kill_after: int | None = None,
    kill_during: int | None = None,
    signal_at: int | None = None,
) -> subprocess.CompletedProcess:
    """``olmo-train-{framework} ARGS`` as one process or ``nproc`` torch ranks (the module docstring);
    with ``kill_after`` each rank SIGKILLs itself right after the step-N checkpoint commits
    (tests/support/kill_after_checkpoint.py), with ``kill_during`` right before it commits, all
    its files written (tests/support/kill_during_checkpoint.py), with ``signal_at`` rank 0 gets
    SIGTERM while step N is in flight (tests/support/signal_at_step.py). Returns what
    ``subprocess.run`` would: the exit status of the one process (negative for a signal), or
    torchrun's (0, or 1 when a rank failed), and every rank's stdout and stderr, rank 0 first."""
    assert framework in ("jax", "torch") and (framework == "torch" or nproc == 1), (framework, nproc)
    assert kill_after is None or kill_during is None, (kill_after, kill_during)
    multiprocessing.set_forkserver_preload(PRELOAD)
    ctx = multiprocessing.get_context("forkserver")
    base = {**os.environ, **(env or {})}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="torch-cli-") as tmp:
        procs, files = [], []
        for rank in range(nproc):
            rank_env = dict(base)
            if nproc > 1:
                rank_env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                    GROUP_RANK="0",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            out, err = os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")
            proc = ctx.Process(
                target=_cli_entry,
                args=(framework, list(args), rank_env, kill_after, out, err, kill_during, signal_at),
            )
            proc.start()
            procs.append(proc)
            files.append((out, err))
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(1.0)  # torchrun's monitor interval: then it stops the rest
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                for p in procs:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
                break
            if time.monotonic() > deadline:
                timed_out = True
                for p in procs:
                    p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.join()

        def read(path: str) -> str:  # absent when a rank died before its entry ran
            return open(path, errors="replace").read() if os.path.exists(path) else ""

        stdout = "".join(read(out) for out, _ in files)
        stderr = "".join(read(err) for _, err in files)
    argv = [f"olmo-train-{framework}", *args]
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
    codes = [p.exitcode for p in procs]
    if nproc == 1:
        code = codes[0]
    else:
        code = 0 if all(c == 0 for c in codes) else 1
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def run_cli_launched(
    framework: str,
    args: list[str],
    ranks: int = 1,
    *,
    entry: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """``olmo-train-torch ARGS`` the way a user launches it, for the test about the launch itself
    (the contract's elastic test): one ``python -m`` process, or ``ranks`` processes under
    torchrun (gloo), one intra-op thread each. ``entry`` replaces ``-m olmo_train_torch`` (a
    test-only entry point: a script and its own arguments)."""
    assert framework == "torch", "a JAX run launched for real: test_multihost's Job(launched=True)"
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", **(env or {})}
    main = entry if entry is not None else ["-m", "olmo_train_torch"]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, *main, *args]
    return subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=timeout)

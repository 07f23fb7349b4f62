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
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import multiprocessing
import socket
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

# Imported once by the fork server, so that each rank starts with them loaded.
PRELOAD = ["ranks", "torch", "torch.distributed", "olmo_train_torch.train"]

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

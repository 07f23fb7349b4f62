"""Checkpoints of the torch trainer: torch.distributed.checkpoint (DCP) + the shared meta.json.

Layout of one checkpoint (``olmo_run.checkpoints`` owns the run dir around it)::

    RUN/checkpoints/step_00000010/
        .metadata, __0_0.distcp, ...   DCP: {"model": ..., "optim": ...}, one file per rank
        meta.json                      step, loader state, recipe, spec, spike guard, RNG, and
                                       the size and sha256 of every other file ("files"; written
                                       last: its presence marks the checkpoint complete)

Model and optimizer go through ``get_state_dict`` / ``set_state_dict``, so the stored keys
are the plain module names whatever the wrapper (FSDP2, HSDP, DDP, none, activation
checkpointing, compile), and DCP reshards on load: a checkpoint from 4 ranks resumes on 2,
or on one process without a process group. With ``optim.sharded`` the same keys hold the fp32
master weights and moments, each a DTensor block of the full tensor
(``ShardedAdamW.checkpoint_state``): such a checkpoint resumes on FSDP2, plain DDP or another
data-parallel size, and theirs on it.

With ``checkpoint.async_save`` the state is staged to CPU memory before ``save`` returns
and written by a background thread (over its own gloo group, so its collectives never
interleave with training's); rank 0 writes meta.json only when that write has finished,
hashing the files first (``checkpoints.commit_checkpoint``).

A run dir on ``gs://`` or ``s3://`` (``olmo_data.fileio.URLPath``) is written and read by
DCP's own fsspec storage writer and reader, on fileio's client for that URL (its endpoint and
credentials: ``AWS_ENDPOINT_URL`` / ``AWS_*``, Google ADC or ``STORAGE_EMULATOR_HOST``). Every
rank uploads its own files; rank 0 writes meta.json, one object, after DCP's ``.metadata``:
the commit rule needs no rename. A storage failure during a save is a one-line
``fileio.StorageError`` naming the URL and the fix; the checkpoint it left has no meta.json,
so the previous one stays the latest.
"""

from __future__ import annotations

import base64
import io
import os
import warnings
from collections.abc import Generator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_run.checkpoints import checkpoint_dir, clean_orphans, commit_checkpoint, prune_checkpoints
from olmo_run.errors import TrainingStateError
from olmo_run.run_dir import RunPath
from olmo_run.write_failure import checkpoint_write_failure, os_error_code

from .parallelize import Distributed
from .sharded_optimizer import ShardedAdamW, ShardedMasters, model_state, sharded_masters_of

# A single process without a process group is a supported DCP mode, which torch announces
# on every save and load; the message says nothing new here.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable", category=UserWarning)


def rng_state() -> dict[str, Any]:
    """RNG states as JSON-ready strings. The trainer draws no random numbers after init (no
    dropout), so these only matter to code added later; they are restored all the same."""
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    def decode(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    if "torch" in state:
        torch.set_rng_state(decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(decode(state["cuda"]))


def _bucket_fs(url: URLPath) -> Any:

    return fileio.filesystem(str(url))[0]


def _on_bucket(io: Any, url: URLPath) -> Any:
    """DCP's fsspec writer/reader ``io`` switched to fileio's client for ``url``. DCP would make
    its own from the URL alone, which is gcsfs's bucket-layout-probing class (no emulator
    serves that API) with no way to pass the client fileio configured. Its rename, used once
    to publish ``.metadata``, is a copy then a delete: an object store renames that way anyway,
    and gcsfs's server-side move is not served by every store (it retries before falling back)."""
    fs = _bucket_fs(url)
    io.fs.fs = fs

    def rename(path: Any, new_path: Any) -> None:
        fs.copy(str(path), str(new_path))
        fs.rm(str(path))

    io.fs.rename = rename
    return io


def _writer(ckpt: URLPath) -> FsspecWriter:
    return _on_bucket(FsspecWriter(str(ckpt)), ckpt)


def _reader(ckpt: URLPath) -> FsspecReader:
    return _on_bucket(FsspecReader(str(ckpt)), ckpt)


def _causes(err: BaseException) -> list[BaseException]:
    """``err`` and, for DCP's CheckpointException, what failed on each rank."""
    causes = [err]
    if isinstance(err, CheckpointException):
        causes += [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
    return causes


def _raise_storage(err: BaseException, ckpt: RunPath, op: str) -> None:
    """Re-raise a storage failure inside DCP (possibly wrapped per rank in a CheckpointException)
    as fileio's one-line error; return for anything else (and for a local checkpoint, whose
    errors keep their own messages)."""
    if not isinstance(ckpt, URLPath):
        return
    for cause in _causes(err):
        if isinstance(cause, BaseException) and (found := fileio.storage_error(cause, ckpt, op)) is not None:
            what = "saving" if op == "write" else "loading"
            tail = "; the checkpoint has no meta.json, so the previous one stays the latest" if op == "write" else ""
            raise type(found)(f"{what} checkpoint {ckpt.name}: {found}{tail}") from None


class _KeptErrorsFile(io.FileIO):
    """A file DCP writes, keeping each OSError a write raised in ``errors``: torch.save's zip
    writer, which writes through it, reports a failed write as "[enforce fail at
    inline_container.cc] unexpected pos N vs M", with the errno (ENOSPC: a full disk) lost."""

    def __init__(self, path: str | os.PathLike, errors: list[OSError]):
        super().__init__(path, "wb")
        self.errors = errors

    def write(self, data: Any, /) -> int:
        try:
            return super().write(data)
        except OSError as err:
            self.errors.append(err)
            raise


class _KeptErrorsFileSystem(FileSystem):
    """DCP's local file system, its files written through ``_KeptErrorsFile``."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[OSError] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(_KeptErrorsFile(path, self.errors)) as stream:
            yield stream


def _local_writer(ckpt: RunPath) -> FileSystemWriter:
    """DCP's writer of a local folder (what ``checkpoint_id=ckpt`` makes), on ``_KeptErrorsFileSystem``."""
    writer = FileSystemWriter(str(ckpt))
    writer.fs = _KeptErrorsFileSystem()
    return writer


def _save_failure(err: BaseException, ckpt: RunPath, run_dir: RunPath, writer: Any) -> BaseException:
    """What a failed save raises: fileio's one-line error for a storage failure of a URL
    checkpoint; a one-line CheckpointWriteError for a failed system call (the errno of a write
    ``writer`` kept, or one behind ``err`` on any rank) or for a file torch.save's writer cut
    short (another rank's failed write); else ``err`` itself (a bug: its traceback is wanted)."""
    _raise_storage(err, ckpt, "write")
    kept = writer.fs.errors if isinstance(writer.fs, _KeptErrorsFileSystem) else []
    causes = _causes(err)
    if (code := os_error_code(*kept, *causes)) is not None:
        return checkpoint_write_failure(ckpt, run_dir, code)
    short = next((c for c in causes if isinstance(c, RuntimeError) and "unexpected pos" in str(c)), None)
    if short is None:
        return err
    reason = f"a file was cut short (torch.save's writer: {str(short).strip().splitlines()[0]})"
    return checkpoint_write_failure(ckpt, run_dir, None, reason)


class Checkpointer:
    """Saves (optionally in the background) and commits checkpoints of one run dir (a local
    folder or a gs:// / s3:// URL). A save that fails is a one-line CheckpointWriteError (a full
    disk: "No space left on device"), raised by ``poll`` after the step it is found in."""

    def __init__(self, run_dir: RunPath, d: Distributed, *, async_save: bool, keep: int):
        self.run_dir = run_dir
        self.d = d
        self.keep = keep
        self.async_save = async_save
        self.pending: tuple[Future, RunPath, dict[str, Any], FileSystemWriter | FsspecWriter] | None = None
        # A separate group keeps the background save's collectives off the training group.
        self.group = dist.new_group(backend="gloo") if (async_save and d.initialized) else None
        if d.is_main:
            clean_orphans(run_dir)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
        """Write model + optimizer for ``step``; meta.json follows once the data is on disk."""
        self.wait()
        ckpt = checkpoint_dir(self.run_dir, step)
        if self.d.is_main and fileio.exists(ckpt):
            fileio.delete(ckpt, recursive=True)  # an incomplete save of this step from a crashed run
        self.d.barrier()
        msd, osd = (
            optimizer.checkpoint_state(model)
            if isinstance(optimizer, ShardedAdamW)
            else get_state_dict(model, optimizer)
        )
        state = {"model": msd, "optim": osd}
        no_dist = not self.d.initialized
        # A URL gets DCP's fsspec writer; a local folder its plain file-system writer.
        writer = _writer(ckpt) if isinstance(ckpt, URLPath) else _local_writer(ckpt)
        target: dict[str, Any] = {"storage_writer": writer}
        if not isinstance(ckpt, URLPath):
            target["checkpoint_id"] = str(ckpt)
        try:
            if self.async_save:
                # ignores: new_group over every rank never returns the non-member sentinel, and
                # async_save without an async_stager returns a Future, not an AsyncSaveResponse.
                future = dcp.async_save(state, **target, process_group=self.group, no_dist=no_dist)  # type: ignore[arg-type]
                self.pending = (future, ckpt, meta, writer)  # type: ignore[assignment]
            else:
                dcp.save(state, **target, no_dist=no_dist)
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            if (failure := _save_failure(err, ckpt, self.run_dir, writer)) is err:
                raise
            raise failure from None
        if not self.async_save:
            self._commit(ckpt, meta)

    def wait(self) -> None:
        """Block until a background save has finished, then commit it."""
        if self.pending is None:
            return
        future, ckpt, meta, writer = self.pending
        self.pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            if (failure := _save_failure(err, ckpt, self.run_dir, writer)) is err:
                raise
            raise failure from None
        self._commit(ckpt, meta)

    def _commit(self, ckpt: RunPath, meta: dict[str, Any]) -> None:
        if not self.d.is_main:
            return
        try:
            commit_checkpoint(ckpt, meta)
        except OSError as err:  # meta.json not written (a URL's failure is fileio's one line already)
            if isinstance(ckpt, URLPath):
                raise
            raise checkpoint_write_failure(ckpt, self.run_dir, err.errno, None if err.errno else str(err)) from None
        prune_checkpoints(self.run_dir, self.keep, committed=meta["step"])

    def poll(self) -> None:
        """Commit a finished background save without blocking (called once per step), so a
        crash loses as little as possible, and a failed one (a full disk) stops the run before
        its next step."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def close(self) -> None:
        """End of run: the last save written and committed (the background saves' gloo group
        is released with the process group)."""
        self.wait()


def _load_sharded(
    model: nn.Module, masters: ShardedMasters, optimizer: torch.optim.Optimizer | None, source: dict, no_dist: bool
) -> None:
    """``load_checkpoint`` for ``optim.sharded``: the weights into the fp32 masters and the
    moments into ``ShardedAdamW``'s (DCP reshards each from whatever layout wrote it; the
    checkpoint's param groups are not read: the recipe sets them), then the compute weights
    gathered from the masters."""
    if optimizer is not None and not isinstance(optimizer, ShardedAdamW):
        raise TypeError(
            f"load_checkpoint: a model with sharded masters needs a ShardedAdamW, got {type(optimizer).__name__}"
        )
    if optimizer is None:
        state: dict[str, Any] = {"model": model_state(model, masters)}
    else:
        msd, osd = optimizer.checkpoint_state(model)
        state = {"model": msd, "optim": {"state": osd["state"]}}
    dcp.load(state, **source, no_dist=no_dist)
    masters.gather()


def load_checkpoint(ckpt: RunPath, d: Distributed, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load model (and optimizer unless None) from a DCP checkpoint onto the current layout;
    ``ckpt`` may be a gs:// / s3:// URL (read with ranged GETs by DCP's fsspec reader)."""
    if not fileio.exists(ckpt / ".metadata"):
        raise TrainingStateError(f"{ckpt}: no DCP .metadata; this is not a torch checkpoint (or it is damaged)")
    no_dist = not d.initialized

    def source() -> dict[str, Any]:  # a reader per load: DCP keeps per-load state in it
        return {"storage_reader": _reader(ckpt)} if isinstance(ckpt, URLPath) else {"checkpoint_id": str(ckpt)}

    try:
        if (masters := sharded_masters_of(model)) is not None:
            _load_sharded(model, masters, optimizer, source(), no_dist)
            return
        if optimizer is None:
            state: dict[str, Any] = {"model": get_model_state_dict(model)}
            dcp.load(state, **source(), no_dist=no_dist)
            set_model_state_dict(model, state["model"])
            return
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, **source(), no_dist=no_dist)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (RuntimeError, KeyError, CheckpointException, OSError) as err:
        _raise_storage(err, ckpt, "read")
        # DCP wraps what failed on each rank (a missing or unreadable file, say) in a
        # CheckpointException whose text is a traceback: report the first rank's error itself.
        cause = next(iter(err.failures.values()))[0] if isinstance(err, CheckpointException) and err.failures else err
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise TrainingStateError(
            f"{ckpt}: cannot load it into this model/optimizer ({first}); the checkpoint is damaged or of another model"
        ) from None

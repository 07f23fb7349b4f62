"""Checkpoints of the torch trainer: torch.distributed.checkpoint (DCP) + the shared meta.json.

Layout of one checkpoint (``olmo_model.runlog`` owns the run dir around it)::

    RUN/checkpoints/step_00000010/
        .metadata, __0_0.distcp, ...   DCP: {"model": ..., "optim": ...}, one file per rank
        meta.json                      step, loader state, recipe, spec, spike guard, RNG, and
                                       the size and sha256 of every other file ("files"; written
                                       last: its presence marks the checkpoint complete)

Model and optimizer go through ``get_state_dict`` / ``set_state_dict``, so the stored keys
are the plain module names whatever the wrapper (FSDP2, HSDP, DDP, none, activation
checkpointing, compile), and DCP reshards on load: a checkpoint from 4 ranks resumes on 2,
or on one process without a process group.

With ``checkpoint.async_save`` the state is staged to CPU memory before ``save`` returns
and written by a background thread (over its own gloo group, so its collectives never
interleave with training's); rank 0 writes meta.json only when that write has finished,
hashing the files first (``runlog.commit_checkpoint``).

A run dir on ``gs://`` or ``s3://`` (``olmo_model.storage.URLPath``) is written and read by
DCP's own fsspec storage writer and reader, on fileio's client for that URL (its endpoint and
credentials: ``AWS_ENDPOINT_URL`` / ``AWS_*``, Google ADC or ``STORAGE_EMULATOR_HOST``). Every
rank uploads its own files; rank 0 writes meta.json, one object, after DCP's ``.metadata``:
the commit rule needs no rename. A storage failure during a save is a one-line
``fileio.StorageError`` naming the URL and the fix; the checkpoint it left has no meta.json,
so the previous one stays the latest.
"""

from __future__ import annotations

import base64
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from olmo_model.runlog import (
    TrainingStateError,
    checkpoint_dir,
    clean_orphans,
    commit_checkpoint,
    prune_checkpoints,
)
from olmo_model.storage import RunPath, URLPath, backend
from olmo_run.run_dir import storage_error

from .parallelize import Distributed

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
    from olmo_data import fileio

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


def _raise_storage(err: BaseException, ckpt: RunPath, op: str) -> None:
    """Re-raise a storage failure inside DCP (possibly wrapped per rank in a CheckpointException)
    as fileio's one-line error; return for anything else (and for a local checkpoint, whose
    errors keep their own messages)."""
    if not isinstance(ckpt, URLPath):
        return
    causes = [err]
    if isinstance(err, CheckpointException):
        causes += [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
    for cause in causes:
        if isinstance(cause, BaseException) and (found := storage_error(cause, ckpt, op)) is not None:
            what = "saving" if op == "write" else "loading"
            tail = "; the checkpoint has no meta.json, so the previous one stays the latest" if op == "write" else ""
            raise type(found)(f"{what} checkpoint {ckpt.name}: {found}{tail}") from None


class Checkpointer:
    """Saves (optionally in the background) and commits checkpoints of one run dir (a local
    folder or a gs:// / s3:// URL)."""

    def __init__(self, run_dir: RunPath, d: Distributed, *, async_save: bool, keep: int):
        self.run_dir = run_dir
        self.d = d
        self.keep = keep
        self.async_save = async_save
        self.pending: tuple[Future, RunPath, dict[str, Any]] | None = None
        # A separate group keeps the background save's collectives off the training group.
        self.group = dist.new_group(backend="gloo") if (async_save and d.initialized) else None
        if d.is_main:
            clean_orphans(run_dir)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
        """Write model + optimizer for ``step``; meta.json follows once the data is on disk."""
        self.wait()
        ckpt = checkpoint_dir(self.run_dir, step)
        fs = backend(ckpt)
        if self.d.is_main and fs.exists(str(ckpt)):
            fs.delete(str(ckpt), recursive=True)  # an incomplete save of this step from a crashed run
        self.d.barrier()
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        no_dist = not self.d.initialized
        # A URL gets DCP's fsspec writer; a local folder its plain file-system writer.
        target: dict[str, Any] = (
            {"storage_writer": _writer(ckpt)} if isinstance(ckpt, URLPath) else {"checkpoint_id": str(ckpt)}
        )
        try:
            if self.async_save:
                # ignores: new_group over every rank never returns the non-member sentinel, and
                # async_save without an async_stager returns a Future, not an AsyncSaveResponse.
                future = dcp.async_save(state, **target, process_group=self.group, no_dist=no_dist)  # type: ignore[arg-type]
                self.pending = (future, ckpt, meta)  # type: ignore[assignment]
            else:
                dcp.save(state, **target, no_dist=no_dist)
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            _raise_storage(err, ckpt, "write")
            raise
        if not self.async_save:
            self._commit(ckpt, meta)

    def wait(self) -> None:
        """Block until a background save has finished, then commit it."""
        if self.pending is None:
            return
        future, ckpt, meta = self.pending
        self.pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            _raise_storage(err, ckpt, "write")
            raise
        self._commit(ckpt, meta)

    def _commit(self, ckpt: RunPath, meta: dict[str, Any]) -> None:
        if not self.d.is_main:
            return
        commit_checkpoint(ckpt, meta)
        prune_checkpoints(self.run_dir, self.keep, committed=meta["step"])

    def poll(self) -> None:
        """Commit a finished background save without blocking (called once per step), so a
        crash loses as little as possible."""
        if self.pending is not None and self.pending[0].done():
            self.wait()


def load_checkpoint(ckpt: RunPath, d: Distributed, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load model (and optimizer unless None) from a DCP checkpoint onto the current layout;
    ``ckpt`` may be a gs:// / s3:// URL (read with ranged GETs by DCP's fsspec reader)."""
    if not backend(ckpt).exists(str(ckpt / ".metadata")):
        raise TrainingStateError(f"{ckpt}: no DCP .metadata; this is not a torch checkpoint (or it is damaged)")
    no_dist = not d.initialized

    def source() -> dict[str, Any]:  # a reader per load: DCP keeps per-load state in it
        return {"storage_reader": _reader(ckpt)} if isinstance(ckpt, URLPath) else {"checkpoint_id": str(ckpt)}

    try:
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

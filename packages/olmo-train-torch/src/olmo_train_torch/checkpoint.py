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
"""

from __future__ import annotations

import base64
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
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


class Checkpointer:
    """Saves (optionally in the background) and commits checkpoints of one run dir."""

    def __init__(self, run_dir: Path, d: Distributed, *, async_save: bool, keep: int):
        self.run_dir = run_dir
        self.d = d
        self.keep = keep
        self.async_save = async_save
        self.pending: tuple[Future, Path, dict[str, Any]] | None = None
        # A separate group keeps the background save's collectives off the training group.
        self.group = dist.new_group(backend="gloo") if (async_save and d.initialized) else None
        if d.is_main:
            clean_orphans(run_dir)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
        """Write model + optimizer for ``step``; meta.json follows once the data is on disk."""
        self.wait()
        ckpt = checkpoint_dir(self.run_dir, step)
        if self.d.is_main and ckpt.exists():
            shutil.rmtree(ckpt)  # an incomplete save of this step from a crashed run
        self.d.barrier()
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        no_dist = not self.d.initialized
        if self.async_save:
            # ignores: new_group over every rank never returns the non-member sentinel, and
            # async_save without an async_stager returns a Future, not an AsyncSaveResponse.
            future = dcp.async_save(state, checkpoint_id=str(ckpt), process_group=self.group, no_dist=no_dist)  # type: ignore[arg-type]
            self.pending = (future, ckpt, meta)  # type: ignore[assignment]
        else:
            dcp.save(state, checkpoint_id=str(ckpt), no_dist=no_dist)
            self._commit(ckpt, meta)

    def wait(self) -> None:
        """Block until a background save has finished, then commit it."""
        if self.pending is None:
            return
        future, ckpt, meta = self.pending
        self.pending = None
        future.result()
        self._commit(ckpt, meta)

    def _commit(self, ckpt: Path, meta: dict[str, Any]) -> None:
        if not self.d.is_main:
            return
        commit_checkpoint(ckpt, meta)
        prune_checkpoints(self.run_dir, self.keep, committed=meta["step"])

    def poll(self) -> None:
        """Commit a finished background save without blocking (called once per step), so a
        crash loses as little as possible."""
        if self.pending is not None and self.pending[0].done():
            self.wait()


def load_checkpoint(ckpt: Path, d: Distributed, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load model (and optimizer unless None) from a DCP checkpoint onto the current layout."""
    if not (ckpt / ".metadata").exists():
        raise TrainingStateError(f"{ckpt}: no DCP .metadata; this is not a torch checkpoint (or it is damaged)")
    no_dist = not d.initialized
    try:
        if optimizer is None:
            state: dict[str, Any] = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=no_dist)
            set_model_state_dict(model, state["model"])
            return
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=no_dist)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (RuntimeError, KeyError, CheckpointException) as err:
        # DCP wraps what failed on each rank (a missing or unreadable file, say) in a
        # CheckpointException whose text is a traceback: report the first rank's error itself.
        cause = next(iter(err.failures.values()))[0] if isinstance(err, CheckpointException) and err.failures else err
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise TrainingStateError(
            f"{ckpt}: cannot load it into this model/optimizer ({first}); the checkpoint is damaged or of another model"
        ) from None

"""Orbax checkpoints of the JAX trainer, in the run-dir layout both trainers share.

    RUN/checkpoints/step_00000050/state/   Orbax: {"params", "opt_state", "step"} (sharded arrays)
    RUN/checkpoints/step_00000050/meta.json  olmo_model.runlog.training_meta + spike guard, layout

Saving: Orbax copies the arrays to host memory and returns; the files are written in the
background when ``checkpoint.async_save``. A checkpoint only counts once ``meta.json`` exists,
and that is written by a commit thread after Orbax reports the save finished (with the size
and sha256 of every file, hashed on that thread: ``runlog.commit_checkpoint``), so a crash
mid-save leaves an incomplete directory that resume ignores (the next save of that step
replaces it; ``runlog.clean_orphans`` removes older ones when the Checkpointer starts).
Restoring takes abstract arrays that carry the CURRENT mesh's shardings, so a checkpoint
written on 8 devices restores onto 2 (or onto another fsdp/tensor split).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from olmo_model.runlog import TrainingStateError, checkpoint_dir, clean_orphans, commit_checkpoint, prune_checkpoints

STATE_DIR = "state"


class Checkpointer:
    """Saves training state every few steps; at most one save is in flight at a time."""

    def __init__(self, run_dir: Path, keep: int, async_save: bool):
        self.run_dir = run_dir
        self.keep = keep
        self.async_save = async_save
        self.is_main = jax.process_index() == 0
        self._orbax = ocp.StandardCheckpointer()
        self._commit: threading.Thread | None = None
        self._error: BaseException | None = None
        if self.is_main:
            clean_orphans(run_dir)

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        self.wait()
        ckpt = checkpoint_dir(self.run_dir, step)
        if self.is_main and ckpt.exists():
            # Only an incomplete save of this step can be here (resume starts after the latest
            # complete one); Orbax refuses to write into an existing directory.
            shutil.rmtree(ckpt)
        state = {"params": params, "opt_state": opt_state, "step": step}
        self._orbax.save(ckpt.resolve() / STATE_DIR, state)
        if self.async_save:
            self._commit = threading.Thread(target=self._finish, args=(step, ckpt, meta), daemon=True)
            self._commit.start()
        else:
            self._finish(step, ckpt, meta)
            self._raise_pending()

    def _finish(self, step: int, ckpt: Path, meta: dict[str, Any]) -> None:
        try:
            self._orbax.wait_until_finished()
            if self.is_main:
                commit_checkpoint(ckpt, meta)
                prune_checkpoints(self.run_dir, self.keep, committed=step)
        except BaseException as err:  # re-raised in the training thread by wait()
            self._error = err

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait(self) -> None:
        """Block until the last save is written and committed."""
        if self._commit is not None:
            self._commit.join()
            self._commit = None
        self._raise_pending()

    def close(self) -> None:
        self.wait()
        self._orbax.close()


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings: what Orbax restores onto."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def restore_state(ckpt: Path, abstract_params: Any, abstract_opt_state: Any | None) -> tuple[Any, Any | None, int]:
    """(params, opt_state or None, step) from a checkpoint, placed on the current mesh. A
    checkpoint Orbax cannot read (damaged, or of another model) is a one-line TrainingStateError."""
    try:
        return _restore(ckpt, abstract_params, abstract_opt_state)
    except Exception as err:
        # Orbax reports an array file it cannot read (missing, cut short) as a plain Exception
        # from TensorStore; anything else of that plain type is not a damaged file: re-raise it.
        plain_read_error = type(err) is Exception and str(err).startswith("Encountered error while reading")
        if not (isinstance(err, (ValueError, KeyError, OSError)) or plain_read_error):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrainingStateError(
            f"{ckpt}: Orbax cannot restore it onto this model ({first}); the checkpoint is damaged or of another model"
        ) from None


def _restore(ckpt: Path, abstract_params: Any, abstract_opt_state: Any | None) -> tuple[Any, Any | None, int]:
    target: dict[str, Any] = {"params": abstract_params, "step": 0}
    if abstract_opt_state is not None:
        with ocp.StandardCheckpointer() as orbax:
            restored = orbax.restore(ckpt.resolve() / STATE_DIR, {**target, "opt_state": abstract_opt_state})
        return restored["params"], restored["opt_state"], int(restored["step"])
    # Weights only (a new stage's init): StandardCheckpointer refuses a target that leaves out
    # the stored opt_state, so restore the subset through PyTreeRestore's partial_restore.
    restore = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    with ocp.PyTreeCheckpointer() as orbax:
        restored = orbax.restore(ckpt.resolve() / STATE_DIR, args=restore)
    return restored["params"], None, int(restored["step"])

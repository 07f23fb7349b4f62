"""Orbax checkpoints of the JAX trainer, in the run-dir layout both trainers share.

    RUN/checkpoints/step_00000050/state/   Orbax: {"params", "opt_state", "step"} (sharded arrays)
    RUN/checkpoints/step_00000050/meta.json  olmo_run.checkpoints.training_meta + spike guard, layout

Saving: Orbax copies the arrays to host memory and returns; the files are written in the
background when ``checkpoint.async_save``. A checkpoint only counts once ``meta.json`` exists,
and that is written by a commit thread after Orbax reports the save finished (with the size
and sha256 of every file, hashed on that thread: ``checkpoints.commit_checkpoint``), so a crash
mid-save leaves an incomplete directory that resume ignores (the next save of that step
replaces it; ``checkpoints.clean_orphans`` removes older ones when the Checkpointer starts).
Restoring takes abstract arrays that carry the CURRENT mesh's shardings, so a checkpoint
written on 8 devices restores onto 2 (or onto another fsdp/tensor split).

A run dir on object storage (``olmo_data.fileio.URLPath``):

- ``gs://``: Orbax writes and restores the bucket directly (TensorStore's GCS driver for the
  arrays, etils' gcsfs for the rest; every process writes its own shards). Both read Google's
  Application Default Credentials. For an emulator named by ``STORAGE_EMULATOR_HOST`` (which
  TensorStore does not read) ``gcs_emulator_environment`` points TensorStore at it with its
  own settings, ``TENSORSTORE_GCS_HTTP_URL`` and an anonymous token, unless they are set.
- ``s3://``: Orbax cannot write S3 directly (orbax-checkpoint 0.12 turns ``s3://bucket`` into
  the relative path ``s3:/bucket`` before TensorStore sees it), so the save is staged in a
  local folder (``$OLMO_CACHE/run-dirs/...``, under ``run_dir.local_copy``) and uploaded
  through ``olmo_data.fileio`` once Orbax finished, on the commit thread; a restore downloads
  ``state/`` to a local temp folder first. That needs every shard on one host: a multi-process
  JAX run refuses an s3:// run dir (use gs:// or a shared file system).

On both, meta.json is uploaded last, after every other object, so the commit rule holds
without a rename; a storage failure is a one-line ``fileio.StorageError`` and leaves the
previous checkpoint the latest.

A save that fails (a full disk: TensorStore's "No space left on device [os_error_code='28']")
stops the run before its next step: ``poll``, called after every step, raises the background
save's failure as soon as it is known, as a one-line ``errors.CheckpointWriteError`` naming the
checkpoint and the OS's reason (exit status 5). Orbax's own ERROR records of that failure, each
with a traceback, and TensorStore's late callbacks to the failed save's closed event loop are
logged at DEBUG instead (``_OrbaxBackgroundErrors``, ``_closed_loop_callbacks_to_debug``).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_run.checkpoints import checkpoint_dir, clean_orphans, commit_checkpoint, prune_checkpoints
from olmo_run.errors import TrainingStateError
from olmo_run.run_dir import RunPath, local_copy
from olmo_run.write_failure import checkpoint_write_failure, os_error_code

STATE_DIR = "state"
STAGING_DIR = ".staging"  # in the local copy of an s3:// run dir: saves before their upload
# Concurrent uploads / downloads of a staged s3:// checkpoint's files.
TRANSFER_THREADS = 8


def gcs_emulator_environment() -> None:
    """With ``STORAGE_EMULATOR_HOST`` set, point TensorStore's GCS driver at that emulator
    (``TENSORSTORE_GCS_HTTP_URL``) with an anonymous token, as google-cloud-storage does for
    that variable; settings already made are left alone. Called before Orbax touches gs://."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host if "://" in host else f"http://{host}")
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "anonymous")


def _orbax_path(ckpt: RunPath) -> Any:
    """Where Orbax reads and writes a checkpoint's state: an absolute local path, or gs://."""
    if isinstance(ckpt, URLPath):
        gcs_emulator_environment()
        return f"{ckpt}/{STATE_DIR}"
    return ckpt.resolve() / STATE_DIR


def _staging(ckpt: URLPath) -> Path:
    return local_copy(ckpt.parent.parent) / STAGING_DIR / ckpt.name


def _upload_tree(local: Path, url: URLPath) -> None:

    files = sorted(p for p in local.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        list(pool.map(lambda p: fileio.put_file(p, str(url / p.relative_to(local).as_posix())), files))


def _download_tree(url: URLPath, local: Path) -> None:

    def get(name: str) -> None:
        target = local / URLPath(name).relative(url)
        target.parent.mkdir(parents=True, exist_ok=True)
        with fileio.open_write(target) as out:
            for block in fileio.iter_blocks(name):
                out.write(block)

    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        list(pool.map(get, fileio.find(str(url))))


def _storage_failure(err: BaseException, ckpt: RunPath, op: str) -> BaseException:
    """A one-line fileio error for a storage failure on a URL checkpoint, else ``err`` itself."""
    if not isinstance(ckpt, URLPath):
        return err
    found = fileio.storage_error(err, ckpt, op)
    if found is None:
        return err
    tail = "; the checkpoint has no meta.json, so the previous one stays the latest" if op == "write" else ""
    return type(found)(f"{'saving' if op == 'write' else 'loading'} checkpoint {ckpt.name}: {found}{tail}")


def _save_failure(err: Exception, ckpt: RunPath, run_dir: RunPath) -> BaseException:
    """What a failed save raises: fileio's one-line error for a storage failure of a URL
    checkpoint, a one-line CheckpointWriteError for a failed system call behind ``err`` (a full
    disk), else ``err`` itself (no I/O failure but a bug: its traceback is wanted)."""
    if (failure := _storage_failure(err, ckpt, "write")) is not err:
        return failure
    code = os_error_code(err)
    return err if code is None else checkpoint_write_failure(ckpt, run_dir, code)


class _OrbaxBackgroundErrors(logging.Filter):
    """Orbax logs a failure of its background save threads at ERROR with the traceback, once per
    thread (a full disk: some 300 lines), and raises the same exception from
    ``wait_until_finished``, where the Checkpointer reports it in one line. Those records are
    demoted to DEBUG, shown only where the absl logger is set to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info and "orbax" in Path(record.pathname).parts:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_ORBAX_BACKGROUND_ERRORS = _OrbaxBackgroundErrors()
_log = logging.getLogger(__name__)


def _closed_loop_callbacks_to_debug() -> None:
    """When one array write of an Orbax save fails, the save's asyncio loop ends at once, and
    the writes still in flight in TensorStore report their own end to that closed loop: Python
    prints each "RuntimeError: Event loop is closed" as an unraisable exception, a traceback
    apiece (dozens for one full disk), after the failure the Checkpointer already reports. This
    hook (installed once, handing everything else to the hook it replaced) logs those at DEBUG."""
    previous = sys.unraisablehook
    if getattr(previous, "_olmo_closed_loop", False):
        return

    def hook(unraisable: Any) -> None:
        frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
        if (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
            and any(frame.name == "call_soon_threadsafe" for frame in frames)
        ):
            _log.debug("a TensorStore write ended after its Orbax save had failed (event loop closed)")
            return
        previous(unraisable)

    hook._olmo_closed_loop = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class Checkpointer:
    """Saves training state every few steps; at most one save is in flight at a time."""

    def __init__(self, run_dir: RunPath, *, async_save: bool, keep: int):
        self.run_dir = run_dir
        self.keep = keep
        self.async_save = async_save
        self.is_main = jax.process_index() == 0
        self.staged = isinstance(run_dir, URLPath) and run_dir.scheme == "s3"
        if self.staged and jax.process_count() > 1:
            raise TrainingStateError(
                f"run_dir={run_dir}: the JAX trainer stages s3:// checkpoints on one host, and this run has "
                f"{jax.process_count()} processes; use a gs:// run dir or a shared file system"
            )
        self._orbax = ocp.StandardCheckpointer()  # OCDBT: a few large files per process
        self._commit: threading.Thread | None = None
        self._error: BaseException | None = None
        logging.getLogger("absl").addFilter(_ORBAX_BACKGROUND_ERRORS)
        _closed_loop_callbacks_to_debug()
        if self.is_main:
            clean_orphans(run_dir)
            if self.staged:  # what a failed or killed save left in the local staging folder
                shutil.rmtree(local_copy(run_dir) / STAGING_DIR, ignore_errors=True)

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        self.wait()
        ckpt = checkpoint_dir(self.run_dir, step)
        try:
            if self.is_main and fileio.exists(ckpt):
                # Only an incomplete save of this step can be here (resume starts after the latest
                # complete one); Orbax refuses to write into an existing directory.
                fileio.delete(ckpt, recursive=True)
            state = {"params": params, "opt_state": opt_state, "step": step}
            if isinstance(ckpt, URLPath) and self.staged:
                staging = _staging(ckpt)
                shutil.rmtree(staging, ignore_errors=True)
                staging.parent.mkdir(parents=True, exist_ok=True)
                self._orbax.save(staging.resolve() / STATE_DIR, state)
            else:
                self._orbax.save(_orbax_path(ckpt), state)
        except Exception as err:
            if (failure := _save_failure(err, ckpt, self.run_dir)) is err:
                raise
            raise failure from None
        if self.async_save:
            self._commit = threading.Thread(target=self._finish, args=(step, ckpt, meta), daemon=True)
            self._commit.start()
        else:
            self._finish(step, ckpt, meta)
            self._raise_pending()

    def _finish(self, step: int, ckpt: RunPath, meta: dict[str, Any]) -> None:
        try:
            self._orbax.wait_until_finished()
            if isinstance(ckpt, URLPath) and self.staged:
                staging = _staging(ckpt)
                _upload_tree(staging / STATE_DIR, ckpt / STATE_DIR)
                shutil.rmtree(staging, ignore_errors=True)
            if self.is_main:
                commit_checkpoint(ckpt, meta)
                prune_checkpoints(self.run_dir, self.keep, committed=step)
        except BaseException as err:  # re-raised in the training thread by poll() or wait()
            self._error = _save_failure(err, ckpt, self.run_dir) if isinstance(err, Exception) else err

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def poll(self) -> None:
        """Without blocking: raise the failure of a background save that has ended (called after
        every step, so a full disk stops the run before its next step, not at the next save)."""
        if self._commit is not None and not self._commit.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the last save is written and committed."""
        if self._commit is not None:
            self._commit.join()
            self._commit = None
        self._raise_pending()

    def close(self) -> None:
        try:
            self.wait()
            self._orbax.close()
        finally:
            logging.getLogger("absl").removeFilter(_ORBAX_BACKGROUND_ERRORS)


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings: what Orbax restores onto."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def load_checkpoint(ckpt: RunPath, abstract_params: Any, abstract_opt_state: Any | None) -> tuple[Any, Any | None, int]:
    """(params, opt_state or None, step) from a checkpoint (local, gs:// or s3://), placed on the
    current mesh. A checkpoint Orbax cannot read (damaged, or of another model) is a one-line
    TrainingStateError; a storage failure a one-line fileio.StorageError."""
    if isinstance(ckpt, URLPath) and ckpt.scheme == "s3":
        with tempfile.TemporaryDirectory(prefix="olmo-restore-") as tmp:
            try:
                _download_tree(ckpt / STATE_DIR, Path(tmp) / STATE_DIR)
            except Exception as err:
                raise _storage_failure(err, ckpt, "read") from None
            return _restore_or_explain(Path(tmp), abstract_params, abstract_opt_state, shown=ckpt)
    return _restore_or_explain(ckpt, abstract_params, abstract_opt_state, shown=ckpt)


def _restore_or_explain(
    ckpt: RunPath, abstract_params: Any, abstract_opt_state: Any | None, shown: RunPath
) -> tuple[Any, Any | None, int]:
    try:
        return _restore(ckpt, abstract_params, abstract_opt_state)
    except Exception as err:
        failure = _storage_failure(err, shown, "read")
        if failure is not err:
            raise failure from None
        # Orbax reports an array file it cannot read (missing, cut short) as a plain Exception
        # from TensorStore; anything else of that plain type is not a damaged file: re-raise it.
        plain_read_error = type(err) is Exception and str(err).startswith("Encountered error while reading")
        if not (isinstance(err, (ValueError, KeyError, OSError)) or plain_read_error):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrainingStateError(
            f"{shown}: Orbax cannot restore it onto this model ({first}); the checkpoint is damaged or of another model"
        ) from None


def _restore(ckpt: RunPath, abstract_params: Any, abstract_opt_state: Any | None) -> tuple[Any, Any | None, int]:
    target: dict[str, Any] = {"params": abstract_params, "step": 0}
    if abstract_opt_state is not None:
        with ocp.StandardCheckpointer() as orbax:
            restored = orbax.restore(_orbax_path(ckpt), {**target, "opt_state": abstract_opt_state})
        return restored["params"], restored["opt_state"], int(restored["step"])
    # Weights only (a new stage's init): StandardCheckpointer refuses a target that leaves out
    # the stored opt_state, so restore the subset through PyTreeRestore's partial_restore.
    restore = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    with ocp.PyTreeCheckpointer() as orbax:
        restored = orbax.restore(_orbax_path(ckpt), args=restore)
    return restored["params"], None, int(restored["step"])

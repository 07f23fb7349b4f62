"""Checkpoints of the run dir, the same for both trainers: where they live, their meta.json,
the commit rule, verification, pruning and the clean-up of what interrupted saves left.

    RUN/checkpoints/step_00000010/   a checkpoint (framework format inside); complete once its
                                     meta.json exists, which lists every other file's size and sha256

RUN may be a local folder or a ``gs://`` / ``s3://`` URL: on object storage, where nothing can
be renamed, a checkpoint is written straight to the bucket and committed by meta.json, one
object written after all the others.
"""

from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_model.spec import ModelSpec

from .errors import CheckpointDamagedError, TrainingStateError, loud
from .recipe import Recipe
from .run_dir import RunPath

log = logging.getLogger(__name__)

META_FILE = "meta.json"
# Format /2 lists every other file of the checkpoint with its size and sha256 (meta["files"]);
# /1 checkpoints were written before that and are resumed unverified, with a warning.
CHECKPOINT_FORMAT = "olmo-twin-checkpoint/2"
UNCHECKED_FORMAT = "olmo-twin-checkpoint/1"
_META_KEYS = ("framework", "step", "spec", "recipe", "loader_state")
_ATOMIC_TEMP = re.compile(r"\..+\.tmp-(\d+)(?:-\w+)?")  # fileio's atomic-write temporaries (.NAME.tmp-PID-RANDOM)
_CONVERT_STAGING = re.compile(r"\.convert-(\d+)")  # olmo-convert's staging dir inside checkpoints/


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID runs on this host (signal 0 probes and sends nothing)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def checkpoint_dir(run_dir: RunPath, step: int) -> RunPath:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _step_of(path: RunPath) -> int | None:
    try:
        return int(path.name.removeprefix("step_")) if path.name.startswith("step_") else None
    except ValueError:
        return None


def complete_checkpoints(run_dir: RunPath) -> list[tuple[int, RunPath]]:
    """(step, path) of every complete checkpoint, oldest first. A checkpoint is complete when its
    ``meta.json`` exists: both trainers write it last, after the framework's own save finished
    (on object storage: after every other object of it was uploaded), so an interrupted save
    never counts."""
    root = run_dir / "checkpoints"
    out: list[tuple[int, RunPath]] = []
    for name in fileio.listdir(root):
        p = root / name
        step = _step_of(p)
        if step is not None and fileio.exists(p / META_FILE):
            out.append((step, p))
    return sorted(out, key=lambda sp: sp[0])


def training_meta(
    framework: str, step: int, spec: ModelSpec, recipe: Recipe, loader_state: dict[str, Any], extra: dict | None = None
) -> dict[str, Any]:
    return {
        "format": CHECKPOINT_FORMAT,
        "framework": framework,
        "step": step,
        "spec": spec.model_dump(mode="json"),
        "recipe": recipe.model_dump(mode="json"),
        "loader_state": loader_state,
        **(extra or {}),
    }


def read_meta(ckpt: RunPath) -> dict[str, Any]:
    path = ckpt / META_FILE
    try:
        meta = json.loads(fileio.read_text(path))
    except FileNotFoundError:
        raise TrainingStateError(f"{ckpt}: no meta.json; this is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointDamagedError(f"{path}: unreadable ({err}); the checkpoint is damaged") from None
    missing = [k for k in _META_KEYS if k not in meta] if isinstance(meta, dict) else list(_META_KEYS)
    if missing:
        raise CheckpointDamagedError(f"{path}: has no {', '.join(missing)}; the checkpoint is damaged")
    return meta


def _sha256(path: RunPath) -> str:
    return fileio.sha256(path)


def _sha256_all(paths: list[RunPath]) -> list[str]:
    """The sha256 of each file, several files at once (hashlib releases the GIL while it hashes;
    on object storage the downloads overlap). A remote file is streamed, never held whole."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 1) * 2, len(paths)))) as pool:
        return list(pool.map(_sha256, paths))


def _files_below(folder: RunPath) -> list[str]:
    """Every file below ``folder``, as paths relative to it (posix separators), sorted."""
    found = fileio.find(folder)
    if isinstance(folder, URLPath):
        return sorted(URLPath(f).relative(folder) for f in found)
    return sorted(Path(f).relative_to(folder).as_posix() for f in found)


def checkpoint_files(ckpt: RunPath) -> dict[str, dict[str, Any]]:
    """{path relative to ckpt: {"bytes", "sha256"}} of every file in the checkpoint except
    meta.json, which records them, and its atomic-write temporaries. On object storage this
    reads the checkpoint back once: what is recorded is what the bucket holds."""
    rels = [r for r in _files_below(ckpt) if not (r == META_FILE or r.startswith(f".{META_FILE}.tmp-"))]
    paths = [ckpt / r for r in rels]
    return {rel: {"bytes": fileio.size(p), "sha256": digest} for rel, p, digest in zip(rels, paths, _sha256_all(paths))}


def verify_checkpoint(ckpt: RunPath, meta: dict[str, Any]) -> None:
    """Every file meta.json lists is there with its recorded size and sha256, else a one-line
    CheckpointDamagedError naming the first that is not (sizes first: a missing or cut file is
    found before anything is read). A checkpoint of UNCHECKED_FORMAT passes with a loud
    warning: it was written before checksums, and refusing it would strand every such run."""
    # Any: whatever meta.json holds; a missing or malformed 'files' fails inside the try below.
    files: Any = meta.get("files")
    if files is None and meta.get("format") == UNCHECKED_FORMAT:
        loud(f"{ckpt}: written before checkpoints carried checksums ({UNCHECKED_FORMAT}); its files are not verified")
        return
    try:
        listed = [(ckpt / rel, int(entry["bytes"]), str(entry["sha256"])) for rel, entry in files.items()]
    except (AttributeError, KeyError, TypeError, ValueError):
        raise CheckpointDamagedError(
            f"{ckpt / META_FILE}: format {meta.get('format')!r} but no valid 'files' list; the checkpoint is damaged"
        ) from None
    for path, size, _ in listed:
        if not fileio.isfile(path):
            raise CheckpointDamagedError(f"{path}: missing ({size} bytes when committed); the checkpoint is damaged")
        if (got_size := fileio.size(path)) != size:
            raise CheckpointDamagedError(f"{path}: {got_size} bytes, {size} when committed; the checkpoint is damaged")
    for (path, _, want), got in zip(listed, _sha256_all([p for p, _, _ in listed])):
        if got != want:
            raise CheckpointDamagedError(
                f"{path}: sha256 {got[:16]}... is not the {want[:16]}... recorded at commit; the checkpoint is damaged"
            )


def read_verified_meta(ckpt: RunPath) -> dict[str, Any]:
    """read_meta, then verify_checkpoint: the meta.json of a checkpoint whose files are intact."""
    meta = read_meta(ckpt)
    verify_checkpoint(ckpt, meta)
    return meta


def commit_checkpoint(ckpt: RunPath, meta: dict[str, Any]) -> None:
    """Mark a checkpoint complete once the framework's save has finished: meta.json, which adds
    the size and sha256 of every other file of the checkpoint ("files"), is written last and
    atomically (on object storage: one PUT after every other object was uploaded; a failed
    PUT leaves no meta.json, so the previous checkpoint stays the latest)."""
    fileio.write_text(ckpt / META_FILE, json.dumps({**meta, "files": checkpoint_files(ckpt)}, indent=2))


def _remove_checkpoint(path: RunPath) -> None:
    # meta.json first: a removal cut short leaves an incomplete checkpoint, never a complete
    # one with files missing. On object storage the rest goes object by object.
    fileio.delete(path / META_FILE)
    fileio.delete(path, recursive=True)


def prune_checkpoints(run_dir: RunPath, keep: int, committed: int | None = None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints. With ``committed``, the step just
    committed, first delete the complete checkpoints newer than it: a resume that fell back past
    a damaged checkpoint (checkpoint.fallback) left them, and the next resume would take them."""
    done = complete_checkpoints(run_dir)
    if committed is not None:
        for _, path in (d for d in done if d[0] > committed):
            _remove_checkpoint(path)
        done = [d for d in done if d[0] <= committed]
    for _, path in done[: max(len(done) - keep, 0)]:
        _remove_checkpoint(path)


def clean_orphans(run_dir: RunPath) -> None:
    """Remove what interrupted saves, prunes and writes left in a run dir, printing each: step_*
    dirs without meta.json (a save that was killed or failed, a full disk's
    ``state.orbax-checkpoint-tmp`` say, or a prune cut short: the run resumes from the newest
    complete checkpoint, so none of them is ever read, and a full disk gets their room back
    before the run writes again), and atomic-write temporaries (.NAME.tmp-PID-RANDOM) and
    olmo-convert staging dirs (checkpoints/.convert-PID) of processes no longer alive. Called
    by the main process at start-up, after every check passed (one run owns its run dir).
    On object storage only the step_* objects are cleaned: uploads leave no temporaries, and a
    PID names no process of another host."""
    done = complete_checkpoints(run_dir)
    stale: list[tuple[RunPath, str, bool]] = []  # (path, why, is a folder)
    root = run_dir / "checkpoints"
    local = not isinstance(run_dir, URLPath)
    for name in fileio.listdir(root):
        p = root / name
        step, staging = _step_of(p), _CONVERT_STAGING.fullmatch(name)
        if local and staging and not pid_alive(int(staging[1])):
            stale.append((p, "staging dir of an olmo-convert that is gone", True))
        elif step is not None and not fileio.exists(p / META_FILE):
            stale.append((p, "no meta.json (an interrupted or failed save, or prune)", True))
    for folder in (run_dir, *(p for _, p in done)) if local else ():
        for name in fileio.listdir(folder):
            p = folder / name
            temp = _ATOMIC_TEMP.fullmatch(name)
            if temp and fileio.isfile(p) and not pid_alive(int(temp[1])):
                stale.append((p, "temporary file of a write that never finished", False))
    for p, why, is_folder in stale:
        fileio.delete(p, recursive=is_folder)
        log.info(f"removed {p}: {why}")

"""The run dir: its recipe, spec and recipe history (``prepare_run_dir``), atomic writes into it,
and run dirs on object storage (the URL backend of ``olmo_run.storage``, over ``olmo_data.fileio``).

    RUN/recipe.yaml        the resolved recipe the run started with
    RUN/recipe_history.jsonl  per resume that changed keys: {"step", "changes": {key: [old, new]}, "recipe"}
    RUN/spec.json          the resolved ModelSpec
    RUN/metrics.jsonl      ``olmo_run.metrics``; RUN/loss.png its plot
    RUN/checkpoints/       ``olmo_run.checkpoints``

The run-dir code (this module, ``olmo_run.checkpoints``, ``olmo_run.resume``, ``olmo_run.metrics``)
names paths as ``Path`` or
``storage.URLPath`` and leaves the file operations to a backend; importing this module (which
``olmo_run`` does) serves ``gs://`` and ``s3://`` with fileio, so both trainers, olmo-convert
and the driver share one implementation for local and remote run dirs.

What it means on object storage:

- writes are whole objects (one PUT, or a multipart / resumable upload the store publishes
  only once complete): meta.json, written last, commits a checkpoint without a rename;
- deletes go object by object below a prefix (keep-N pruning, clean-up of interrupted saves);
- sha256 of a checkpoint's files streams each object (``fileio.iter_blocks``), never whole;
- every failure is a one-line ``fileio.StorageError`` naming the URL and the fix (missing
  credentials, unknown bucket, permission, network).

Credentials and endpoints come from where the clients look (fileio's docstring): for S3 the
``AWS_*`` variables (``AWS_ENDPOINT_URL`` for another endpoint), for GCS Application Default
Credentials, or ``STORAGE_EMULATOR_HOST`` for an emulator.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from olmo_data import fileio
from olmo_model.spec import ModelSpec
from olmo_run import storage
from olmo_run.recipe import Recipe
from olmo_run.storage import RunPath, URLPath, backend, local_copy


class FileioBackend:
    """``olmo_run.storage.Backend`` for gs:// and s3:// URLs."""

    def exists(self, path: str) -> bool:
        return fileio.exists(path)

    def isfile(self, path: str) -> bool:
        return fileio.isfile(path)

    def isdir(self, path: str) -> bool:
        return fileio.isdir(path)

    def listdir(self, path: str) -> list[str]:
        return fileio.listdir(path)

    def find(self, path: str) -> list[str]:
        return fileio.find(path)

    def size(self, path: str) -> int:
        return fileio.size(path)

    def read_bytes(self, path: str) -> bytes:
        return fileio.read_bytes(path)

    def write_text(self, path: str, text: str) -> None:
        fileio.write_text(path, text)

    def delete(self, path: str, recursive: bool = False) -> None:
        fileio.delete(path, recursive=recursive)

    def makedirs(self, path: str) -> None:
        fileio.makedirs(path)

    def sha256(self, path: str) -> str:
        digest = hashlib.sha256()
        for block in fileio.iter_blocks(path):
            digest.update(block)
        return digest.hexdigest()

    def upload(self, local_path: str, path: str) -> None:
        fileio.put_file(local_path, path)


storage.register_url_backend(FileioBackend())


def storage_error(exc: BaseException, path: RunPath, op: str) -> fileio.StorageError | None:
    """fileio's one-line error for a failure a checkpoint library hit on ``path`` (None when it
    is not a storage failure)."""
    return fileio.storage_error(exc, str(path), op)


def check_reachable(run_dir: RunPath) -> None:
    """For a URL run dir, one listing of it: a missing bucket, missing or rejected credentials,
    a denied listing or an unreachable endpoint is a one-line StorageError now, before the
    slower start-up checks, not at the first checkpoint. A local run dir has nothing to probe."""
    if isinstance(run_dir, URLPath):
        fileio.listdir(str(run_dir))


def write_atomic(path: RunPath, text: str) -> None:
    """All of ``text`` under ``path`` or what was there before: locally a temp file renamed into
    place, on object storage one PUT (an object is published only once complete)."""
    backend(path).write_text(str(path), text)


def _exists(path: RunPath) -> bool:
    return backend(path).exists(str(path))


def _read_text(path: RunPath) -> str:
    return backend(path).read_bytes(str(path)).decode()


def _write_run_file(run_dir: RunPath, name: str, text: str) -> None:
    """A small file of the run dir; for a URL run dir also into its local copy."""
    write_atomic(run_dir / name, text)
    if isinstance(run_dir, URLPath):
        local = local_copy(run_dir)
        local.mkdir(parents=True, exist_ok=True)
        write_atomic(local / name, text)


RECIPE_HISTORY_FILE = "recipe_history.jsonl"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else key))
    return out


def recipe_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """Dotted key -> [old, new] for every leaf that differs (a key only one side has included)."""
    a, b = _flat(old), _flat(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def prepare_run_dir(recipe: Recipe, spec: ModelSpec, is_main: bool = True, resumed_at: int | None = None) -> RunPath:
    """Create the run dir and write the resolved recipe and spec (main process only).

    A fresh run writes ``recipe.yaml``. A resumed run (``resumed_at``: the checkpoint's step)
    keeps it as the record of what the run started with; the keys this launch changes (the
    ones allowed to change: cadences, steps, anything ``checkpoint.allow_recipe_change`` let
    through) are printed and appended with the step to ``recipe_history.jsonl``."""
    run_dir = recipe.resolved_run_dir()
    if is_main:
        backend(run_dir).makedirs(str(run_dir))
        recorded = run_dir / "recipe.yaml"
        current = recipe.model_dump(mode="json")
        if resumed_at is not None and _exists(recorded):
            history = _read_history(run_dir)
            effective = yaml.safe_load(history[-1]["recipe"]) if history else yaml.safe_load(_read_text(recorded))
            changes = recipe_changes(effective or {}, current)
            if changes:
                for key, (old, new) in changes.items():
                    print(f"recipe change at step {resumed_at}: {key}: {old!r} -> {new!r}", flush=True)
                record = {"step": resumed_at, "changes": changes, "recipe": recipe.to_yaml()}
                lines = [json.dumps(r) for r in [*history, record]]
                # whole, never half a line
                _write_run_file(run_dir, RECIPE_HISTORY_FILE, "\n".join(lines) + "\n")
        else:  # a fresh start: its recipe, and no history of an earlier run's resumes
            _write_run_file(run_dir, "recipe.yaml", recipe.to_yaml())
            backend(run_dir).delete(str(run_dir / RECIPE_HISTORY_FILE))
            if isinstance(run_dir, URLPath):
                (local_copy(run_dir) / RECIPE_HISTORY_FILE).unlink(missing_ok=True)
        _write_run_file(run_dir, "spec.json", spec.model_dump_json(indent=2))
    return run_dir


def _read_history(run_dir: RunPath) -> list[dict[str, Any]]:
    path = run_dir / RECIPE_HISTORY_FILE
    if not _exists(path):
        return []
    return [json.loads(line) for line in _read_text(path).splitlines() if line.strip()]

"""The run dir: what names it (`RunPath`, `run_path`), process 0's local copy of a URL run dir
(`local_copy`), and the record of the recipe it runs (`prepare_run_dir`).

    RUN/recipe.yaml        the resolved recipe the run started with
    RUN/recipe_history.jsonl  per resume that changed keys: {"step", "changes": {key: [old, new]}, "recipe"}
    RUN/spec.json          the resolved ModelSpec
    RUN/metrics.jsonl      ``olmo_run.metrics``; RUN/loss.png its plot
    RUN/checkpoints/       ``olmo_run.checkpoints``

RUN may be a local folder or a ``gs://`` / ``s3://`` URL (docs/design.md, contract 8): a `Path`
or an ``olmo_data.fileio.URLPath``, and every file operation on it is a call of
``olmo_data.fileio``, the one I/O layer. What that means on object storage:

- writes are whole objects (one PUT, or a multipart / resumable upload the store publishes
  only once complete): meta.json, written last, commits a checkpoint without a rename;
- deletes go object by object below a prefix (keep-N pruning, clean-up of interrupted saves);
- sha256 of a checkpoint's files streams each object (``fileio.sha256``), never whole;
- every failure is a one-line ``fileio.StorageError`` naming the URL and the fix (missing
  credentials, unknown bucket, permission, network);
- nothing can be appended, so the small files process 0 keeps growing (metrics.jsonl,
  loss.png) are written to a local copy (`local_copy`) and uploaded whole.

Credentials and endpoints come from where the clients look (fileio's docstring): for S3 the
``AWS_*`` variables (``AWS_ENDPOINT_URL`` for another endpoint), for GCS Application Default
Credentials, or ``STORAGE_EMULATOR_HOST`` for an emulator.
"""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_model.spec import ModelSpec

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from olmo_run.recipe import Recipe

# A run dir, or a path inside one: local, or on object storage.
RunPath = Path | URLPath


def run_path(text: str | os.PathLike | URLPath) -> RunPath:
    """A path as named by a recipe or a command line: a `URLPath` for gs:// and s3://, a local
    Path otherwise (``file:///x`` is the local ``/x``). Other schemes are a ValueError."""
    if isinstance(text, (URLPath, Path)):
        return text
    text = os.fspath(text)
    head, sep, rest = text.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        scheme = head.lower()
        if scheme in fileio.REMOTE_SCHEMES:
            return URLPath(f"{scheme}://{rest}")
        if scheme == "file":
            return Path(urllib.parse.unquote(urllib.parse.urlparse(text).path))
        raise ValueError(f"{text}: URL scheme {scheme}:// is not supported; use a local path, file://, gs:// or s3://")
    return Path(text)


def local_copy_root() -> Path:
    """Where the local copies of remote run dirs live: $OLMO_CACHE/run-dirs (default
    ~/.cache/olmo-twin/run-dirs), one folder per URL (scheme/bucket/key)."""
    return Path(os.environ.get("OLMO_CACHE") or Path.home() / ".cache" / "olmo-twin") / "run-dirs"


def local_copy(run_dir: RunPath) -> Path:
    """The folder holding process 0's copy of a run dir's small files (metrics.jsonl, loss.png,
    recipe.yaml, spec.json): the run dir itself when local, else a folder derived from the URL."""
    if isinstance(run_dir, Path):
        return run_dir
    return local_copy_root() / run_dir.scheme / run_dir.bucket / run_dir.key


def check_reachable(run_dir: RunPath) -> None:
    """For a URL run dir, one listing of it: a missing bucket, missing or rejected credentials,
    a denied listing or an unreachable endpoint is a one-line StorageError now, before the
    slower start-up checks, not at the first checkpoint. A local run dir has nothing to probe."""
    if isinstance(run_dir, URLPath):
        fileio.listdir(run_dir)


def _write_run_file(run_dir: RunPath, name: str, text: str) -> None:
    """A small file of the run dir; for a URL run dir also into its local copy."""
    fileio.write_text(run_dir / name, text)
    if isinstance(run_dir, URLPath):
        local = local_copy(run_dir)
        local.mkdir(parents=True, exist_ok=True)
        fileio.write_text(local / name, text)


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
        fileio.makedirs(run_dir)
        recorded = run_dir / "recipe.yaml"
        current = recipe.model_dump(mode="json")
        if resumed_at is not None and fileio.exists(recorded):
            history = _read_history(run_dir)
            effective = yaml.safe_load(history[-1]["recipe"]) if history else yaml.safe_load(fileio.read_text(recorded))
            changes = recipe_changes(effective or {}, current)
            if changes:
                for key, (old, new) in changes.items():
                    log.info(f"recipe change at step {resumed_at}: {key}: {old!r} -> {new!r}")
                record = {"step": resumed_at, "changes": changes, "recipe": recipe.to_yaml()}
                lines = [json.dumps(r) for r in [*history, record]]
                # whole, never half a line
                _write_run_file(run_dir, RECIPE_HISTORY_FILE, "\n".join(lines) + "\n")
        else:  # a fresh start: its recipe, and no history of an earlier run's resumes
            _write_run_file(run_dir, "recipe.yaml", recipe.to_yaml())
            fileio.delete(run_dir / RECIPE_HISTORY_FILE)
            if isinstance(run_dir, URLPath):
                (local_copy(run_dir) / RECIPE_HISTORY_FILE).unlink(missing_ok=True)
        _write_run_file(run_dir, "spec.json", spec.model_dump_json(indent=2))
    return run_dir


def _read_history(run_dir: RunPath) -> list[dict[str, Any]]:
    path = run_dir / RECIPE_HISTORY_FILE
    if not fileio.exists(path):
        return []
    return [json.loads(line) for line in fileio.read_text(path).splitlines() if line.strip()]

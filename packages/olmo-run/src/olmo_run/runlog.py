"""Framework-neutral run plumbing both trainers share: the run dir, metrics JSONL, the spike
guard, training-state metadata checks, the end-of-run summary and the loss-curve PNG.

Run dir layout (the same for both trainers, so one tool reads both)::

    RUN/recipe.yaml        the resolved recipe the run started with
    RUN/recipe_history.jsonl  per resume that changed keys: {"step", "changes": {key: [old, new]}, "recipe"}
    RUN/spec.json          the resolved ModelSpec
    RUN/metrics.jsonl      one JSON object per line: kind "train" (per step) or "eval"
    RUN/checkpoints/step_00000010/   a checkpoint (framework format inside); complete once its
                                     meta.json exists, which lists every other file's size and sha256
    RUN/loss.png           loss curve (train and held-out)

RUN may be a local folder or a ``gs://`` / ``s3://`` URL (``olmo_run.storage``: a `URLPath`,
served by the backend olmo_run registers). Every function here takes either. On object storage,
where nothing can be appended or renamed, checkpoints are written straight to the bucket and
committed by meta.json, one object written after all the others; the small files process 0
keeps growing (metrics.jsonl, loss.png) are written to a local copy
(``storage.local_copy``: $OLMO_CACHE/run-dirs/SCHEME/BUCKET/KEY) and uploaded whole by
``MetricsLog.flush`` (at every checkpoint, every ``METRICS_UPLOAD_S`` seconds and at the end)
and ``plot_loss``; a run resumed on a fresh host first refreshes that copy from the bucket.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import TypeAdapter, ValidationError

from olmo_model.schedules import Schedule
from olmo_model.spec import ModelSpec

from .recipe import MoESection, OptimSection, Recipe, TrainSection
from .storage import RunPath, URLPath, backend, local_copy, run_path

# Keys of a "train" metrics line; both trainers write exactly these (plus optional extras).
TRAIN_KEYS = (
    "kind",
    "step",
    "loss",
    "ce_loss",
    "z_loss",
    "lr",
    "grad_norm",
    "skipped",
    "tokens_seen",
    "tokens_per_second",
    "tokens_per_second_per_device",
    "tflops_per_device",
    "mfu",
    "mfu_peak",
    "step_time",
    "data_wait",  # seconds of step_time spent waiting for the batch
    "memory_gib",  # device memory in use on process 0 after the step (host RSS on CPU)
    "memory_peak_gib",  # the peak of that since the process started
    "memory_kind",  # "device" or "host_rss": what the two memory figures measure
    "batch_digest",  # olmo_data.digest of the global batch this step trained (step - 1)
    "time",
)


class TrainingStateError(ValueError):
    """A checkpoint that does not fit this run (another spec, framework or mixture)."""


class TrainingDivergedError(RuntimeError):
    """The run cannot go on: a non-finite loss, grad norm, parameter or moment, or more skipped
    steps in a row than the spike guard allows. Raised before any checkpoint of that state is
    written, so the newest checkpoint is the last good state; the CLIs exit with status 3."""


class RunDirWriteError(RuntimeError):
    """A write into the run dir failed mid-run (a full disk, a quota, an I/O error): the run
    stops at once with one line naming the file, the OS's reason and the fix, and the newest
    complete checkpoint stays the one a rerun resumes from; the CLIs exit with status 5."""


class CheckpointWriteError(RunDirWriteError):
    """A checkpoint could not be written or committed. It has no meta.json, so resume ignores
    it, and the next start removes what it left (``clean_orphans``)."""


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (loss above ~709.78)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


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


# ---- checkpoints: metadata shared by both trainers -----------------------------------------

META_FILE = "meta.json"
# Format /2 lists every other file of the checkpoint with its size and sha256 (meta["files"]);
# /1 checkpoints were written before that and are resumed unverified, with a warning.
CHECKPOINT_FORMAT = "olmo-twin-checkpoint/2"
UNCHECKED_FORMAT = "olmo-twin-checkpoint/1"
_META_KEYS = ("framework", "step", "spec", "recipe", "loader_state")
_ATOMIC_TEMP = re.compile(r"\..+\.tmp-(\d+)")  # write_atomic's temporaries
_CONVERT_STAGING = re.compile(r"\.convert-(\d+)")  # olmo-convert's staging dir inside checkpoints/


class CheckpointDamagedError(TrainingStateError):
    """A checkpoint whose files are not the ones it was committed with, or whose meta.json cannot
    be read; ``checkpoint.fallback`` resumes from an older one instead."""


def loud(text: str) -> None:
    """A warning nobody may miss: one line on stderr, starting with "!!!"."""
    print(f"!!! {text}", file=sys.stderr, flush=True)


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
    fs = backend(root)
    out: list[tuple[int, RunPath]] = []
    for name in fs.listdir(str(root)):
        p = root / name
        step = _step_of(p)
        if step is not None and fs.exists(str(p / META_FILE)):
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
        meta = json.loads(_read_text(path))
    except FileNotFoundError:
        raise TrainingStateError(f"{ckpt}: no meta.json; this is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointDamagedError(f"{path}: unreadable ({err}); the checkpoint is damaged") from None
    missing = [k for k in _META_KEYS if k not in meta] if isinstance(meta, dict) else list(_META_KEYS)
    if missing:
        raise CheckpointDamagedError(f"{path}: has no {', '.join(missing)}; the checkpoint is damaged")
    return meta


def _sha256(path: RunPath) -> str:
    return backend(path).sha256(str(path))


def _sha256_all(paths: list[RunPath]) -> list[str]:
    """The sha256 of each file, several files at once (hashlib releases the GIL while it hashes;
    on object storage the downloads overlap). A remote file is streamed, never held whole."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 1) * 2, len(paths)))) as pool:
        return list(pool.map(_sha256, paths))


def _files_below(folder: RunPath) -> list[str]:
    """Every file below ``folder``, as paths relative to it (posix separators), sorted."""
    found = backend(folder).find(str(folder))
    if isinstance(folder, URLPath):
        return sorted(URLPath(f).relative(folder) for f in found)
    return sorted(Path(f).relative_to(folder).as_posix() for f in found)


def checkpoint_files(ckpt: RunPath) -> dict[str, dict[str, Any]]:
    """{path relative to ckpt: {"bytes", "sha256"}} of every file in the checkpoint except
    meta.json, which records them, and its write_atomic temporaries. On object storage this
    reads the checkpoint back once: what is recorded is what the bucket holds."""
    rels = [r for r in _files_below(ckpt) if not (r == META_FILE or r.startswith(f".{META_FILE}.tmp-"))]
    fs = backend(ckpt)
    paths = [ckpt / r for r in rels]
    return {
        rel: {"bytes": fs.size(str(p)), "sha256": digest} for rel, p, digest in zip(rels, paths, _sha256_all(paths))
    }


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
    fs = backend(ckpt)
    for path, size, _ in listed:
        if not fs.isfile(str(path)):
            raise CheckpointDamagedError(f"{path}: missing ({size} bytes when committed); the checkpoint is damaged")
        if (got_size := fs.size(str(path))) != size:
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


def check_meta_fits(meta: dict[str, Any], ckpt: RunPath, spec: ModelSpec, framework: str | None = None) -> None:
    """Refuse a checkpoint of another framework or spec, naming the first differing field."""
    if framework is not None and meta.get("framework") != framework:
        raise TrainingStateError(
            f"{ckpt}: a {meta.get('framework')} checkpoint cannot be resumed by the {framework} trainer; "
            f"convert it first with olmo-convert"
        )
    theirs = ModelSpec.model_validate(meta["spec"])
    if theirs != spec:
        mine = spec.model_dump()
        other = theirs.model_dump()
        diff = [k for k in mine if mine[k] != other.get(k) and k != "name"]
        if diff:
            k = diff[0]
            raise TrainingStateError(
                f"{ckpt}: checkpoint spec differs from the recipe's model in '{k}' "
                f"(checkpoint {other.get(k)!r}, recipe {mine[k]!r}); use the checkpoint's model or a new run_dir"
            )


# The recipe sections whose fields change the maths of a continued run: (section, schema, the
# fields compared, None for all). Everything else may change on resume: the layout (mesh,
# micro-batch, torch/jax sections, which an elastic resize changes), logging, eval and
# checkpoint cadence, run_dir, init, the spike guard and the data knobs (the mixture itself
# is checked by its fingerprint). train.steps/tokens are compared through the schedule.
_MATHS_SECTIONS: tuple[tuple[str, Any, tuple[str, ...] | None], ...] = (
    ("train", TrainSection, ("precision", "document_masking", "global_batch_tokens", "sequence_length")),
    ("optim", OptimSection, None),
    ("schedule", Schedule, None),
    ("moe", MoESection, None),  # MoE specs only
)


def _maths_changes(
    theirs: dict[str, Any], recipe: Recipe, spec: ModelSpec, sequence_length: int, step: int
) -> list[tuple[str, Any, Any, str]]:
    """(field, checkpoint's value, recipe's value, why) of every change ``recipe`` makes to the
    checkpoint's recipe ``theirs`` that changes the maths of the run continued at ``step``.
    A section is read with this schema's defaults for fields written before they existed."""
    ours = recipe.model_dump(mode="json")
    changes: list[tuple[str, Any, Any, str]] = []
    old_train: dict[str, Any] = {}
    for section, schema, fields in _MATHS_SECTIONS:
        if section == "moe" and spec.moe is None:
            continue
        try:
            old = TypeAdapter(schema).validate_python(theirs.get(section, {})).model_dump(mode="json")
        except ValidationError:  # a schema this one cannot read: compared as written
            old = theirs.get(section, {})
        new = ours[section]
        if section == "train":
            old_train = old
        keys = ("kind",) if section == "schedule" and old.get("kind") != new["kind"] else fields or tuple(new)
        for key in keys:
            a, b = old.get(key), new.get(key)
            if section == "train" and key == "sequence_length":  # null: the mixture's
                a, b = a or sequence_length, b or sequence_length
            if a != b:
                changes.append((f"{section}.{key}", a, b, ""))
    old_total = recipe.model_copy(update={"train": TrainSection.model_construct(**old_train)}).total_steps()
    new_total = recipe.total_steps()
    if old_total != new_total:
        # A new total is harmless when the schedule gives every step taken so far the same LR
        # under both (warmup, a constant LR, WSD's stable phase): the run is then exactly what
        # the new recipe would have produced. Elsewhere it bends the curve mid-run.
        sched, peak = recipe.schedule, recipe.optim.lr
        first = next(
            (s for s in range(1, step + 1) if sched.lr(s, peak, old_total) != sched.lr(s, peak, new_total)), None
        )
        key = "train.steps" if recipe.train.steps is not None else "train.tokens (in steps)"
        if first is None:
            print(
                f"{key}: {old_total} -> {new_total}; the {sched.kind} schedule gave steps 1-{step} the same "
                "LR under both, so the run continues as if planned that way",
                flush=True,
            )
        else:
            changes.append(
                (
                    key,
                    old_total,
                    new_total,
                    (
                        f", which changes the LR the {sched.kind} schedule gives the {step} steps already taken "
                        f"(step {first}: {sched.lr(first, peak, new_total):.4g} instead of "
                        f"{sched.lr(first, peak, old_total):.4g})"
                    ),
                )
            )
    return changes


def check_recipe_continues(
    meta: dict[str, Any], ckpt: RunPath, recipe: Recipe, spec: ModelSpec, sequence_length: int, step: int
) -> None:
    """Refuse a resume whose recipe changes the maths of the run so far (precision, optimizer,
    schedule, batch, sequence length, the total steps where the schedule depends on it), naming
    the field, both values and the fix; with checkpoint.allow_recipe_change, say each loudly,
    except a new global batch size, which no resume can take (the data order is per step)."""
    changes = _maths_changes(meta["recipe"], recipe, spec, sequence_length, step)
    for key, old, new, _ in changes:
        if key == "train.global_batch_tokens":
            # Not even with allow_recipe_change: the data order maps step N to the sequences
            # [N*B, (N+1)*B) of one fixed order (contract 3), so step N at another batch size B
            # would skip or repeat data. A stage that changes the batch is a new run from here.
            raise TrainingStateError(
                f"{ckpt}: the recipe changes {key} from {old!r} (checkpoint) to {new!r}, which a resume cannot "
                "take, even with checkpoint.allow_recipe_change: the data order maps each step to its batch by "
                f"the batch size, so step {step} on would skip or repeat data; set it back to {old!r}, or start "
                f"a new stage from this checkpoint in a new run_dir (--init.checkpoint={ckpt} "
                "--init.load_optimizer=true; its data order starts at step 0)"
            )
    if changes and not recipe.checkpoint.allow_recipe_change:
        key, old, new, why = changes[0]
        raise TrainingStateError(
            f"{ckpt}: the recipe changes {key} from {old!r} (checkpoint) to {new!r}{why}; set it back to {old!r}, "
            f"use a new run_dir (init.checkpoint={ckpt} starts from its weights), or pass "
            "--checkpoint.allow_recipe_change=true to continue anyway"
        )
    for key, old, new, why in changes:
        loud(
            f"{ckpt}: {key} changed from {old!r} to {new!r}{why}; "
            "continuing because checkpoint.allow_recipe_change=true"
        )


def commit_checkpoint(ckpt: RunPath, meta: dict[str, Any]) -> None:
    """Mark a checkpoint complete once the framework's save has finished: meta.json, which adds
    the size and sha256 of every other file of the checkpoint ("files"), is written last and
    atomically (on object storage: one PUT after every other object was uploaded; a failed
    PUT leaves no meta.json, so the previous checkpoint stays the latest)."""
    write_atomic(ckpt / META_FILE, json.dumps({**meta, "files": checkpoint_files(ckpt)}, indent=2))


# TensorStore (Orbax's array writer) reports a failed system call as a ValueError whose text
# carries the errno ("... No space left on device [os_error_code='28']"), not as an OSError.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
# The reasons whose fix is room on the file system: none left, or the quota used up.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_WriteError = TypeVar("_WriteError", bound=RunDirWriteError)


def _exception_chain(errors: tuple[BaseException, ...]) -> list[BaseException]:
    """Each exception, then what it was raised from or during (__cause__, __context__), once each."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = list(errors)
    while todo:
        err = todo.pop(0)
        if err is not None and not any(err is s for s in seen):
            seen.append(err)
            todo += [err.__cause__, err.__context__]
    return seen


def os_error_code(*errors: BaseException) -> int | None:
    """The errno of the failed system call behind ``errors``: an OSError anywhere in their
    __cause__ / __context__ chains, or TensorStore's ``os_error_code`` in an exception's text."""
    for err in _exception_chain(errors):
        if isinstance(err, OSError) and err.errno:
            return err.errno
        if (found := _OS_ERROR_CODE.search(str(err))) is not None:
            return int(found[1])
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _free_space(path: RunPath) -> str:
    """The room left where ``path`` is, as " (N MiB free there)", for a local path (its nearest
    existing folder); "" for a URL."""
    if isinstance(path, URLPath):
        return ""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f" ({_size(shutil.disk_usage(folder).free)} free there)"
    except OSError:
        return ""


def write_failure(
    kind: type[_WriteError],
    doing: str,
    target: RunPath,
    run_dir: RunPath,
    code: int | None,
    reason: str | None = None,
    after: str = "",
) -> _WriteError:
    """The one-line error for a write of ``target`` that failed (``doing``: "saving checkpoint",
    "appending to"): the reason (``reason``, else the OS's words for the errno ``code``, such as
    "No space left on device" for ENOSPC), the room left there, the checkpoint a rerun resumes
    from and the fix, then ``after``."""
    reason = reason or (os.strerror(code) if code is not None else "an unknown failure")
    try:
        done: list[tuple[int, RunPath]] | None = complete_checkpoints(run_dir)
    except Exception:  # the listing may fail as the write did: the line then names no step
        done = None
    fix = "free space there (or lower checkpoint.keep)" if code in _NO_ROOM else "fix that"
    if done is None:
        latest = f"{fix}, then rerun to resume from the newest complete checkpoint"
    elif done:
        latest = f"{done[-1][1].name} stays the latest checkpoint: {fix}, then rerun to resume from it"
    else:
        latest = f"no checkpoint was committed yet: {fix}, then rerun to start again"
    return kind(f"{doing} {target} failed: {reason}{_free_space(target)}; {latest}{after}")


def checkpoint_write_failure(
    ckpt: RunPath, run_dir: RunPath, code: int | None, reason: str | None = None
) -> CheckpointWriteError:
    """``write_failure`` for a checkpoint that could not be saved or committed (no meta.json)."""
    after = f" (the unfinished {ckpt.name} is removed when it starts)"
    return write_failure(CheckpointWriteError, "saving checkpoint", ckpt, run_dir, code, reason, after)


def _remove_checkpoint(path: RunPath) -> None:
    # meta.json first: a removal cut short leaves an incomplete checkpoint, never a complete
    # one with files missing. On object storage the rest goes object by object.
    fs = backend(path)
    fs.delete(str(path / META_FILE))
    fs.delete(str(path), recursive=True)


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
    before the run writes again), and write_atomic temporaries (.NAME.tmp-PID) and
    olmo-convert staging dirs (checkpoints/.convert-PID) of processes no longer alive. Called
    by the main process at start-up, after every check passed (one run owns its run dir).
    On object storage only the step_* objects are cleaned: uploads leave no temporaries, and a
    PID names no process of another host."""
    done = complete_checkpoints(run_dir)
    stale: list[tuple[RunPath, str, bool]] = []  # (path, why, is a folder)
    root = run_dir / "checkpoints"
    fs = backend(run_dir)
    local = not isinstance(run_dir, URLPath)
    for name in fs.listdir(str(root)):
        p = root / name
        step, staging = _step_of(p), _CONVERT_STAGING.fullmatch(name)
        if local and staging and not pid_alive(int(staging[1])):
            stale.append((p, "staging dir of an olmo-convert that is gone", True))
        elif step is not None and not fs.exists(str(p / META_FILE)):
            stale.append((p, "no meta.json (an interrupted or failed save, or prune)", True))
    for folder in (run_dir, *(p for _, p in done)) if local else ():
        for name in fs.listdir(str(folder)):
            p = folder / name
            temp = _ATOMIC_TEMP.fullmatch(name)
            if temp and fs.isfile(str(p)) and not pid_alive(int(temp[1])):
                stale.append((p, "temporary file of a write that never finished", False))
    for p, why, is_folder in stale:
        fs.delete(str(p), recursive=is_folder)
        print(f"removed {p}: {why}", flush=True)


def _newest_verified(
    run_dir: RunPath, done: list[tuple[int, RunPath]], fallback: bool
) -> tuple[int, RunPath, dict[str, Any]]:
    """(step, ckpt, meta) of the newest checkpoint that reads and verifies. A damaged newer one
    is an error naming the one a fallback would take, unless ``fallback``: then it is skipped
    loudly (and deleted once the resumed run commits its first checkpoint)."""
    damaged: list[tuple[RunPath, CheckpointDamagedError]] = []
    for step, ckpt in reversed(done):
        try:
            meta = read_verified_meta(ckpt)
        except CheckpointDamagedError as err:
            damaged.append((ckpt, err))
            continue
        if damaged and not fallback:
            raise CheckpointDamagedError(
                f"{damaged[0][1]}; --checkpoint.fallback=true resumes from step {step} ({ckpt.name}, the newest "
                f"checkpoint that verifies), or restore {damaged[0][0].name} from a copy"
            )
        for bad, bad_err in damaged:
            loud(
                f"{bad.name} skipped: {bad_err}; resuming from {ckpt.name} (step {step}) because "
                f"checkpoint.fallback=true; {bad.name} is deleted when this run commits its first checkpoint"
            )
        return step, ckpt, meta
    raise CheckpointDamagedError(
        f"{damaged[0][1]}; no older checkpoint of {run_dir} verifies either: restore one from a copy, "
        "or use a new run_dir"
    )


def find_resume(run_dir: RunPath, recipe: Recipe, spec: ModelSpec, framework: str, loader: Any, total_steps: int):
    """The latest complete checkpoint to resume from, verified against the checksums in its
    meta.json and checked against this run before anything is written: (step, ckpt, meta), or
    None for a fresh run. ``loader`` is the run's MixtureLoader; its state is restored here (a
    changed mixture fingerprint is an error unless the recipe allows it). A damaged newest
    checkpoint is an error, or with checkpoint.fallback skipped for the newest that verifies;
    a recipe that changes the maths of the run is an error unless checkpoint.allow_recipe_change."""
    done = complete_checkpoints(run_dir)
    if not done:
        return None
    if not recipe.checkpoint.resume:
        raise TrainingStateError(
            f"{run_dir}: has checkpoints up to step {done[-1][0]} but checkpoint.resume is false; "
            "use a new run_dir (or name), or set checkpoint.resume=true"
        )
    step, ckpt, meta = _newest_verified(run_dir, done, recipe.checkpoint.fallback)
    check_meta_fits(meta, ckpt, spec, framework)
    if step > total_steps:
        raise TrainingStateError(
            f"{ckpt}: the run is at step {step}, past this recipe's {total_steps} steps; "
            f"raise train.steps to at least {step} or use a new run_dir"
        )
    # The recipe before the loader state: a changed batch size is named as the recipe change it is.
    check_recipe_continues(meta, ckpt, recipe, spec, loader.mixture.sequence_length, step)
    loader.load_state_dict(meta["loader_state"], allow_fingerprint_mismatch=recipe.data.allow_fingerprint_mismatch)
    if loader.step != step:
        raise TrainingStateError(f"{ckpt}: loader state is at step {loader.step} but meta.json says {step}; damaged")
    return step, ckpt, meta


class ProgressConsole:
    """A rich progress bar on a terminal when log.progress (main process only), plain lines
    otherwise. The bar starts at the first finished step, so start-up lines print plainly."""

    def __init__(self, enabled: bool, is_main: bool, total: int, start: int):
        import sys

        self.is_main = is_main
        self.enabled = enabled and is_main and sys.stderr.isatty()
        self.total, self.start = total, start
        self.progress: Any = None

    def line(self, text: str) -> None:
        if not self.is_main:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def advance(self, info: str) -> None:
        if not self.enabled:
            return
        if self.progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.progress.add_task("train", total=self.total, completed=self.start, info="")
            self.progress.start()
        self.progress.update(self.task, advance=1, info=info)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


# ---- spike guard ------------------------------------------------------------------------------


@dataclass
class SpikeGuard:
    """Decides, from accepted history only, whether a step's loss or grad norm is a spike, and
    when the run must stop instead (``decide``)."""

    enabled: bool = False
    window: int = 128
    sigma: float = 6.0
    min_history: int = 20
    max_consecutive_skips: int = 10
    losses: deque = field(default_factory=deque)
    norms: deque = field(default_factory=deque)
    consecutive_skips: int = 0

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> SpikeGuard:
        g = recipe.spike_guard
        return cls(
            enabled=g.enabled,
            window=g.window,
            sigma=g.sigma,
            min_history=g.min_history,
            max_consecutive_skips=g.max_consecutive_skips,
        )

    def decide(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when this step's update must be skipped. Raises TrainingDivergedError for a
        non-finite loss or grad norm without the guard (nothing could undo that update), and
        after more than ``max_consecutive_skips`` skips in a row with it."""
        if not self.enabled:
            if math.isfinite(loss) and math.isfinite(grad_norm):
                return False
            raise TrainingDivergedError(
                f"step {step}: loss {loss} / grad norm {grad_norm} is not finite; stopped before any checkpoint "
                "of this state was written; resume from the newest checkpoint with a lower optim.lr "
                "(--optim.lr=... --checkpoint.allow_recipe_change=true), or --spike_guard.enabled=true to skip such steps"
            )
        if not self.should_skip(loss, grad_norm):
            self.consecutive_skips = 0
            self.record(loss, grad_norm)
            return False
        self.consecutive_skips += 1
        if self.consecutive_skips > self.max_consecutive_skips:
            raise TrainingDivergedError(
                f"step {step}: the spike guard skipped {self.consecutive_skips} steps in a row (loss {loss}, "
                f"grad norm {grad_norm}; spike_guard.max_consecutive_skips={self.max_consecutive_skips}): the "
                "weights no longer recover; resume from an earlier checkpoint with a lower optim.lr "
                "(--optim.lr=... --checkpoint.allow_recipe_change=true)"
            )
        return True

    @staticmethod
    def _too_high(history: deque, value: float, sigma: float) -> bool:
        n = len(history)
        mean = sum(history) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in history) / n)
        return value > mean + sigma * std

    def should_skip(self, loss: float, grad_norm: float) -> bool:
        if not self.enabled:
            return False
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return True
        if len(self.losses) < self.min_history:
            return False
        return self._too_high(self.losses, loss, self.sigma) or self._too_high(self.norms, grad_norm, self.sigma)

    def record(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.norms.append(grad_norm)
        while len(self.losses) > self.window:
            self.losses.popleft()
            self.norms.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "norms": list(self.norms), "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque(state.get("losses", []))
        self.norms = deque(state.get("norms", []))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))


def refuse_non_finite_state(step: int, run_dir: RunPath) -> None:
    """Stop instead of checkpointing a state whose parameters or moments are not finite."""
    done = complete_checkpoints(run_dir)
    newest = f"the newest checkpoint is step {done[-1][0]}" if done else "no checkpoint was written before"
    raise TrainingDivergedError(
        f"step {step}: parameters or optimizer moments are not finite; not checkpointing them ({newest}); "
        "resume from it with a lower optim.lr (--optim.lr=... --checkpoint.allow_recipe_change=true)"
    )


# ---- metrics --------------------------------------------------------------------------------


# Seconds between uploads of a remote run dir's metrics.jsonl while steps are logged (besides
# the upload at every checkpoint and at the end): what a dashboard reading the bucket lags by.
METRICS_UPLOAD_S = 60.0


class MetricsLog:
    """Appends JSON lines to RUN/metrics.jsonl. On resume, lines past the resumed step are
    dropped first, so a re-trained step is not logged twice.

    For a URL run dir the lines are appended to the local copy (``storage.local_copy``) and
    ``flush`` uploads the whole file as one object (object storage has no append); it runs at
    every checkpoint (the driver calls it), at most ``METRICS_UPLOAD_S`` apart while logging,
    and at the end. On start the local copy is first replaced by the bucket's file, so a run
    resumed on another host continues the same log.

    A write that fails (a full disk) is a one-line RunDirWriteError naming the file and the
    reason: the run stops there (exit status 5), and the rerun drops a line it left cut short."""

    def __init__(self, run_dir: RunPath, resume_step: int = 0, enabled: bool = True):
        self.run_dir = run_dir
        self.remote = run_dir / "metrics.jsonl" if isinstance(run_dir, URLPath) else None
        self.path = local_copy(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.started = time.time()
        self._uploaded = time.monotonic()
        if not enabled:
            return
        if self.remote is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if _exists(self.remote):
                write_atomic(self.path, _read_text(self.remote))
            else:
                self.path.unlink(missing_ok=True)  # a stale copy of an earlier run under this URL
        if self.path.exists():
            kept = [line for line, record in _metric_lines(self.path) if record.get("step", 0) <= resume_step]
            try:
                write_atomic(self.path, "".join(line + "\n" for line in kept))
            except OSError as err:
                raise self._failure("rewriting", err) from None
            self.flush()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            raise self._failure("appending to", err) from None
        if self.remote is not None and time.monotonic() - self._uploaded >= METRICS_UPLOAD_S:
            self.flush()

    def flush(self) -> None:
        """Upload the local copy to a URL run dir (nothing to do for a local one)."""
        if self.enabled and self.remote is not None and self.path.exists():
            backend(self.remote).upload(str(self.path), str(self.remote))
            self._uploaded = time.monotonic()

    def _failure(self, doing: str, err: OSError) -> RunDirWriteError:
        reason = None if err.errno else str(err)
        return write_failure(RunDirWriteError, doing, self.path, self.run_dir, err.errno, reason)


def _metric_lines(path: RunPath) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every record. A last line with no newline after it that is not JSON
    is an append cut short (disk full, a kill mid-write) and is left out; anywhere else, a
    line that is not JSON means the file was damaged, which is an error."""
    lines = _read_text(path).split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise TrainingStateError(
                f"{path}: line {i + 1} is not JSON; the metrics log is damaged: repair or delete that line"
            ) from None
    return out


def read_metrics(path: RunPath | str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, or of RUN/metrics.jsonl given the run dir (local or URL)."""
    if isinstance(path, str):
        path = run_path(path)
    if isinstance(path, URLPath):
        path = path if path.name.endswith(".jsonl") else path / "metrics.jsonl"
    elif path.is_dir():
        path = path / "metrics.jsonl"
    return [record for _, record in _metric_lines(path)]


def final_eval_pending(run_dir: RunPath, step: int, held_out: list[str]) -> bool:
    """Whether a run whose last checkpoint is its final ``step`` still lacks its end: the eval
    line of that step (when it has held-out sources) or the loss plot (a kill between the final
    checkpoint and those leaves them unwritten)."""
    import importlib.util

    if not _exists(run_dir / "loss.png") and importlib.util.find_spec("matplotlib") is not None:
        return True
    return bool(held_out) and not eval_logged(run_dir, step)


def eval_logged(run_dir: RunPath, step: int) -> bool:
    """Whether the run dir's metrics.jsonl holds an eval line of ``step``."""
    if not _exists(run_dir / "metrics.jsonl"):
        return False
    return any(r.get("kind") == "eval" and r.get("step") == step for r in read_metrics(run_dir))


def plot_loss(run_dir: RunPath) -> Path | None:
    """Write RUN/loss.png with the training loss and held-out losses; None without matplotlib.
    For a URL run dir it is drawn from the local copy's metrics, written there and uploaded;
    the local file is returned."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    local = local_copy(run_dir)
    records = read_metrics(local)
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and not r.get("skipped")]
    evals: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.get("kind") == "eval":
            for name, vals in r["eval"].items():
                evals.setdefault(name, []).append((r["step"], vals["loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    for name, pts in evals.items():
        ax.plot(*zip(*pts), "o-", label=f"held-out {name}", lw=1, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = local / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    if isinstance(run_dir, URLPath):
        backend(run_dir).upload(str(out), str(run_dir / "loss.png"))
    return out


def print_summary(run_dir: RunPath, title: str) -> None:
    """A short table at the end of a run: first/last loss, held-out losses, throughput."""
    from rich.console import Console
    from rich.table import Table

    records = read_metrics(local_copy(run_dir))
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    if train:
        table.add_row("steps", str(train[-1]["step"]))
        table.add_row("first loss", f"{train[0]['loss']:.4f}")
        table.add_row("last loss", f"{train[-1]['loss']:.4f}")
        timed = train[1:] or train  # the first step includes compilation
        tps = sum(r["tokens_per_second_per_device"] for r in timed) / len(timed)
        table.add_row("tokens/s/device (mean, excl. step 1)", f"{tps:,.0f}")
        table.add_row("MFU (mean)", f"{sum(r['mfu'] for r in timed) / len(timed):.1%} of {train[-1]['mfu_peak']}")
        table.add_row("skipped steps", str(sum(1 for r in train if r.get("skipped"))))
    if evals:
        for name, vals in evals[-1]["eval"].items():
            table.add_row(f"held-out {name} loss / ppl", f"{vals['loss']:.4f} / {vals['perplexity']:.2f}")
        if any(r.get("leakage_allowed") for r in evals):
            table.add_row("held-out leakage", "ALLOWED (data.allow_leakage=true): held-out figures may be memorised")
    Console(stderr=True).print(table)

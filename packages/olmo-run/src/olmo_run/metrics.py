"""The run's metrics: RUN/metrics.jsonl (one JSON object per line: kind "train" per step, or
"eval"), reading it back, and the loss curve RUN/loss.png (train and held-out).

For a ``gs://`` / ``s3://`` run dir, where nothing can be appended, the lines go to a local
copy (``run_dir.local_copy``: $OLMO_CACHE/run-dirs/SCHEME/BUCKET/KEY) uploaded whole by
``MetricsLog.flush`` (at every checkpoint, every ``METRICS_UPLOAD_S`` seconds and at the end)
and ``plot_loss``; a run resumed on a fresh host first refreshes that copy from the bucket.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from olmo_data import fileio
from olmo_data.fileio import URLPath

from .errors import RunDirWriteError, TrainingStateError
from .run_dir import RunPath, local_copy, run_path
from .write_failure import write_failure

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


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (loss above ~709.78)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


# Seconds between uploads of a remote run dir's metrics.jsonl while steps are logged (besides
# the upload at every checkpoint and at the end): what a dashboard reading the bucket lags by.
METRICS_UPLOAD_S = 60.0


class MetricsLog:
    """Appends JSON lines to RUN/metrics.jsonl. On resume, lines past the resumed step are
    dropped first, so a re-trained step is not logged twice.

    For a URL run dir the lines are appended to the local copy (``run_dir.local_copy``) and
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
            if fileio.exists(self.remote):
                fileio.write_text(self.path, fileio.read_text(self.remote))
            else:
                self.path.unlink(missing_ok=True)  # a stale copy of an earlier run under this URL
        if self.path.exists():
            kept = [line for line, record in _metric_lines(self.path) if record.get("step", 0) <= resume_step]
            try:
                fileio.write_text(self.path, "".join(line + "\n" for line in kept))
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
            fileio.put_file(self.path, self.remote)
            self._uploaded = time.monotonic()

    def _failure(self, doing: str, err: OSError) -> RunDirWriteError:
        reason = None if err.errno else str(err)
        return write_failure(RunDirWriteError, doing, self.path, self.run_dir, err.errno, reason)


def _metric_lines(path: RunPath) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every record. A last line with no newline after it that is not JSON
    is an append cut short (disk full, a kill mid-write) and is left out; anywhere else, a
    line that is not JSON means the file was damaged, which is an error."""
    lines = fileio.read_text(path).split("\n")
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

    plot = run_dir / "loss.png"
    if not fileio.exists(plot) and importlib.util.find_spec("matplotlib") is not None:
        return True
    return bool(held_out) and not eval_logged(run_dir, step)


def eval_logged(run_dir: RunPath, step: int) -> bool:
    """Whether the run dir's metrics.jsonl holds an eval line of ``step``."""
    log = run_dir / "metrics.jsonl"
    if not fileio.exists(log):
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
        fileio.put_file(out, run_dir / "loss.png")
    return out

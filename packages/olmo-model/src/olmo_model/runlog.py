"""Framework-neutral run plumbing both trainers share: the run dir, metrics JSONL, the spike
guard, training-state metadata checks, the end-of-run summary and the loss-curve PNG.

Run dir layout (the same for both trainers, so one tool reads both)::

    RUN/recipe.yaml        the resolved recipe, as run
    RUN/spec.json          the resolved ModelSpec
    RUN/metrics.jsonl      one JSON object per line: kind "train" (per step) or "eval"
    RUN/checkpoints/step_00000010/   complete checkpoints only (framework format inside)
    RUN/loss.png           loss curve (train and held-out)
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .recipe import Recipe
from .spec import ModelSpec

# Keys of a "train" metrics line; both trainers write exactly these (plus optional extras).
TRAIN_KEYS = (
    "kind", "step", "loss", "ce_loss", "z_loss", "lr", "grad_norm", "skipped", "tokens_seen",
    "tokens_per_second", "tokens_per_second_per_device", "tflops_per_device", "mfu", "mfu_peak",
    "step_time", "time",
)


class TrainingStateError(ValueError):
    """A checkpoint that does not fit this run (another spec, framework or mixture)."""


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_run_dir(recipe: Recipe, spec: ModelSpec, is_main: bool = True) -> Path:
    """Create the run dir and write the resolved recipe and spec (main process only)."""
    run_dir = recipe.resolved_run_dir()
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "recipe.yaml", recipe.to_yaml())
        write_atomic(run_dir / "spec.json", spec.model_dump_json(indent=2))
    return run_dir


# ---- checkpoints: metadata shared by both trainers -----------------------------------------

def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first. A checkpoint is complete when its
    ``meta.json`` exists: both trainers write it last, after the framework's own save finished,
    so an interrupted save never counts."""
    root = run_dir / "checkpoints"
    if not root.exists():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("step_") and (p / "meta.json").exists():
            try:
                out.append((int(p.name.removeprefix("step_")), p))
            except ValueError:
                continue
    return sorted(out)


def training_meta(
    framework: str, step: int, spec: ModelSpec, recipe: Recipe, loader_state: dict[str, Any], extra: dict | None = None
) -> dict[str, Any]:
    return {
        "format": "olmo-twin-checkpoint/1",
        "framework": framework,
        "step": step,
        "spec": spec.model_dump(mode="json"),
        "recipe": recipe.model_dump(mode="json"),
        "loader_state": loader_state,
        **(extra or {}),
    }


def read_meta(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "meta.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TrainingStateError(f"{ckpt}: no meta.json; this is not a complete checkpoint") from None
    except json.JSONDecodeError as err:
        raise TrainingStateError(f"{path}: unreadable ({err}); the checkpoint is damaged") from None


def check_meta_fits(meta: dict[str, Any], ckpt: Path, spec: ModelSpec, framework: str | None = None) -> None:
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


def commit_checkpoint(ckpt: Path, meta: dict[str, Any]) -> None:
    """Mark a checkpoint complete: meta.json is written last and atomically."""
    write_atomic(ckpt / "meta.json", json.dumps(meta, indent=2))


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    import shutil

    done = complete_checkpoints(run_dir)
    for _, path in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(path, ignore_errors=True)


def find_resume(run_dir: Path, recipe: Recipe, spec: ModelSpec, framework: str, loader: Any, total_steps: int):
    """The latest complete checkpoint to resume from, checked against this run before anything is
    written: (step, ckpt, meta), or None for a fresh run. ``loader`` is the run's MixtureLoader;
    its state is restored here (a changed mixture fingerprint is an error unless the recipe allows it)."""
    done = complete_checkpoints(run_dir)
    if not done:
        return None
    if not recipe.checkpoint.resume:
        raise TrainingStateError(
            f"{run_dir}: has checkpoints up to step {done[-1][0]} but checkpoint.resume is false; "
            "use a new run_dir (or name), or set checkpoint.resume=true"
        )
    step, ckpt = done[-1]
    meta = read_meta(ckpt)
    check_meta_fits(meta, ckpt, spec, framework)
    loader.load_state_dict(meta["loader_state"], allow_fingerprint_mismatch=recipe.data.allow_fingerprint_mismatch)
    if loader.step != step:
        raise TrainingStateError(f"{ckpt}: loader state is at step {loader.step} but meta.json says {step}; damaged")
    if step > total_steps:
        raise TrainingStateError(
            f"{ckpt}: the run is at step {step}, past this recipe's {total_steps} steps; "
            f"raise train.steps to at least {step} or use a new run_dir"
        )
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
                TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
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
    """Decides, from accepted history only, whether a step's loss or grad norm is a spike."""

    enabled: bool = False
    window: int = 128
    sigma: float = 6.0
    min_history: int = 20
    losses: deque = field(default_factory=deque)
    norms: deque = field(default_factory=deque)

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> SpikeGuard:
        g = recipe.spike_guard
        return cls(enabled=g.enabled, window=g.window, sigma=g.sigma, min_history=g.min_history)

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

    def state_dict(self) -> dict[str, list[float]]:
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.losses = deque(state.get("losses", []))
        self.norms = deque(state.get("norms", []))


# ---- metrics --------------------------------------------------------------------------------

class MetricsLog:
    """Appends JSON lines to RUN/metrics.jsonl. On resume, lines past the resumed step are
    dropped first, so a re-trained step is not logged twice."""

    def __init__(self, run_dir: Path, resume_step: int = 0, enabled: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.started = time.time()
        if enabled and self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            write_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(run_dir: Path) -> Path | None:
    """Write RUN/loss.png with the training loss and held-out losses; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(run_dir)
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
    out = run_dir / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def print_summary(run_dir: Path, title: str) -> None:
    """A short table at the end of a run: first/last loss, held-out losses, throughput."""
    from rich.console import Console
    from rich.table import Table

    records = read_metrics(run_dir)
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
    Console(stderr=True).print(table)

"""What a run shows on the terminal: the progress bar (or plain lines) and the end-of-run summary.
Both go through ``logging`` (``olmo_run.terminal`` decides where the lines land: stdout for the
run's lines, stderr for the summary table)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from .metrics import read_metrics
from .run_dir import RunPath, local_copy
from .terminal import SUMMARY_LOGGER

log = logging.getLogger(__name__)


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
        """A line of the run's log (main process only); while the bar is live, rich's redirect
        of stdout prints it above the bar."""
        if self.is_main:
            log.info(text)

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


@dataclass(frozen=True)
class Throughput:
    """The summary's throughput over the timed steps (all logged steps but the first, which
    includes compilation): tokens over the wall time the steps took, not a mean of per-step
    rates (which a few fast steps inflate), and the per-step rates' spread beside it."""

    steps: str  # which steps, e.g. "steps 2-30"
    tokens_per_second: float  # per device: sum of the steps' tokens / sum of their step_time
    mfu: float  # the same tokens / time as a fraction of the peak
    rate_spread: str  # p10-p90 of the per-step tokens/s/device
    mfu_spread: str  # p10-p90 of the per-step MFU
    peak: str  # what MFU divides by (the last step's)


def throughput(train: list[dict[str, Any]]) -> Throughput:
    """``Throughput`` of a run's train records (metrics.jsonl's, at least one)."""
    timed = train[1:] or train
    seconds = [r["step_time"] for r in timed]
    total = sum(seconds)
    # A step's tokens per device are its rate times its time; MFU is linear in the rate, so the
    # MFU of the summed tokens over the summed time is the time-weighted mean of the steps' MFU.
    tokens = sum(r["tokens_per_second_per_device"] * s for r, s in zip(timed, seconds, strict=True))
    mfu = sum(r["mfu"] * s for r, s in zip(timed, seconds, strict=True)) / total
    first, last = timed[0]["step"], timed[-1]["step"]
    steps = (
        f"steps {first}-{last}" if last - first + 1 == len(timed) else f"{len(timed)} logged steps of {first}-{last}"
    )
    if first == last:
        steps = f"step {first}"
    rate_lo, rate_hi = np.percentile([r["tokens_per_second_per_device"] for r in timed], [10, 90])
    mfu_lo, mfu_hi = np.percentile([r["mfu"] for r in timed], [10, 90])
    return Throughput(
        steps=steps,
        tokens_per_second=tokens / total,
        mfu=mfu,
        rate_spread=f"p10-p90 {rate_lo:,.0f}-{rate_hi:,.0f}",
        mfu_spread=f"p10-p90 {mfu_lo:.1%}-{mfu_hi:.1%}",
        peak=timed[-1]["mfu_peak"],
    )


def print_summary(run_dir: RunPath, title: str) -> None:
    """A short table at the end of a run: first/last loss, held-out losses, throughput; drawn
    for stderr (its width and colours) and logged on ``terminal.SUMMARY_LOGGER``."""
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
        t = throughput(train)
        table.add_row(f"tokens/s/device, {t.steps}", f"{t.tokens_per_second:,.0f} (per step {t.rate_spread})")
        table.add_row(f"MFU, {t.steps}", f"{t.mfu:.1%} (per step {t.mfu_spread})")
        table.add_row("MFU of", t.peak)
        table.add_row("skipped steps", str(sum(1 for r in train if r.get("skipped"))))
    if evals:
        for name, vals in evals[-1]["eval"].items():
            table.add_row(f"held-out {name} loss / ppl", f"{vals['loss']:.4f} / {vals['perplexity']:.2f}")
        if any(r.get("leakage_allowed") for r in evals):
            table.add_row("held-out leakage", "ALLOWED (data.allow_leakage=true): held-out figures may be memorised")
    console = Console(stderr=True)
    with console.capture() as drawn:
        console.print(table)
    logging.getLogger(SUMMARY_LOGGER).info(drawn.get().rstrip("\n"))

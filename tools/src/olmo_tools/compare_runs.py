"""`olmo-compare-runs`: curves of several runs side by side, as a table of differences and a PNG.

    olmo-compare-runs runs/jax-run runs/torch-run --steps 10,50,100 --png compare.png
    olmo-compare-runs runs/ours wandb_export.csv --metric loss --column "train/CE loss" --smooth 20

A run is one of:
- a run dir of either trainer (its metrics.jsonl: train and eval lines);
- a JSONL file of objects with a step and the metric (e.g. our metrics.jsonl elsewhere);
- a CSV file with a step column ("step", "_step", "Step", "trainer/global_step") and the metric
  column (``--column`` names it when it is not called like ``--metric``), e.g. a W&B export or a
  published reference curve.

Differences are taken against the first run at the steps all runs share; ``--smooth N`` applies a
trailing mean over N points to every curve first (the table says so). With ``--max-diff X`` the
command exits 1 when any shared step differs by more than X.

The keys of a metrics.jsonl are the tags the TensorBoard and W&B sinks give them
(``olmo_run.sinks.scalars``): a train key as written (``grad_norm``, or ``train/grad_norm``) and a
held-out evaluation as ``eval/<source>/<key>`` (``eval/code/loss``), compared at the steps every
run evaluated. Only numbers compare: flags, labels, lists and non-finite values are left out.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import sys
import textwrap
from pathlib import Path

import numpy as np

from olmo_run.metrics import TRAIN_KEYS
from olmo_run.sinks import scalars

# The TRAIN_KEYS that are no curve: the record's kind and step, a flag and labels.
NOT_CURVES = ("kind", "step", "skipped", "mfu_peak", "memory_kind", "batch_digest")
EVAL_KEYS = "eval/<held-out source>/loss, eval/<held-out source>/perplexity, eval/<held-out source>/tokens"
STEP_COLUMNS = ("step", "_step", "trainer/global_step", "global_step", "iteration")


class CompareError(ValueError):
    pass


def _pick(columns: list[str], wanted: list[str], what: str, source: Path) -> str:
    lower = {c.lower(): c for c in columns}
    for w in wanted:
        if w.lower() in lower:
            return lower[w.lower()]
    raise CompareError(
        f"{source}: no {what} column among {columns}; name it with --column (metric) or rename the step column"
    )


def load_curve(source: str, metric: str = "loss", column: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) sorted by step; later duplicates of a step win (a resumed run re-logs)."""
    path = Path(source)
    if not path.exists():
        raise CompareError(f"{path}: no such run dir or file")
    points: dict[int, float] = {}
    if path.is_dir() or path.suffix == ".jsonl":
        file = path / "metrics.jsonl" if path.is_dir() else path
        if not file.exists():
            raise CompareError(f"{path}: no metrics.jsonl; is this a run dir of olmo-train-jax/torch?")
        points = _jsonl_points(file, column or metric)
    elif path.suffix == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            cols = list(reader.fieldnames or [])
            step_col = _pick(cols, list(STEP_COLUMNS), "step", path)
            val_col = _pick(cols, [column or metric], f"'{column or metric}'", path)
            for row in reader:
                if row[val_col] in ("", "NaN", "nan", None):
                    continue
                points[int(float(row[step_col]))] = float(row[val_col])
    else:
        raise CompareError(f"{path}: expected a run dir, a .jsonl or a .csv file")
    if not points:
        raise CompareError(f"{path}: no '{column or metric}' values found")
    steps = np.array(sorted(points), dtype=np.int64)
    return steps, np.array([points[s] for s in steps], dtype=np.float64)


def _jsonl_points(file: Path, key: str) -> dict[int, float]:
    """{step: value} of ``key`` (a train key, bare or ``train/``, or ``eval/<source>/<key>``);
    a key no record holds is an error listing the keys the file holds."""
    wanted = (key, f"train/{key}")
    points: dict[int, float] = {}
    found: dict[str, None] = {}  # the tags seen, in order
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise CompareError(f"{file}:{n}: not JSON") from None
        if not isinstance(rec, dict) or "step" not in rec or rec.get("skipped"):
            continue
        try:
            step, values = scalars({"kind": "train", **rec})  # a JSONL of our own has no kind
        except (AttributeError, KeyError, TypeError, ValueError):
            raise CompareError(
                f"{file}:{n}: not a metrics record: the step must be a number, an eval line's 'eval'"
                " a {source: {key: number}} object"
            ) from None
        found.update(dict.fromkeys(values))
        tag = next((w for w in wanted if w in values), None)
        if tag is not None:
            points[step] = values[tag]
    if not points:
        names = sorted((t.removeprefix("train/") for t in found), key=lambda t: t.startswith("eval/"))
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise CompareError(f"{file}: no '{key}' values; {hint}keys found: {', '.join(names) or 'none'}")
    return points


def keys_help() -> str:
    """The keys a run dir's metrics.jsonl holds, for ``--help``."""
    train = ", ".join(k for k in TRAIN_KEYS if k not in NOT_CURVES)
    return "\n".join(
        [
            "keys of a run dir or metrics.jsonl (--metric):",
            textwrap.fill(f"train: {train}", width=100, initial_indent="  ", subsequent_indent="         "),
            "         or train/<key> as TensorBoard and W&B tag them; MoE runs add moe_* keys, a trainer its extras",
            f"  eval:  {EVAL_KEYS}",
            "         e.g. eval/code/loss, compared at the steps every run evaluated",
            "An unknown key's error lists the keys the run's file holds.",
        ]
    )


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over `window` points (the first points average what exists so far)."""
    if window <= 1:
        return values
    csum = np.cumsum(np.concatenate([[0.0], values]))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def compare(curves: list[tuple[np.ndarray, np.ndarray]], at: list[int] | None) -> dict:
    shared = curves[0][0]
    for steps, _ in curves[1:]:
        shared = np.intersect1d(shared, steps)
    lookup = [dict(zip(s.tolist(), v.tolist())) for s, v in curves]
    diffs = [np.array([lookup[i][s] - lookup[0][s] for s in shared.tolist()]) for i in range(1, len(curves))]
    chosen = (
        at
        if at
        else (shared[np.linspace(0, len(shared) - 1, min(len(shared), 6)).astype(int)].tolist() if len(shared) else [])
    )
    return {
        "shared_steps": int(len(shared)),
        "max_abs_diff": [float(np.max(np.abs(d))) if len(d) else None for d in diffs],
        "mean_abs_diff": [float(np.mean(np.abs(d))) if len(d) else None for d in diffs],
        "at": {int(s): [lookup[i].get(int(s)) for i in range(len(curves))] for s in chosen},
    }


def plot(names: list[str], curves: list[tuple[np.ndarray, np.ndarray]], out: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, (s, v) in zip(names, curves):
        top.plot(s, v, label=name, lw=1)
    ref = dict(zip(curves[0][0].tolist(), curves[0][1].tolist()))
    for name, (s, v) in zip(names[1:], curves[1:]):
        mask = np.array([x in ref for x in s.tolist()])
        if mask.any():
            bottom.plot(
                s[mask], v[mask] - np.array([ref[x] for x in s[mask].tolist()]), lw=1, label=f"{name} - {names[0]}"
            )
    top.set_ylabel(metric)
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_xlabel("step")
    bottom.set_ylabel("difference")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="olmo-compare-runs",
        description=__doc__.split("\n\n")[0],
        epilog=keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", help="run dirs, .jsonl or .csv files (the first is the reference)")
    parser.add_argument(
        "--metric", default="loss", help="metric key (default loss): a train key or eval/<source>/<key>, listed below"
    )
    parser.add_argument("--column", action="append", help="metric column per CSV/JSONL run, in order (optional)")
    parser.add_argument("--steps", help="comma-separated steps for the table (default: 6 spread over the run)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing mean over N points before comparing")
    parser.add_argument("--png", help="write the curves and their differences to this PNG")
    parser.add_argument("--max-diff", type=float, help="exit 1 when any shared step differs by more")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two runs")
    columns = args.column or []
    try:
        curves = []
        for i, run in enumerate(args.runs):
            steps, values = load_curve(run, args.metric, columns[i] if i < len(columns) else None)
            curves.append((steps, smooth(values, args.smooth)))
        at = [int(s) for s in args.steps.split(",")] if args.steps else None
        result = compare(curves, at)
    except (CompareError, ValueError) as err:
        print(f"olmo-compare-runs: {err}", file=sys.stderr)
        return 2
    result = {"runs": args.runs, "metric": args.metric, "smooth": args.smooth, **result}
    if args.png:
        plot([Path(r).name for r in args.runs], curves, Path(args.png), args.metric)
        result["png"] = args.png
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        title = f"{args.metric}" + (f" (trailing mean over {args.smooth})" if args.smooth > 1 else "")
        table = Table(title=title)
        table.add_column("step", justify="right")
        for r in args.runs:
            table.add_column(Path(r).name, justify="right")
        for r in args.runs[1:]:
            table.add_column(f"{Path(r).name} - ref", justify="right")
        for step, vals in result["at"].items():
            ref = vals[0]
            cells = [f"{v:.6f}" if v is not None else "-" for v in vals]
            deltas = [f"{v - ref:+.2e}" if v is not None and ref is not None else "-" for v in vals[1:]]
            table.add_row(str(step), *cells, *deltas)
        console = Console()
        console.print(table)
        for r, mx in zip(args.runs[1:], result["max_abs_diff"]):
            console.print(
                f"max |{Path(r).name} - {Path(args.runs[0]).name}| over {result['shared_steps']} shared steps: {mx}"
            )
    if args.max_diff is not None and any(m is not None and m > args.max_diff for m in result["max_abs_diff"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

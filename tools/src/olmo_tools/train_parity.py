"""``olmo-parity train``: the two trainers on one recipe, from the same weights, step by step.

    uv run --frozen olmo-parity train [RECIPE.yaml] --steps 50 [--json] [--max-loss-diff 1e-4]
        [--max-grad-norm-diff X] [--max-eval-diff X] [--png out.png] [--out DIR] [--overwrite] [--key=value ...]
    uv run --frozen olmo-parity train --steps 50 --model=tiny --train.sequence_length=64 --train.global_batch_tokens=512

Both trainers run through their real entry points (``olmo_train_torch.cli.main`` and
``olmo_train_jax.cli.main``, in this process, one after the other; their output goes to
OUT/torch.log and OUT/jax.log) on the same recipe in fp32 (``train.precision`` is forced to
fp32, ``train.steps`` to ``--steps``). A dense spec: the torch model initialises the weights from
``train.seed``; they are exported to an HF folder (OUT/init-hf) and BOTH runs start from it via
``init.checkpoint=hf:...`` (for torch the same values its own init gives). An MoE spec (OLMo-core
3's included, which no HF architecture expresses): both runs start fresh (``init.checkpoint``
cleared), and both trainers draw their fresh weights from ``olmo_model.init`` for ``train.seed``,
the same bits whatever the framework. Either way the only differences left are the frameworks'
arithmetic. The data order is a function of (mixture, seed, step), so both see the same batches.

Reported: per step the loss and grad norm of each and their differences, the largest |loss
difference|, the final held-out losses of each; a PNG with both curves and their difference
(OUT/parity.png unless ``--png``), and OUT/parity.json. Exit 0 when every given threshold holds,
1 when one is exceeded, 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from olmo_data import fileio
from olmo_model import ModelSpec
from olmo_run.metrics import read_metrics
from olmo_run.recipe import Recipe, RecipeError, load_recipe

from .checkpoint import CheckpointError, require_jax
from .formats import atomic_destination, write_hf

FRAMEWORKS = ("torch", "jax")
INIT_DIR = "init-hf"


class TrainParityError(CheckpointError):
    """Bad input to ``olmo-parity train`` (recipe, output dir) or a trainer that refused to run."""


def export_initial_weights(spec: ModelSpec, seed: int, dst: Path) -> None:
    """The torch trainer's step-0 weights for ``seed`` as an HF folder (the shared starting point)."""
    import torch

    from olmo_train_torch.hf_adapter import initial_model, to_hf

    tensors = to_hf(initial_model(spec, seed=seed), spec)
    with atomic_destination(dst, overwrite=False) as tmp:
        write_hf(tmp, spec, lambda name: tensors[name].contiguous(), lambda name: torch.float32)


def _run_trainer(framework: str, args: list[str], log: Path) -> float:
    """Run one trainer's CLI in this process with its output in ``log``; returns wall seconds."""
    if framework == "torch":
        from olmo_train_torch.cli import main
    else:
        from olmo_train_jax.cli import main
    start = time.perf_counter()
    with log.open("w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        status = main(args)
    if status != 0:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        raise TrainParityError(
            f"olmo-train-{framework} exited with status {status}: {lines[-1] if lines else '?'} (see {log})"
        )
    return time.perf_counter() - start


def _curves(run_dir: Path, steps: int) -> tuple[dict[int, dict[str, Any]], dict[str, float]]:
    records = read_metrics(run_dir)
    train = {r["step"]: r for r in records if r.get("kind") == "train"}
    missing = [s for s in range(1, steps + 1) if s not in train]
    if missing:
        raise TrainParityError(f"{run_dir}/metrics.jsonl: no train line for step {missing[0]}; set log.every=1")
    evals = [r for r in records if r.get("kind") == "eval"]
    held_out = {name: v["loss"] for name, v in evals[-1]["eval"].items()} if evals else {}
    return train, held_out


def compare_runs(torch_dir: Path, jax_dir: Path, steps: int) -> dict[str, Any]:
    """Per-step loss and grad-norm of both runs, their differences and the final held-out losses."""
    (t, t_eval), (j, j_eval) = _curves(torch_dir, steps), _curves(jax_dir, steps)
    idx = list(range(1, steps + 1))
    loss_t, loss_j = [t[s]["loss"] for s in idx], [j[s]["loss"] for s in idx]
    gn_t, gn_j = [t[s]["grad_norm"] for s in idx], [j[s]["grad_norm"] for s in idx]
    loss_diff = np.abs(np.subtract(loss_t, loss_j))
    gn_diff = np.abs(np.subtract(gn_t, gn_j))
    held_out = {
        name: {"torch": t_eval[name], "jax": j_eval[name], "abs_diff": abs(t_eval[name] - j_eval[name])}
        for name in t_eval
        if name in j_eval
    }
    return {
        "steps": idx,
        "loss_torch": loss_t,
        "loss_jax": loss_j,
        "abs_loss_diff": loss_diff.tolist(),
        "grad_norm_torch": gn_t,
        "grad_norm_jax": gn_j,
        "abs_grad_norm_diff": gn_diff.tolist(),
        "max_abs_loss_diff": float(loss_diff.max()),
        "max_abs_loss_diff_step": int(loss_diff.argmax()) + 1,
        "max_abs_grad_norm_diff": float(gn_diff.max()),
        "max_rel_grad_norm_diff": float((gn_diff / np.maximum(np.abs(gn_t), 1e-12)).max()),
        "held_out": held_out,
        "max_abs_held_out_diff": max((v["abs_diff"] for v in held_out.values()), default=None),
    }


def check_thresholds(
    result: dict[str, Any],
    *,
    max_loss_diff: float | None,
    max_grad_norm_diff: float | None,
    max_eval_diff: float | None,
) -> list[str]:
    """One message per threshold that is given and exceeded (empty: PASS)."""
    failures = []
    for key, limit, flag in (
        ("max_abs_loss_diff", max_loss_diff, "--max-loss-diff"),
        ("max_abs_grad_norm_diff", max_grad_norm_diff, "--max-grad-norm-diff"),
        ("max_abs_held_out_diff", max_eval_diff, "--max-eval-diff"),
    ):
        value = result[key]
        if limit is None:
            continue
        if value is None:
            failures.append(f"{key}: no held-out losses to check {flag} against")
        elif not value <= limit:
            failures.append(f"{key} {value:.3e} > {flag} {limit:g}")
    return failures


def run_train_parity(args: argparse.Namespace) -> int:
    if args.steps <= 0:
        raise TrainParityError(f"--steps {args.steps} must be positive")
    require_jax("olmo-parity train")
    forced = [f"--train.steps={args.steps}", "--train.precision=fp32"]
    try:
        recipe: Recipe = load_recipe(args.recipe, [*args.overrides, *forced])
        spec = recipe.model_spec()
    except RecipeError as err:
        raise TrainParityError(str(err)) from None
    out = _fresh_out(args, recipe)
    if spec.moe is None:
        export_initial_weights(spec, recipe.train.seed, out / INIT_DIR)
        start = [f"--init.checkpoint=hf:{(out / INIT_DIR).absolute()}", "--init.load_optimizer=false"]
    else:
        start = ["--init.checkpoint=null"]  # olmo_model.init for train.seed, in both trainers
    wall = _run_both(args, [*forced, *start], out)
    result = compare_runs(out / "torch", out / "jax", args.steps)

    failures = check_thresholds(
        result,
        max_loss_diff=args.max_loss_diff,
        max_grad_norm_diff=args.max_grad_norm_diff,
        max_eval_diff=args.max_eval_diff,
    )
    png = Path(args.png) if args.png else out / "parity.png"
    from .compare_runs import plot

    steps = np.asarray(result["steps"])
    plot(
        ["torch", "jax"],
        [(steps, np.asarray(result["loss_torch"])), (steps, np.asarray(result["loss_jax"]))],
        png,
        "loss",
    )
    report = _report(args, recipe, spec, out, png, wall, result, failures)
    fileio.write_text(out / "parity.json", json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0 if not failures else 1


def _fresh_out(args: argparse.Namespace, recipe: Recipe) -> Path:
    """The output folder (``--out``, default runs/parity-NAME), an earlier parity run in it
    removed when ``--overwrite`` allows."""
    out = Path(args.out) if args.out else Path("runs") / f"parity-{recipe.name}"
    parts = [out / INIT_DIR, *(out / fw for fw in FRAMEWORKS)]
    if any(p.exists() for p in parts):
        if not args.overwrite:
            raise TrainParityError(f"{out}: holds an earlier parity run; pass --overwrite or choose another --out")
        for p in parts:
            shutil.rmtree(p, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _run_both(args: argparse.Namespace, forced: list[str], out: Path) -> dict[str, float]:
    """Both trainers with the ``forced`` overrides (the steps, fp32, the shared start), each into
    OUT/FRAMEWORK; wall seconds of each."""
    common = [
        *forced,
        "--log.every=1",
        "--log.progress=false",
        f"--checkpoint.every={args.steps}",
        "--torch.parallel=none",
    ]
    wall = {}
    for fw in FRAMEWORKS:
        argv = ([args.recipe] if args.recipe else []) + [*args.overrides, *common, f"--run_dir={(out / fw).absolute()}"]
        wall[fw] = _run_trainer(fw, argv, out / f"{fw}.log")
    return wall


def _report(
    args: argparse.Namespace,
    recipe: Recipe,
    spec: ModelSpec,
    out: Path,
    png: Path,
    wall: dict[str, float],
    result: dict[str, Any],
    failures: list[str],
) -> dict[str, Any]:
    """The contents of OUT/parity.json (and of ``--json``)."""
    return {
        "recipe": args.recipe or "default recipe",
        "overrides": args.overrides,
        "spec": spec.name,
        "n_layers": spec.n_layers,
        "d_model": spec.d_model,
        "sliding_window": spec.sliding_window,
        "sequence_length": recipe.train.sequence_length,
        "global_batch_tokens": recipe.train.global_batch_tokens,
        "out": str(out),
        "start": f"hf:{out / INIT_DIR}" if spec.moe is None else f"olmo_model.init, seed {recipe.train.seed}",
        "png": str(png),
        "wall_seconds": wall,
        **result,
        "thresholds": {
            "max_loss_diff": args.max_loss_diff,
            "max_grad_norm_diff": args.max_grad_norm_diff,
            "max_eval_diff": args.max_eval_diff,
        },
        "passed": not failures,
        "failures": failures,
    }


def _print_table(r: dict[str, Any]) -> None:
    table = Table(
        title=f"olmo-parity train: {r['spec']} ({r['n_layers']} layers, d_model {r['d_model']}, "
        f"window {r['sliding_window']}), {len(r['steps'])} steps, fp32"
    )
    table.add_column("step", justify="right")
    table.add_column("loss torch", justify="right")
    table.add_column("loss jax", justify="right")
    table.add_column("|diff|", justify="right")
    table.add_column("grad norm |diff|", justify="right")
    n = len(r["steps"])
    shown = sorted({1, *np.linspace(1, n, min(n, 6)).astype(int).tolist(), r["max_abs_loss_diff_step"]})
    for s in shown:
        i = s - 1
        table.add_row(
            str(s),
            f"{r['loss_torch'][i]:.6f}",
            f"{r['loss_jax'][i]:.6f}",
            f"{r['abs_loss_diff'][i]:.2e}",
            f"{r['abs_grad_norm_diff'][i]:.2e}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"max |loss diff| {r['max_abs_loss_diff']:.3e} at step {r['max_abs_loss_diff_step']}; "
        f"max |grad norm diff| {r['max_abs_grad_norm_diff']:.3e} (relative {r['max_rel_grad_norm_diff']:.2e})"
    )
    for name, v in r["held_out"].items():
        console.print(f"held-out {name}: torch {v['torch']:.6f}, jax {v['jax']:.6f}, |diff| {v['abs_diff']:.2e}")
    console.print(f"curves: {r['png']}; report: {r['out']}/parity.json")
    console.print("PASS" if r["passed"] else "FAIL: " + "; ".join(r["failures"]))


def add_train_command(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="run both trainers from the same weights on one recipe and compare them step by step",
        description="Extra --section.key=value arguments override the recipe, as for olmo-train-*.",
    )
    p.add_argument("recipe", nargs="?", help="recipe YAML (default: the built-in default recipe)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps each trainer runs")
    p.add_argument("--out", help="folder for both runs, the initial weights and the report (default runs/parity-NAME)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier parity run in --out")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--png", help="curves PNG (default OUT/parity.png)")
    p.add_argument("--max-loss-diff", type=float, default=1e-4, help="fail (exit 1) above this per-step |loss diff|")
    p.add_argument("--max-grad-norm-diff", type=float, help="fail (exit 1) above this per-step |grad norm diff|")
    p.add_argument("--max-eval-diff", type=float, help="fail (exit 1) above this final held-out |loss diff|")
    p.set_defaults(func=run_train_parity, accepts_overrides=True)

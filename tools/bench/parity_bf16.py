"""bf16 logit parity at 8192 tokens on a trained model: issue 3's goal (KL mean <= 1e-3 and
top-1 agreement >= 99%, our torch and JAX models against transformers' Olmo3ForCausalLM).

    uv run --frozen python tools/bench/parity_bf16.py [--workdir runs/parity-8k] [--seq-len 8192]
        [--recipe recipes/toy/parity-8k.yaml] [--skip-train] [--section.key=value ...]

One command; everything it writes is under --workdir (default runs/parity-8k, git-ignored):
1. train: olmo-train-torch on the recipe (a 4-layer model, window 512, sequence 2048) with
   WORKDIR/mixture.yaml, the embedded sample with as many eval sequences per held-out source
   as fit at that length in whole eval batches; an existing finished run is reused (the
   trainer resumes and stops);
   trailing --section.key=value arguments go to the trainer; --skip-train measures the run's
   latest complete checkpoint as it is (e.g. while it still trains);
2. convert: the run's last checkpoint (read as torch:CHECKPOINT, its spec from meta.json)
   -> hf:WORKDIR/hf, then -> jax:WORKDIR/jax with olmo-convert, float32;
3. tokens: the sample's held-out split (never trained on), code and prose documents
   alternating, eos-separated, cut at --seq-len: WORKDIR/tokens.npy;
4. logits of torch:, jax: and hf-ref: (transformers) in bfloat16 and float32, one batch of
   --seq-len tokens; each pair is compared by olmo_tools.parity.compare, i.e. what
   `olmo-parity logits A B --tokens WORKDIR/tokens.npy --seq-len S --batch 1 --dtype-a X
   --dtype-b Y` computes (each row's command is in the JSON), overall and per position band
   (inside the window, inside the trained length, beyond it); one more row rounds the fp32
   reference's logits to bf16 and nothing else: what storing the logits in bf16 alone costs
   (torch and transformers return bf16 logits in bf16; our JAX model returns the head's
   float32 accumulator);
5. the trained model's own quality on those tokens (transformers, fp32): loss and the mean
   max-softmax probability (how peaked its predictions are).
Prints a table and writes WORKDIR/parity_bf16.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from olmo_data import DataError, load_mixture
from olmo_data.sample import sample_mixture_path
from olmo_model.presets import SpecError
from olmo_run.recipe import RecipeError, load_recipe
from olmo_tools.checkpoint import CheckpointError
from olmo_tools.convert import main as convert_main
from olmo_tools.formats import DTYPES
from olmo_tools.parity import Side, compare, load_side

GOAL_KL_MEAN = 1e-3
GOAL_TOP1 = 0.99
# The reference in fp32 with only its logits rounded to bf16 (not an olmo-parity --dtype).
ROUNDED = "float32, logits rounded"
DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", ROUNDED: "fp32, logits rounded to bf16"}


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_mixture(workdir: Path, seq_len: int, eval_batch: int) -> tuple[Path, int]:
    """The sample mixture with absolute paths and eval.sequences_per_source cut to what its
    held-out sources hold at seq_len (prose holds 9 sequences of 2048, the sample asks 16),
    rounded down to whole eval batches (8 for the recipe's batch of 4)."""
    sample = sample_mixture_path()
    cfg = yaml.safe_load(sample.read_text())
    for entry in cfg["sources"] + cfg["held_out"]:
        entry["paths"] = [str(sample.parent / p) for p in entry["paths"]]
    cfg["tokenizer"] = str(sample.parent / cfg["tokenizer"])
    fits = min(s.num_tokens // seq_len for s in load_mixture(sample).held_out_sources.values())
    per_source = min(cfg["eval"]["sequences_per_source"], fits)
    if per_source >= eval_batch:
        per_source -= per_source % eval_batch
    cfg["eval"]["sequences_per_source"] = per_source
    cfg["name"] = f"sample-eval{per_source}"
    path = workdir / "mixture.yaml"
    header = f"# {sample} with absolute paths and {per_source} eval sequences per source\n"
    write_atomic(path, header + yaml.safe_dump(cfg, sort_keys=False))
    return path, per_source


def train(recipe: Path, mixture: Path, run_dir: Path, overrides: list[str], log: Path) -> float:
    cmd = [sys.executable, "-m", "olmo_train_torch", str(recipe), f"--data.mixture={mixture}", f"--run_dir={run_dir}"]
    cmd += overrides
    start = time.perf_counter()
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"parity_bf16: training failed (exit {code}); see {log}")
    return time.perf_counter() - start


def training_summary(run_dir: Path, upto: int) -> dict:
    """The run's metrics up to step `upto` (the checkpoint measured)."""
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines() if s.strip()]
    lines = [r for r in lines if r["step"] <= upto]
    steps = [r for r in lines if r["kind"] == "train" and not r["skipped"]]
    evals = [r for r in lines if r["kind"] == "eval"]
    loss = [r["loss"] for r in steps]
    return {
        "steps": steps[-1]["step"],
        "tokens_seen": steps[-1]["tokens_seen"],
        "loss_first": loss[0],
        "loss_last": loss[-1],
        "loss_mean_first_10": float(np.mean(loss[:10])),
        "loss_mean_last_10": float(np.mean(loss[-10:])),
        "train_seconds": float(sum(r["step_time"] for r in steps)),
        "tokens_per_second_mean": float(np.mean([r["tokens_per_second"] for r in steps[1:]] or [0.0])),
        "held_out": {"step": evals[-1]["step"], **evals[-1]["eval"]} if evals else None,
    }


def last_checkpoint(run_dir: Path) -> Path:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "meta.json").is_file())
    if not done:
        sys.exit(f"parity_bf16: {run_dir}/checkpoints holds no complete checkpoint; train first")
    return done[-1]


def convert(src: str, dst: str) -> str:
    argv = [src, dst, "--dtype", "float32", "--overwrite"]
    if convert_main(argv) != 0:
        sys.exit(f"parity_bf16: olmo-convert {' '.join(argv)} failed")
    return "uv run --frozen olmo-convert " + " ".join(argv)


def held_out_tokens(mixture: Path, n: int) -> tuple[np.ndarray, dict]:
    """n tokens of held-out documents, code and prose alternating (each eos-terminated as stored)."""
    sources = load_mixture(mixture).held_out_sources
    docs = {}
    for name, src in sources.items():
        starts = [int(s) for s in src.doc_starts()] + [src.num_tokens]
        docs[name] = [src.read(a, b) for a, b in zip(starts[:-1], starts[1:])]
    out, used = [], {name: {"documents": 0, "tokens": 0} for name in docs}
    total, i = 0, 0
    while total < n:
        if all(i >= len(d) for d in docs.values()):
            sys.exit(f"parity_bf16: the held-out split holds fewer than {n} tokens")
        for name, d in docs.items():
            if i < len(d) and total < n:
                piece = d[i][: n - total]
                out.append(piece)
                used[name]["documents"] += 1
                used[name]["tokens"] += len(piece)
                total += len(piece)
        i += 1
    return np.concatenate(out).astype(np.uint32), used


def cached_side(side: Side, ids: np.ndarray) -> tuple[Side, np.ndarray, float]:
    start = time.perf_counter()
    logits = side.logits(ids)
    return side, logits, time.perf_counter() - start


def band_side(side: Side, logits: np.ndarray, lo: int, hi: int) -> Side:
    return Side(side.label, side.impl, side.spec, lambda ids: logits[:, lo:hi])


def tie_misses(la: np.ndarray, lb: np.ndarray) -> dict:
    """Top-1 disagreements, and how many of them sit on an exact tie at the max of A or B (bf16
    logits tie often: argmax then takes the lowest index, so a tie decides nothing about the model)."""
    tie = np.zeros(la.shape[:-1], dtype=bool)
    for x in (la, lb):
        tie |= (x == x.max(-1, keepdims=True)).sum(-1) > 1
    miss = la.argmax(-1) != lb.argmax(-1)
    return {"top1_disagreements": int(miss.sum()), "of_which_at_ties": int((miss & tie).sum())}


def quality(logits: np.ndarray, ids: np.ndarray, bands: dict[str, tuple[int, int]]) -> dict:
    """Next-token loss, accuracy and mean max-softmax probability of one model's logits, per band."""
    x = logits[0].astype(np.float64)
    x -= x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    nll = -logp[np.arange(ids.shape[1] - 1), ids[0, 1:]]
    maxp = np.exp(logp.max(-1))
    correct = logp.argmax(-1)[:-1] == ids[0, 1:]
    out = {}
    for name, (lo, hi) in bands.items():
        # position p predicts token p + 1; the last position has no target
        t_hi = min(hi, ids.shape[1] - 1)
        out[name] = {
            "loss": float(nll[lo:t_hi].mean()),
            "perplexity": float(np.exp(nll[lo:t_hi].mean())),
            "next_token_accuracy": float(correct[lo:t_hi].mean()),
            "mean_max_prob": float(maxp[lo:hi].mean()),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="runs/parity-8k", help="everything is written here")
    parser.add_argument("--recipe", default=str(Path(__file__).resolve().parents[2] / "recipes/toy/parity-8k.yaml"))
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens of context compared (batch 1)")
    parser.add_argument(
        "--skip-train", action="store_true", help="measure the run's latest complete checkpoint as it is"
    )
    args, overrides = parser.parse_known_args()
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (trainer overrides are written --section.key=value)")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    console = Console(width=150)
    load_start = os.getloadavg()

    recipe = load_recipe(args.recipe, overrides)
    spec = recipe.model_spec()
    train_seq = recipe.train.sequence_length
    if not train_seq:
        sys.exit(f"parity_bf16: {args.recipe}: set train.sequence_length (the trained length the bands refer to)")
    mixture, eval_per_source = write_mixture(workdir, train_seq, recipe.eval.batch_size)
    run_dir = workdir / "train"
    wall = 0.0
    if not args.skip_train:
        console.print(f"[1/5] training {args.recipe} in {run_dir} (log: {workdir / 'train.log'})")
        wall = train(Path(args.recipe), mixture, run_dir, overrides, workdir / "train.log")
    checkpoint = last_checkpoint(run_dir)
    summary = training_summary(run_dir, json.loads((checkpoint / "meta.json").read_text())["step"])
    summary["eval_sequences_per_source"] = eval_per_source
    summary["this_invocation_seconds"] = wall
    console.print(f"[2/5] converting {checkpoint}")
    commands = [
        convert(f"torch:{checkpoint}", f"hf:{workdir / 'hf'}"),
        convert(f"hf:{workdir / 'hf'}", f"jax:{workdir / 'jax'}"),
    ]

    console.print(f"[3/5] {args.seq_len} held-out tokens")
    tokens, composition = held_out_tokens(mixture, args.seq_len)
    token_file = workdir / "tokens.npy"
    tmp = workdir / f".tokens.tmp-{os.getpid()}.npy"
    np.save(tmp, tokens)
    os.replace(tmp, token_file)
    ids = tokens.astype(np.int64)[None, :]

    console.print("[4/5] logits (torch, jax, transformers) x (bf16, fp32)")
    locations = {"torch": f"torch:{checkpoint}", "jax": f"jax:{workdir / 'jax'}", "hf-ref": f"hf-ref:{workdir / 'hf'}"}
    logits, seconds = {}, {}
    for name, loc in locations.items():
        for dtype in ("bfloat16", "float32"):
            side, out, took = cached_side(load_side(loc, None, dtype), ids)
            logits[name, dtype] = (side, out)
            seconds[f"{name} {DTYPE_NAMES[dtype]}"] = took
            console.print(f"      {name} {DTYPE_NAMES[dtype]}: {took:.1f} s")

    window = spec.sliding_window or args.seq_len
    bands = {"all": (0, args.seq_len), f"0-{window}": (0, min(window, args.seq_len))}
    if train_seq > window:
        bands[f"{window}-{train_seq}"] = (window, min(train_seq, args.seq_len))
    if args.seq_len > train_seq:
        bands[f"{train_seq}-{args.seq_len}"] = (train_seq, args.seq_len)
    pairs = [
        ("torch", "bfloat16", "hf-ref", "bfloat16"),
        ("torch", "bfloat16", "hf-ref", "float32"),
        ("jax", "bfloat16", "hf-ref", "bfloat16"),
        ("jax", "bfloat16", "hf-ref", "float32"),
        ("hf-ref", "bfloat16", "hf-ref", "float32"),
        ("torch", "float32", "hf-ref", "float32"),
        ("jax", "float32", "hf-ref", "float32"),
    ]
    import torch

    ref_side, ref = logits["hf-ref", "float32"]
    logits["hf-ref", ROUNDED] = ref_side, torch.from_numpy(ref).bfloat16().float().numpy()
    pairs.append(("hf-ref", ROUNDED, "hf-ref", "float32"))
    rows = []
    for a, da, b, db in pairs:
        (side_a, la), (side_b, lb) = logits[a, da], logits[b, db]
        per_band = {
            band: compare(band_side(side_a, la, lo, hi), band_side(side_b, lb, lo, hi), ids[:, lo:hi])
            for band, (lo, hi) in bands.items()
        }
        goal = None
        if da == "bfloat16" and a != "hf-ref":
            goal = per_band["all"]["kl_mean"] <= GOAL_KL_MEAN and per_band["all"]["top1_agreement"] >= GOAL_TOP1
        command = None
        if da in DTYPES:  # the rounded-logits row has no olmo-parity equivalent
            command = (
                f"uv run --frozen olmo-parity logits {locations[a]} {locations[b]} --tokens {token_file} "
                f"--seq-len {args.seq_len} --batch 1 --dtype-a {da} --dtype-b {db} --json"
            )
        rows.append({
            "a": f"{a} {DTYPE_NAMES[da]}", "b": f"{b} {DTYPE_NAMES[db]}", **per_band["all"], "goal_met": goal,
            **tie_misses(la, lb), "bands": per_band, "command": command,
        })  # fmt: skip

    console.print("[5/5] the trained model on these tokens (transformers, fp32)")
    model_quality = quality(logits["hf-ref", "float32"][1], ids, bands)

    import jax
    import transformers

    report = {
        "spec": spec.model_dump(mode="json"),
        "recipe": str(args.recipe),
        "overrides": overrides,
        "training": summary,
        "checkpoint": str(checkpoint),
        "conversion": commands,
        "tokens": {"file": str(token_file), "n": int(tokens.size), "held_out": composition},
        "model_quality": model_quality,
        "forward_seconds": seconds,
        "rows": rows,
        "goal": {"kl_mean_max": GOAL_KL_MEAN, "top1_min": GOAL_TOP1},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_start_end": [load_start[0], os.getloadavg()[0]],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "jax": jax.__version__,
            "transformers": transformers.__version__,
        },
    }
    write_atomic(workdir / "parity_bf16.json", json.dumps(report, indent=2) + "\n")

    t = summary
    console.print(
        f"trained {t['steps']} steps ({t['tokens_seen']:,} tokens, {t['train_seconds'] / 60:.1f} min of steps): "
        f"loss {t['loss_first']:.3f} -> {t['loss_last']:.3f} (mean of first/last 10: "
        f"{t['loss_mean_first_10']:.3f} -> {t['loss_mean_last_10']:.3f})"
    )
    if t["held_out"]:
        console.print("held-out perplexity at step %d: %s" % (
            t["held_out"]["step"],
            ", ".join(f"{k} {v['perplexity']:.2f}" for k, v in t["held_out"].items() if k != "step"),
        ))  # fmt: skip
    q = Table(title=f"trained model on the {args.seq_len} held-out tokens (transformers, fp32)")
    for col in ("positions", "loss", "perplexity", "next-token acc", "mean max prob"):
        q.add_column(col, justify="right")
    for band, m in model_quality.items():
        q.add_row(
            band,
            f"{m['loss']:.3f}",
            f"{m['perplexity']:.2f}",
            f"{m['next_token_accuracy']:.2%}",
            f"{m['mean_max_prob']:.3f}",
        )
    console.print(q)
    target = f"goal: KL mean <= {GOAL_KL_MEAN:g}, top-1 >= {GOAL_TOP1:.0%}"
    table = Table(title=f"logit parity, 1 x {args.seq_len} held-out tokens ({target})")
    for col in (
        "A",
        "B",
        "kl_mean",
        "kl_max",
        "top1_agreement",
        "max_abs_logit_diff",
        "top-1 misses (at ties)",
        "goal",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        goal = "" if r["goal_met"] is None else ("met" if r["goal_met"] else "MISSED")
        table.add_row(
            r["a"], r["b"], f"{r['kl_mean']:.3e}", f"{r['kl_max']:.3e}", f"{r['top1_agreement']:.4%}",
            f"{r['max_abs_logit_diff']:.3e}", f"{r['top1_disagreements']} ({r['of_which_at_ties']})", goal,
        )  # fmt: skip
    console.print(table)
    band_table = Table(title="KL mean / top-1 per position band")
    band_table.add_column("A vs B")
    for band in bands:
        band_table.add_column(band, justify="right")
    for r in rows:
        band_table.add_row(
            f"{r['a']} vs {r['b']}",
            *(f"{m['kl_mean']:.2e} / {m['top1_agreement']:.2%}" for m in r["bands"].values()),
        )
    console.print(band_table)
    console.print(f"JSON: {workdir / 'parity_bf16.json'}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RecipeError, SpecError, DataError, CheckpointError) as err:
        sys.exit(f"parity_bf16: error: {err}")

"""Train-step throughput of olmo-train-torch vs transformers' Olmo3ForCausalLM and OLMo-core's
own Olmo 3 model, side by side in one run.

    uv run --frozen python packages/olmo-train-torch/bench/bench_train.py [--steps 3] [--json]
        [--olmo-core-modes eager compile]

Shape: olmo3-30m (d_model 256, 4 layers, 8 heads, MLP 768, padded vocab 100352, QK-norm,
window 4096 on layers 0-2 and layer 3 global, so every layer is effectively causal at this
length), sequence 512, batch 8, fp32, on this machine's CPU threads. Each contender runs the
same random batches and a full training step: forward, loss, backward, global-norm clip
1.0, AdamW. Ours is ``olmo_train_torch.step.train_step`` (z-loss included) eager and with
``torch.compile`` per block, as the trainer does with ``torch.compile: true``; the head and loss
are fused over token chunks (head_loss.py) in both modes
(compile time = first step minus a timed eager step).
transformers: Olmo3ForCausalLM (sdpa attention, plain CE on the shifted labels) with
``torch.optim.AdamW(foreach=True)`` and ``clip_grad_norm_``. OLMo-core (ai2-olmo-core from
PyPI): ``TransformerConfig.olmo3_30M`` with SDPA attention, its fused CE + z-loss LM head and
``SkipStepAdamW``, eager and with its own ``apply_compile``; it pins torch 2.13, so it runs in
an isolated uv env (tools/bench/olmo_core/train_peer.py, one JSON line back) on the same
batches, and its parameter count is checked against ``olmo_model.param_counts``. If that env
cannot be built the OLMo-core rows say why. MFU is against the best fp32 2048x2048 matmul
measured in torch at start (our torch). Timed steps: the median of ``--steps`` after one
warm-up; the contenders run one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from olmo_model import flops_per_token, get_preset, hf_config, param_counts
from olmo_run.measure import matmul_peak
from olmo_run.recipe import batch_layout, load_recipe
from olmo_train_torch import initial_model, to_hf
from olmo_train_torch.parallelize import Distributed, parallelize
from olmo_train_torch.step import make_optimizer, train_step
from olmo_train_torch.train import cpu_matmul

SEQ, BATCH = 512, 8
OLMO_CORE_PEER = Path(__file__).resolve().parents[3] / "tools" / "bench" / "olmo_core" / "train_peer.py"


def _batches(vocab: int, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        ids = rng.integers(2, vocab, size=(BATCH, SEQ + 1)).astype(np.int32)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:], "doc_ids": np.zeros((BATCH, SEQ), np.int32)})
    return out


def _time_steps(step, batches) -> tuple[float, list[float]]:
    """(first step seconds, timed step seconds)."""
    t0 = time.perf_counter()
    step(batches[0])
    first = time.perf_counter() - t0
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t0)
    return first, times


def bench_ours(spec, batches, compile_blocks: bool):
    recipe = load_recipe(
        None,
        [
            "--model=olmo3-30m",
            "--train.precision=fp32",
            "--optim.lr=1e-4",
            f"--torch.compile={str(compile_blocks).lower()}",
            "--torch.parallel=none",
        ],
    )
    one = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)
    model = initial_model(spec, seed=0)
    # The trainer's own path: blocks compiled by parallelize, head + loss fused (head_loss.py).
    model = parallelize(model, None, recipe.torch, "fp32", one.device)
    optimizer = make_optimizer(model, recipe, one.device)
    layout = batch_layout(BATCH, 1)

    def step(b):
        train_step(model, optimizer, b, layout=layout, d=one, spec=spec, recipe=recipe, lr=1e-4)

    return _time_steps(step, batches)


def bench_transformers(spec, batches):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    config = Olmo3Config(**hf_config(spec))
    config._attn_implementation = "sdpa"
    model = Olmo3ForCausalLM(config)
    model.load_state_dict(to_hf(initial_model(spec, seed=0), spec), strict=True)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def step(b):
        ids = torch.from_numpy(b["input_ids"]).long()
        labels = torch.from_numpy(b["labels"]).long()
        logits = model(input_ids=ids).logits
        # Labels are already shifted (next token), so the plain CE, not the model's shifting loss.
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _time_steps(step, batches)


def bench_olmo_core(spec, batches, modes: list[str]) -> dict | str:
    """OLMo-core's timings from its own env, {"modes": {mode: {...}}, "torch": ...}, or why not.
    One process per mode, so a compiled run does not share memory with the eager one."""
    uv = shutil.which("uv")
    if uv is None:
        return "not measured: `uv` is not on PATH (it builds the isolated OLMo-core env)"
    merged: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, batch_file = Path(tmp) / "spec.json", Path(tmp) / "batches.npy"
        spec_file.write_text(spec.model_dump_json())
        # The same tokens our contenders train on: inputs plus the last label column.
        np.save(batch_file, np.stack([np.concatenate([b["input_ids"], b["labels"][:, -1:]], axis=1) for b in batches]))
        for mode in modes:
            cmd = [
                uv,
                "run",
                "--isolated",
                "--no-project",
                "--python",
                "3.11",
                "--with",
                "ai2-olmo-core",
                "python",
                str(OLMO_CORE_PEER),
                "--spec",
                str(spec_file),
                "--param-total",
                str(param_counts(spec).total),
                "--batches",
                str(batch_file),
                "--modes",
                mode,
            ]
            env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode in (137, -9):
                return f"not measured: the OLMo-core {mode} process was killed (SIGKILL: out of memory?)"
            if proc.returncode != 0 or not lines:
                why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                return f"not measured: the OLMo-core env failed (exit {proc.returncode}: {why[:160]})"
            result = json.loads(lines[-1])
            merged = {**result, "modes": {**merged.get("modes", {}), **result["modes"]}}
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender (after one warm-up)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--olmo-core-modes",
        nargs="*",
        choices=("eager", "compile"),
        default=["eager", "compile"],
        help="OLMo-core contenders (none: skip OLMo-core)",
    )
    args = parser.parse_args()
    spec = get_preset("olmo3-30m")
    batches = _batches(spec.vocab_size, args.steps + 1)
    peak = matmul_peak(cpu_matmul)
    fpt = flops_per_token(spec, SEQ)
    rows = {}
    first_eager, eager = bench_ours(spec, batches, compile_blocks=False)
    rows["olmo-train-torch eager"] = (first_eager, eager)
    rows["olmo-train-torch compile"] = bench_ours(spec, batches, compile_blocks=True)
    rows["transformers Olmo3ForCausalLM"] = bench_transformers(spec, batches)
    peer = (
        bench_olmo_core(spec, batches, args.olmo_core_modes)
        if args.olmo_core_modes
        else "not measured (--olmo-core-modes)"
    )
    if isinstance(peer, dict):
        for mode, r in peer["modes"].items():
            rows[f"OLMo-core {mode}"] = (r["first_step_s"], r["step_times"])
        olmo_core_note = (
            f"OLMo-core {peer['olmo_core']} on torch {peer['torch']} ({peer['threads']} threads), "
            f"model {next(iter(peer['modes'].values()))['config']}, "
            f"{param_counts(spec).total:,} parameters (= olmo_model.param_counts)"
        )
    else:
        olmo_core_note = f"OLMo-core: {peer}"

    results = {}
    for name, (first, times) in rows.items():
        step = statistics.median(times)
        tps = BATCH * SEQ / step
        results[name] = {
            "step_s": step,
            "first_step_s": first,
            "tokens_per_second": tps,
            "mfu": fpt * tps / peak,
        }
    results["olmo-train-torch compile"]["compile_s"] = results["olmo-train-torch compile"][
        "first_step_s"
    ] - statistics.median(eager)
    peers = [n for n in results if not n.startswith("olmo-train-torch")]
    best_peer = max(peers, key=lambda n: results[n]["tokens_per_second"])
    for r in results.values():
        r["vs_best_peer"] = r["tokens_per_second"] / results[best_peer]["tokens_per_second"]
    meta = {
        "shape": "olmo3-30m",
        "seq": SEQ,
        "batch": BATCH,
        "precision": "fp32",
        "window": spec.sliding_window,
        "threads": torch.get_num_threads(),
        "peak_gflops": peak / 1e9,
        "torch": torch.__version__,
        "olmo_core": olmo_core_note,
        "best_peer": best_peer,
    }
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"train step, olmo3-30m, seq {SEQ}, batch {BATCH}, fp32, {meta['threads']} CPU threads, "
        f"peak {peak / 1e9:.1f} GFLOP/s (measured torch fp32 matmul)"
    )
    for col in ("contender", "torch", "step s", "tokens/s", "CPU-MFU", "vs best peer", "first step s"):
        table.add_column(col, justify="right" if col != "contender" else "left")
    for name, r in results.items():
        version = peer["torch"] if name.startswith("OLMo-core") else torch.__version__
        table.add_row(
            name,
            version,
            f"{r['step_s']:.2f}",
            f"{r['tokens_per_second']:,.0f}",
            f"{r['mfu']:.1%}",
            f"{r['vs_best_peer']:.2f}x",
            f"{r['first_step_s']:.1f}",
        )
    Console(width=160).print(table)
    print(f"best peer: {best_peer}")
    print(f"compile time (first compiled step - eager step): {results['olmo-train-torch compile']['compile_s']:.1f} s")
    print(olmo_core_note)


if __name__ == "__main__":
    main()

"""Train-step throughput of olmo-train-torch vs transformers' Olmo3ForCausalLM, side by side.

    uv run --frozen python packages/olmo-train-torch/bench/bench_train.py [--steps 3] [--json]

Shape: olmo3-30m (d_model 256, 4 layers, 8 heads, padded vocab 100352, window 4096, so every
layer is effectively causal at this length), sequence 512, batch 8, fp32, on this machine's
CPU threads. Each contender runs the same random batches and a full training step: forward,
loss, backward, global-norm clip 1.0, AdamW. Ours is ``olmo_train_torch.train.train_step``
(z-loss included) eager and with ``torch.compile`` per block (compile time = first step
minus a timed eager step); the peer is transformers' Olmo3ForCausalLM (sdpa attention, its
own mean CE) with ``torch.optim.AdamW(foreach=True)`` and ``clip_grad_norm_``. OLMo-core is
benchmarked only if ``import olmo_core`` works. MFU is against the best fp32 2048x2048
matmul measured in torch at start. Timed steps: the median of ``--steps`` after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from olmo_model import flops_per_token, get_preset, hf_config
from olmo_model.recipe import TorchSection, batch_layout, load_recipe
from olmo_model.runlog import SpikeGuard
from olmo_train_torch import build_model, to_hf
from olmo_train_torch.parallelize import Distributed, parallelize
from olmo_train_torch.train import make_optimizer, measure_cpu_matmul_peak, train_step

SEQ, BATCH = 512, 8


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
    recipe = load_recipe(None, ["--model=olmo3-30m", "--train.precision=fp32", "--optim.lr=1e-4"])
    one = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)
    model = build_model(spec, seed=0)
    model = parallelize(model, None, TorchSection(parallel="none", compile=compile_blocks), "fp32", one.device)
    optimizer = make_optimizer(model, recipe, one.device)
    layout = batch_layout(BATCH, 1)
    guard = SpikeGuard()

    def step(b):
        train_step(model, optimizer, b, layout=layout, d=one, spec=spec, recipe=recipe, lr=1e-4, guard=guard)

    return _time_steps(step, batches)


def bench_transformers(spec, batches):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    config = Olmo3Config(**hf_config(spec))
    config._attn_implementation = "sdpa"
    model = Olmo3ForCausalLM(config)
    model.load_state_dict(to_hf(build_model(spec, seed=0), spec), strict=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender (after one warm-up)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    spec = get_preset("olmo3-30m")
    batches = _batches(spec.vocab_size, args.steps + 1)
    peak = measure_cpu_matmul_peak()
    fpt = flops_per_token(spec, SEQ)
    rows = {}
    first_eager, eager = bench_ours(spec, batches, compile_blocks=False)
    rows["olmo-train-torch eager"] = (first_eager, eager)
    rows["olmo-train-torch compile"] = bench_ours(spec, batches, compile_blocks=True)
    rows["transformers Olmo3ForCausalLM"] = bench_transformers(spec, batches)
    try:
        import olmo_core  # noqa: F401

        olmo_core_note = "olmo_core is importable but not benchmarked here"
    except ImportError:
        olmo_core_note = "OLMo-core: not installed (import olmo_core fails), not benchmarked"

    results = {}
    for name, (first, times) in rows.items():
        step = statistics.median(times)
        tps = BATCH * SEQ / step
        results[name] = {
            "step_s": step, "first_step_s": first, "tokens_per_second": tps, "mfu": fpt * tps / peak,
        }
    results["olmo-train-torch compile"]["compile_s"] = results["olmo-train-torch compile"]["first_step_s"] - statistics.median(eager)
    peer = results["transformers Olmo3ForCausalLM"]["tokens_per_second"]
    for r in results.values():
        r["vs_transformers"] = r["tokens_per_second"] / peer
    meta = {
        "shape": "olmo3-30m", "seq": SEQ, "batch": BATCH, "precision": "fp32", "window": spec.sliding_window,
        "threads": torch.get_num_threads(), "peak_gflops": peak / 1e9, "olmo_core": olmo_core_note,
    }
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"train step, olmo3-30m, seq {SEQ}, batch {BATCH}, fp32, {meta['threads']} CPU threads, "
                        f"peak {peak / 1e9:.1f} GFLOP/s (measured torch fp32 matmul)")
    for col in ("contender", "step s", "tokens/s", "CPU-MFU", "vs transformers", "first step s"):
        table.add_column(col, justify="right" if col != "contender" else "left")
    for name, r in results.items():
        table.add_row(name, f"{r['step_s']:.2f}", f"{r['tokens_per_second']:,.0f}", f"{r['mfu']:.1%}",
                      f"{r['vs_transformers']:.2f}x", f"{r['first_step_s']:.1f}")
    Console(width=140).print(table)
    print(f"compile time (first compiled step - eager step): {results['olmo-train-torch compile']['compile_s']:.1f} s")
    print(olmo_core_note)


if __name__ == "__main__":
    main()

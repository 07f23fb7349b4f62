"""Train-step throughput on CPU: olmo-train-jax's jitted step vs transformers' Olmo3ForCausalLM
with torch AdamW, side by side in one process, same shape, batch, loss and optimizer maths.

    uv run --frozen python packages/olmo-train-jax/bench/bench_train.py
    uv run --frozen python packages/olmo-train-jax/bench/bench_train.py --preset olmo3-30m --seq 512 --batch 8 --steps 6

Each side: one untimed step (JAX compiles there), then ``--steps`` interleaved rounds: a timed
step of each (forward, backward, global-norm clip, AdamW), each followed by its framework's fp32
2048 x 2048 matmul peak. CPU-MFU per round is that framework's model FLOP/s
(olmo_model.flops_per_token, sliding-window aware) over the peak measured next to the step; the
table gives the median over rounds and the range, and, as the most conservative reading, the
best step over the best peak of the whole run (a 60 ms matmul catches the machine's fast moments
more often than a multi-second step does). The speed ratio is the median of per-round ratios. The 1-minute load average before and after is printed under the table.

Where that step's time goes, in both frameworks and both trainers' chunked head + loss:
``tools/bench/bench_step_pieces.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np


def jax_step(spec, ids: np.ndarray, labels: np.ndarray):
    """olmo-train-jax's fused train step (fp32), placed as the trainer places it: a no-argument
    callable that runs one step and returns its loss."""
    import jax.numpy as jnp

    from olmo_run.recipe import load_recipe
    from olmo_train_jax.model import build_model
    from olmo_train_jax.step import placed_step

    recipe = load_recipe(None, ["--train.precision=fp32"])
    # Placed with the step's shardings, as the trainer does: no recompile at the second step.
    fns, carry = placed_step(build_model(spec, seed=0), spec, recipe)
    data = {"input_ids": ids[None], "labels": labels[None], "doc_ids": np.zeros_like(ids)[None]}
    data = {k: jnp.asarray(v) for k, v in data.items()}
    lr = np.float32(1e-3)

    def step() -> float:
        carry[0], carry[1], stats = fns.fused(carry[0], carry[1], data, lr, np.int32(1))
        return float(stats["loss"])

    return step


def torch_matmul_peak(size: int = 2048, repeats: int = 3) -> float:
    import torch

    a = torch.ones(size, size)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def transformers_step(spec, ids: np.ndarray, labels: np.ndarray):
    """transformers' Olmo3ForCausalLM train step with torch AdamW (same loss, clip, AdamW)."""
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    from olmo_model import hf_config

    torch.manual_seed(0)
    model = Olmo3ForCausalLM(Olmo3Config(**hf_config(spec))).float().train()
    decay = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if "embed_tokens" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=True,
    )
    x, y = torch.from_numpy(ids).long(), torch.from_numpy(labels).long()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x).logits.float()
        lse = torch.logsumexp(logits, dim=-1)
        ce = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss = ce + spec.z_loss_weight * (lse**2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    return step


def bench_interleaved(contenders: dict, steps: int) -> dict:
    """One untimed step each (JAX compiles there), then ``steps`` rounds; in each round every
    contender runs one timed step and then its framework's matmul peak (best of 3), so a step
    and the peak it is divided by are measured seconds apart. This machine's own speed drifts
    (the 2048^3 peak moved 146-280 GFLOP/s within a minute, idle): per-round MFU and per-round
    ratios cancel that drift where one-after-the-other runs do not."""
    out = {name: {"times": [], "peaks": []} for name in contenders}
    for name, (step, _) in contenders.items():
        t0 = time.perf_counter()
        step()
        out[name]["first"] = time.perf_counter() - t0
    for _ in range(steps):
        for name, (step, peak) in contenders.items():
            t0 = time.perf_counter()
            out[name]["loss"] = step()
            out[name]["times"].append(time.perf_counter() - t0)
            out[name]["peaks"].append(peak())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="olmo3-30m")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from olmo_model import flops_per_token, get_preset

    torch.set_num_threads(os.cpu_count() or 1)
    spec = get_preset(args.preset)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.vocab_size, size=(args.batch, args.seq)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    tokens = args.batch * args.seq
    fpt = flops_per_token(spec, args.seq)

    load_before = os.getloadavg()[0]
    from olmo_run.measure import matmul_peak
    from olmo_train_jax.train import cpu_matmul

    contenders = {
        "olmo-train-jax (jit)": (jax_step(spec, ids, labels), lambda: matmul_peak(cpu_matmul, repeats=3)),
        "transformers Olmo3ForCausalLM (eager)": (
            transformers_step(spec, ids, labels),
            lambda: torch_matmul_peak(repeats=3),
        ),
    }
    results = bench_interleaved(contenders, args.steps)
    base_name = "transformers Olmo3ForCausalLM (eager)"
    base_times = np.asarray(results[base_name]["times"])

    window = spec.sliding_window if spec.sliding_window and spec.sliding_window < args.seq else "none (>= seq)"
    table = Table(
        title=f"{args.preset} train step, seq {args.seq}, batch {args.batch}, fp32, window {window}, "
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), {args.steps} interleaved rounds"
    )
    for col in (
        "implementation",
        "first step s",
        "best step s",
        "median step s",
        "tokens/s (best)",
        "CPU-MFU median (range)",
        "best step / best peak",
        "matmul peak GFLOP/s",
        "ratio median (range)",
    ):
        table.add_column(col, justify="right" if col != "implementation" else "left")
    for name, r in results.items():
        times, peaks = np.asarray(r["times"]), np.asarray(r["peaks"])
        mfu = fpt * tokens / times / peaks  # per round: the step over the peak measured next to it
        ratio = base_times / times  # per round: same round, same machine state
        table.add_row(
            name,
            f"{r['first']:.2f}",
            f"{times.min():.2f}",
            f"{np.median(times):.2f}",
            f"{tokens / times.min():,.0f}",
            f"{np.median(mfu):.1%} ({mfu.min():.1%}-{mfu.max():.1%})",
            f"{fpt * tokens / times.min() / peaks.max():.1%}",
            f"{peaks.min() / 1e9:.0f}-{peaks.max() / 1e9:.0f}",
            f"{np.median(ratio):.2f}x ({ratio.min():.2f}-{ratio.max():.2f})",
        )
    Console(width=200).print(table)
    # Other jobs on a shared machine slow both sides; the load says how far to trust the times.
    print(f"1-minute load average: {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()

"""One layer's causal attention on CPU, forward and forward + backward: the JAX trainer's
``blocked_causal_attention`` with all batch rows at once (``batch_loop=0``, what GPU/TPU run)
and one row at a time (``batch_loop=1``, what ``causal_attention.attention`` runs on XLA:CPU on one
device), next to torch's ``scaled_dot_product_attention`` (is_causal) on the same numbers.
A benchmark script, not a test.

    uv run --frozen python packages/olmo-train-jax/bench/bench_attention.py
    uv run --frozen python packages/olmo-train-jax/bench/bench_attention.py --batch 8 --seq 512 --heads 8 --head-dim 32

Defaults: the olmo3-30m shape of ``bench_train.py`` (batch 8, sequence 512, 8 heads of 32),
float32. Reports the best of ``--repeats`` calls per contender (contenders interleaved round
by round, since contention on a shared machine only ever adds time) and the largest
difference of the JAX outputs and gradients from the all-rows path.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
import torch

from olmo_train_jax.causal_attention import blocked_causal_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))

    calls, grads = {}, {}
    for loop in (0, 1):

        def attend(q, k, v, loop=loop):
            return blocked_causal_attention(q, k, v, batch_loop=loop)

        fwd = jax.jit(attend)
        fwd_bwd = jax.jit(lambda q, k, v, do, attend=attend: jax.vjp(attend, q, k, v)[1](do))
        name = "JAX, all rows at once" if loop == 0 else "JAX, one row at a time (XLA:CPU default)"
        calls[name, "forward"] = lambda fwd=fwd: jax.block_until_ready(fwd(q, k, v))
        calls[name, "forward + backward"] = lambda f=fwd_bwd: jax.block_until_ready(f(q, k, v, do))
        grads[name] = [np.asarray(fwd(q, k, v)), *(np.asarray(g) for g in fwd_bwd(q, k, v, do))]

    tq, tk, tv, tdo = (torch.from_numpy(a).transpose(1, 2).contiguous() for a in (q, k, v, do))

    def torch_forward():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def torch_forward_backward():
        a, b, c = (t.detach().requires_grad_() for t in (tq, tk, tv))
        torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True).backward(tdo)

    calls["torch SDPA", "forward"] = torch_forward
    calls["torch SDPA", "forward + backward"] = torch_forward_backward

    load_before = os.getloadavg()[0]
    for fn in calls.values():
        fn()  # compile / warm up
    best = {key: float("inf") for key in calls}
    for _ in range(args.repeats):
        for key, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)

    print(
        f"causal attention, batch {args.batch}, seq {args.seq}, {args.heads} heads of {args.head_dim}, float32, "
        f"best of {args.repeats}, jax {jax.__version__}, torch {torch.__version__}"
    )
    print("| implementation | forward ms | forward + backward ms |\n|---|---:|---:|")
    for name in dict.fromkeys(n for n, _ in calls):
        print(f"| {name} | {best[name, 'forward'] * 1e3:.1f} | {best[name, 'forward + backward'] * 1e3:.1f} |")
    base, looped = grads.values()
    diff = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(looped, base, strict=True))
    print(f"one row at a time vs all rows: largest difference {diff:.1e} of the scale (output, dq, dk, dv)")
    print(f"load average (1 min) before {load_before:.1f}, after {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()

"""Forward-pass throughput on this machine's CPU: our torch model, our JAX model (jitted) and
transformers' Olmo3ForCausalLM, on the same weights, side by side.

    uv run --frozen python tools/bench/bench_forward.py [--spec olmo3-30m] [--seq-len 512] [--batch 4]
        [--dtype float32|bfloat16] [--steps 5]

The three run round-robin (one forward each per round, after a warm-up round that also
compiles the JAX function), so background load hits them alike; the table gives the median
seconds per forward, tokens/s and the ratio to transformers, and the largest logit
difference to transformers (a benchmark of different maths would be meaningless).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from olmo_model import hf_config, load_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="olmo3-30m", help="preset or spec file")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from transformers import Olmo3Config, Olmo3ForCausalLM

    from olmo_tools.native import torch_to_numpy
    from olmo_train_jax import model_from_hf as jax_model_from_hf
    from olmo_train_torch import initial_model, to_hf

    spec = load_spec(args.spec)
    dtype = getattr(torch, args.dtype)
    console = Console(width=120)
    console.print(
        f"spec {spec.name}: d_model {spec.d_model}, {spec.n_layers} layers, window {spec.sliding_window}, "
        f"vocab {spec.padded_vocab_size}; batch {args.batch} x seq {args.seq_len}, {args.dtype}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), jax {jax.__version__} on {jax.devices()[0]}"
    )
    ours = initial_model(spec, seed=args.seed, dtype=dtype).eval()
    tensors = to_hf(ours, spec)
    reference = Olmo3ForCausalLM(Olmo3Config.from_dict(hf_config(spec))).to(dtype).eval()
    missing, unexpected = reference.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise SystemExit(f"transformers model does not take our weights: missing {missing}, unexpected {unexpected}")
    jax_model = jax_model_from_hf(
        spec, {n: torch_to_numpy(t) for n, t in tensors.items()}, param_dtype=args.dtype, dtype=args.dtype
    )
    jax_forward = nnx.jit(lambda m, ids: m(ids).logits)
    ids = np.random.default_rng(args.seed).integers(0, spec.vocab_size, (args.batch, args.seq_len))
    ids_torch, ids_jax = torch.from_numpy(ids), jnp.asarray(ids, jnp.int32)

    def run_torch():
        with torch.no_grad():
            return ours(ids_torch).logits

    def run_jax():
        return jax_forward(jax_model, ids_jax).block_until_ready()

    def run_transformers():
        with torch.no_grad():
            return reference(ids_torch).logits

    runners = {"torch (ours)": run_torch, "jax (ours, jit)": run_jax, "transformers Olmo3": run_transformers}
    ref_logits = run_transformers().float().numpy()
    diffs = {name: float(np.abs(np.asarray(fn(), dtype=np.float32) - ref_logits).max()) for name, fn in runners.items()}
    del ref_logits
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.steps):
        for name, fn in runners.items():
            start = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - start)
            del out

    tokens = args.batch * args.seq_len
    base = statistics.median(times["transformers Olmo3"])
    table = Table(title=f"forward, {spec.name}, {args.batch} x {args.seq_len} tokens, {args.dtype}, CPU")
    for column in ("implementation", "median s/forward", "tokens/s", "vs transformers", "max |logit diff|"):
        table.add_column(column, justify="left" if column == "implementation" else "right")
    for name, samples in times.items():
        median = statistics.median(samples)
        table.add_row(name, f"{median:.3f}", f"{tokens / median:,.0f}", f"{base / median:.2f}x", f"{diffs[name]:.1e}")
    console.print(table)


if __name__ == "__main__":
    main()

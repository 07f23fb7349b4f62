"""Context parallelism on simulated CPU devices: the trainer's fused step at CP=4 (4 devices) against
CP=1 (1 device) at a long sequence, side by side in one run, with where the time goes (one layer's
attention forward + backward of each kind, against the whole step).

    uv run --frozen python packages/olmo-train-jax/bench/bench_context.py [--seq 4096] [--steps 3]

The 4 simulated devices share this machine's cores, so CP=4 is not expected to be 4x faster: what
it shows is the cost of the split (the collectives, the kernel's masked blocks) against the work it
divides. Spec: olmo3-14m's shape (d_model 128, 4 layers: 3 sliding of window 512, 1 global, 8
heads) with a 4096-token vocabulary, so the attention is a visible part of the step; fp32; one row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _median_seconds(fn, steps: int) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from olmo_model import get_preset
    from olmo_run.recipe import load_recipe
    from olmo_train_jax import parallelize as sh
    from olmo_train_jax.causal_attention import attention
    from olmo_train_jax.context_parallel import context_attention
    from olmo_train_jax.model import build_model
    from olmo_train_jax.step import BATCH_KEYS, for_mesh, step_functions

    if jax.device_count() < 4:
        print("bench_context: needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)", file=sys.stderr)
        return 2
    spec = get_preset("olmo3-14m").replace(
        vocab_size=4096, padded_vocab_size=4096, eos_token_id=0, pad_token_id=1, sliding_window=args.window
    )
    recipe = load_recipe(None, ["--train.precision=fp32"])
    seq = args.seq
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 4096, (1, seq + 1)).astype(np.int32)
    local = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "doc_ids": np.zeros((1, seq), np.int32)}
    rows = []
    for degree in (1, 4):
        axes = {"data": 1} if degree == 1 else {"data": 1, "context": degree}
        mesh = sh.build_mesh(axes, jax.devices()[:degree])
        m = for_mesh(build_model(spec, seed=0), spec, recipe, mesh)
        fns = step_functions(m, spec, recipe, mesh)
        params = jax.device_put(m.params, m.params_sh)
        opt = jax.jit(m.tx.init, out_shardings=m.opt_sh)(params)
        batch = {k: sh.global_batch_array(local[k], mesh, 1, 1) for k in BATCH_KEYS}
        state = [params, opt]

        def step(state=state, fns=fns, batch=batch):
            state[0], state[1], stats = fns.fused(state[0], state[1], batch, np.float32(1e-4), np.int32(1))
            jax.block_until_ready(stats["loss"])

        step_s = _median_seconds(step, args.steps)

        # One layer's attention, forward + backward, for each kind, on the same placement.
        kv = spec.kv_heads
        q = jax.device_put(
            jnp.asarray(rng.standard_normal((1, seq, spec.n_heads, spec.head_dim)), jnp.float32),
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context" if degree > 1 else None)),
        )
        k = q[:, :, :kv]
        positions = sh.sequence_positions(mesh, seq)
        layer = {}
        for kind, window in (("sliding", spec.sliding_window), ("global", None)):
            if degree == 1:

                def loss(q, k, window=window):
                    return jnp.sum(attention(q, k, k, window, None, "xla", 1, "cpu") ** 2)

            else:
                ctx = sh.build_context(mesh, spec)
                assert ctx is not None

                def loss(q, k, window=window, ctx=ctx):
                    return jnp.sum(context_attention(q, k, k, window, None, jnp.asarray(positions), ctx) ** 2)

            grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
            layer[kind] = _median_seconds(lambda grad=grad: jax.block_until_ready(grad(q, k)), args.steps)
        n_sliding = sum(1 for i in range(spec.n_layers) if spec.window_of(i) is not None)
        attention_s = n_sliding * layer["sliding"] + (spec.n_layers - n_sliding) * layer["global"]
        rows.append(
            {
                "context": degree,
                "devices": degree,
                "step_s": step_s,
                "tokens_per_s": seq / step_s,
                "attention_sliding_layer_s": layer["sliding"],
                "attention_global_layer_s": layer["global"],
                "attention_share_of_step": attention_s / step_s,
            }
        )
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speed_vs_cp1"] = r["tokens_per_s"] / base
    print(
        json.dumps({"seq": seq, "window": args.window, "spec": "olmo3-14m shape, vocab 4096", "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

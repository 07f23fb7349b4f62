"""What the JAX train step keeps for its backward, per remat policy (a measurement script, not a test).

    uv run --frozen python packages/olmo-train-jax/bench/memory_step.py [--preset olmo3-1b] [--layers 4]
        [--seq 4096] [--temp-batches 1 2] [--plain]

1. Residuals: the arrays the backward of ``--layers`` decoder layers keeps (the leaves of
   ``jax.vjp``, traced, not run), bf16 compute, one sequence, per ``jax.remat`` policy, in GiB,
   with the five largest kinds.
2. XLA temp: ``memory_analysis()`` of the trainer's jitted gradient program (all layers, head and
   loss, remat none) compiled for this machine's backend, at ``--temp-batches`` sequences.

``--plain`` swaps the model's RMSNorm and SwiGLU back to plain autodiff (no custom VJPs), the
before of layers.py. Figures (olmo3-1b, 4 layers, 4096 tokens, compiled for CPU, 2026-11-29):
``bench/results/2026-11-29-memory-step.md``.
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_model import get_preset
from olmo_run.recipe import load_recipe
from olmo_train_jax import model as model_module
from olmo_train_jax.layers import plain_rms_norm, plain_swiglu_down
from olmo_train_jax.model import REMAT_POLICIES, build_model
from olmo_train_jax.step import for_mesh, step_functions


def residuals(spec, remat: str, seq: int) -> tuple[float, list[tuple[str, float]]]:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(spec, seed=0, dtype=jnp.bfloat16, remat=remat)))
    params = nnx.to_pure_dict(state)
    ids = jnp.zeros((1, seq), jnp.int32)

    def loss(params):
        hidden, _ = nnx.merge(graphdef, params).hidden_states(ids)
        return hidden.astype(jnp.float32).sum()

    leaves = jax.tree.leaves(jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params))
    kinds: collections.Counter = collections.Counter()
    for leaf in leaves:
        kinds[f"{leaf.dtype}{list(leaf.shape)}"] += leaf.size * leaf.dtype.itemsize
    return sum(kinds.values()) / 2**30, [(k, v / 2**30) for k, v in kinds.most_common(5)]


def temp_gib(spec, batch: int, seq: int) -> float:
    recipe = load_recipe(None, ["--train.precision=bf16"])
    from olmo_train_jax import parallelize

    mesh = parallelize.build_mesh({"data": -1})
    m = for_mesh(nnx.eval_shape(lambda: build_model(spec, seed=0, dtype=jnp.bfloat16)), spec, recipe, mesh)
    fns = step_functions(m, spec, recipe, mesh)
    data = {k: jax.ShapeDtypeStruct((1, batch, seq), jnp.int32) for k in ("input_ids", "labels", "doc_ids")}
    compiled = fns.grads.lower(m.params, data, jax.ShapeDtypeStruct((), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="olmo3-1b")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers for the residual count")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--temp-batches", type=int, nargs="*", default=[1], help="sequences; none: skip part 2")
    parser.add_argument("--plain", action="store_true", help="RMSNorm and SwiGLU by plain autodiff (the before)")
    args = parser.parse_args()
    if args.plain:
        model_module.rms_norm, model_module.swiglu_down = plain_rms_norm, plain_swiglu_down
    spec = get_preset(args.preset)
    few = spec.replace(n_layers=args.layers, layer_types=spec.layer_types[: args.layers])
    label = "plain autodiff" if args.plain else "custom VJPs"
    for remat in REMAT_POLICIES:
        total, top = residuals(few, remat, args.seq)
        print(
            f"residuals, {args.preset} x {args.layers} layers, {args.seq} tokens, remat {remat} ({label}): "
            f"{total:.2f} GiB; largest: " + ", ".join(f"{k} {v:.2f}" for k, v in top),
            flush=True,
        )
    for batch in args.temp_batches:
        print(
            f"XLA temp of the gradient program ({jax.default_backend()}), {args.preset}, {batch} x {args.seq} "
            f"tokens, remat none ({label}): {temp_gib(spec, batch, args.seq):.1f} GiB",
            flush=True,
        )


if __name__ == "__main__":
    main()

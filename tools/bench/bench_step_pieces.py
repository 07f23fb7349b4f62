"""Where a CPU train step's time goes, in both frameworks: the parts of a step timed
interleaved round by round (best of ``--steps`` after a warm-up round): output head + loss
forward+backward (each trainer's chunked one, and plain autodiff / transformers' way), the
layers (+ embedding) forward+backward with the head cut to one column, and the AdamW update.
The whole step of olmo-train-jax against transformers: packages/olmo-train-jax/bench/bench_train.py.

    uv run --frozen python tools/bench/bench_step_pieces.py
    uv run --frozen python tools/bench/bench_step_pieces.py --preset olmo3-30m --seq 512 --batch 8 --steps 3
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def bench_pieces(spec, seq: int, batch: int, steps: int, ids: np.ndarray, labels: np.ndarray) -> dict:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from transformers import Olmo3Config, Olmo3ForCausalLM

    from olmo_model import hf_config
    from olmo_run.recipe import load_recipe
    from olmo_train_jax.head_loss import head_loss_sums
    from olmo_train_jax.model import build_model
    from olmo_train_jax.step import make_optimizer, token_loss_sums
    from olmo_train_torch.head_loss import head_loss_sums as torch_head_loss_sums

    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((batch, seq, spec.d_model)).astype(np.float32)
    head = (rng.standard_normal((spec.d_model, spec.padded_vocab_size)) * spec.init_std).astype(np.float32)
    z_weight = spec.z_loss_weight
    pieces = {}

    labels_j, ids_j = jnp.asarray(labels), jnp.asarray(ids)

    def head_loss_plain(x, w):
        logits = jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)
        ce, z, n = token_loss_sums(logits, labels_j)
        return (ce + z_weight * z) / n

    def head_loss(x, w):  # the trainer's: chunked, gradient computed in the forward pass
        objective, _, _, n = head_loss_sums(x, w, labels_j, z_weight)
        return objective / n

    graphdef, state = nnx.split(build_model(spec, seed=0))

    def body(state):
        model = nnx.merge(graphdef, state)
        model.lm_head = nnx.Param(model.lm_head[...][:, :1])  # leaves the layers and the embedding
        return jnp.sum(model(ids_j).logits)

    with jax.default_matmul_precision("highest"):  # as the fp32 trainer runs
        jax_head = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
        jax_head_plain = jax.jit(jax.grad(head_loss_plain, argnums=(0, 1)))
        jax_body = jax.jit(jax.grad(body))
    x_j, w_j = jnp.asarray(hidden), jnp.asarray(head)
    pieces["JAX head + loss (trainer: chunked)"] = lambda: jax.block_until_ready(jax_head(x_j, w_j))
    pieces["JAX head + loss (plain autodiff)"] = lambda: jax.block_until_ready(jax_head_plain(x_j, w_j))
    pieces["JAX layers + embedding"] = lambda: jax.block_until_ready(jax_body(state))
    params = jax.tree.map(jnp.copy, nnx.to_pure_dict(state))
    tx = make_optimizer(params, load_recipe(None, ["--train.precision=fp32"]))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p - 1e-3 * u, params, updates), opt_state

    # grads an argument, as in the trainer's step: closed over, they became a 220 MB constant of
    # the program and inflated the piece (packages/olmo-train-jax/bench/results/2026-11-29-train-step-pieces-cpu.md).
    jax_update = jax.jit(update, donate_argnums=(0, 1))
    carry = [params, jax.jit(tx.init)(params)]

    def run_update():
        carry[:] = jax_update(*carry, grads)
        jax.block_until_ready(carry[0])

    pieces["JAX AdamW"] = run_update

    x_t = torch.from_numpy(hidden).requires_grad_()
    w_t = torch.from_numpy(head).requires_grad_()
    y_t = torch.from_numpy(labels).long()

    def torch_head():
        logits = x_t @ w_t
        lse = torch.logsumexp(logits, dim=-1)
        ce = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y_t.view(-1))
        (ce + z_weight * (lse**2).mean()).backward()
        x_t.grad = w_t.grad = None

    w_rows = torch.from_numpy(head.T.copy()).requires_grad_()

    def torch_head_ours():
        objective, _, _ = torch_head_loss_sums(x_t, w_rows, y_t, z_weight)
        (objective / (y_t != -100).sum()).backward()
        x_t.grad = w_rows.grad = None

    torch.manual_seed(0)
    model = Olmo3ForCausalLM(Olmo3Config(**hf_config(spec))).float().train()
    ids_t = torch.from_numpy(ids).long()
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)  # the body's backward accumulates onto these
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    pieces["torch head + loss (olmo-train-torch: chunked)"] = torch_head_ours
    pieces["torch head + loss (transformers' way)"] = torch_head
    pieces["torch layers + embedding"] = lambda: model.model(input_ids=ids_t).last_hidden_state.sum().backward()
    pieces["torch AdamW"] = opt.step

    times = {name: [] for name in pieces}
    for round_ in range(steps + 1):
        for name, fn in pieces.items():
            t0 = time.perf_counter()
            fn()
            if round_:  # round 0 compiles (JAX) and warms caches (both)
                times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


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

    from olmo_model import get_preset

    torch.set_num_threads(os.cpu_count() or 1)
    spec = get_preset(args.preset)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.vocab_size, size=(args.batch, args.seq)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100

    load_before = os.getloadavg()[0]
    best = bench_pieces(spec, args.seq, args.batch, args.steps, ids, labels)
    table = Table(title=f"{args.preset} step pieces (forward + backward), seq {args.seq}, batch {args.batch}, fp32")
    table.add_column("piece")
    table.add_column("best s", justify="right")
    for name, t in best.items():
        table.add_row(name, f"{t:.2f}")
    Console(width=200).print(table)
    print(f"1-minute load average: {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()

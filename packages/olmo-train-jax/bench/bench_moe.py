"""MoE block throughput of the JAX trainer's code on this machine (CPU, float32): a benchmark
script, not a test. Same shapes as packages/olmo-train-torch/bench/bench_moe.py, so the two
tables compare.

    uv run --frozen python packages/olmo-train-jax/bench/bench_moe.py [--tokens 2048] [--repeats 10]

Part 1, one device: forward+backward tokens/s of one MoE block (d_model 128, top-4,
expert_hidden 64, one shared expert of 64; loss = mean(out^2) + 0.01 x load balancing, the
train step's gradient work) as the pool grows 8 -> 16 -> 32 -> 64 -> 128 experts. Active parameters
per token stay constant (4 routed + 1 shared SwiGLU of width 64), so an ideal implementation
keeps tokens/s flat; what grows is the router (d x E), the sort and the per-expert groups.

Part 1b: the same step at 8 / 64 / 128 experts with the router's top-k as ``jax.lax.top_k``
(the block's top-k until commit bf645d6, 2026-11-29: XLA:CPU ran it inside the step as a full
sort) and as
``moe.top_k_lowest_index_on_ties``, interleaved.

Part 2, 4 simulated devices (``--xla_force_host_platform_device_count=4``, set below before
JAX starts), the block's experts split over an ``expert`` axis of 4, two ways side by side:

- ``ep``: expert parallel, tokens travel: ``expert_parallel.expert_parallel_experts``
  (all-to-all dispatch and combine, and their transposes in the backward);
- ``allgather``: FSDP-style, weights travel: each device all-gathers the full expert weights
  inside ``shard_map`` and computes its own tokens with ``moe.local_experts``; the backward
  of the all-gather is a reduce-scatter of the expert gradients.

Routing is "uniform" in part 2 so that both see identical, balanced work. Reports the best
of ``--repeats`` timed steps per configuration (configurations interleaved, since contention
on a shared machine only ever adds time), tokens/s and the bytes each device sends per step,
and the load average before and after.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from olmo_model import MoESpec  # noqa: E402
from olmo_train_jax.expert_parallel import EXPERT_AXIS, expert_parallel_experts  # noqa: E402
from olmo_train_jax.grouped_gemm import ExpertWeights  # noqa: E402
from olmo_train_jax.moe import local_experts, moe_block  # noqa: E402

D_MODEL, HIDDEN, TOP_K = 128, 64, 4
EP = 4
BYTES = 4  # float32


def make_block(n_experts: int, seed: int = 0) -> tuple[MoESpec, dict]:
    moe = MoESpec(n_experts=n_experts, top_k=TOP_K, expert_hidden=HIDDEN, n_shared_experts=1)
    keys = jax.random.split(jax.random.key(seed), 7)

    def w(i, *shape):
        return 0.02 * jax.random.normal(keys[i], shape, jnp.float32)

    params = {
        "router": w(0, D_MODEL, n_experts),
        "routed": ExpertWeights(
            w(1, n_experts, D_MODEL, HIDDEN), w(2, n_experts, D_MODEL, HIDDEN), w(3, n_experts, HIDDEN, D_MODEL)
        ),
        "shared": ExpertWeights(w(4, D_MODEL, HIDDEN), w(5, D_MODEL, HIDDEN), w(6, HIDDEN, D_MODEL)),
    }
    return moe, params


def train_step_fn(moe: MoESpec, routing: str, experts_fn):
    """jit(grad) of the block's loss: the MoE part of a train step's forward and backward."""

    def loss(params, x):
        out, stats = moe_block(
            x, params["router"], params["routed"], params["shared"], moe, routing=routing, experts_fn=experts_fn
        )
        return jnp.mean(jnp.square(out)) + 0.01 * stats.load_balancing

    return jax.jit(jax.grad(loss))


def best_times(fns: dict, repeats: int) -> dict:
    """Fastest of ``repeats`` timed calls of each function, interleaved round-robin."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile + warm-up
    best = {key: float("inf") for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def scaling(tokens: int, repeats: int) -> list[dict]:
    x = jax.random.normal(jax.random.key(1), (tokens, D_MODEL), jnp.float32)
    fns = {}
    for n_experts in (8, 16, 32, 64, 128):  # 128: the anchor's pool (8 -> 128 on 8 B300)
        moe, params = make_block(n_experts)
        step = train_step_fn(moe, "learned", local_experts)
        fns[n_experts] = functools.partial(step, params, x)
    best = best_times(fns, repeats)
    return [{"experts": e, "seconds": t, "tokens_per_s": tokens / t} for e, t in best.items()]


def top_k_before_and_after(tokens: int, repeats: int) -> list[dict]:
    """Part 1's step at 8 / 64 / 128 experts with the router's top-k as ``jax.lax.top_k`` (what
    the block used until commit bf645d6) and as ``moe.top_k_lowest_index_on_ties`` (k argmax
    passes), interleaved in one run."""
    import olmo_train_jax.moe as moe_module

    x = jax.random.normal(jax.random.key(1), (tokens, D_MODEL), jnp.float32)
    fns = {}
    ours = moe_module.top_k_lowest_index_on_ties
    for top_k_name, top_k in (("lax.top_k", jax.lax.top_k), ("argmax passes", ours)):
        moe_module.top_k_lowest_index_on_ties = top_k  # what route() calls while it is traced
        try:
            for n_experts in (8, 64, 128):
                moe, params = make_block(n_experts)
                step = train_step_fn(moe, "learned", local_experts)
                jax.block_until_ready(step(params, x))  # traced and compiled with this top-k
                fns[top_k_name, n_experts] = functools.partial(step, params, x)
        finally:
            moe_module.top_k_lowest_index_on_ties = ours
    best = best_times(fns, repeats)
    return [{"top_k": name, "experts": e, "seconds": t} for (name, e), t in best.items()]


def allgather_experts(mesh):
    """The FSDP-style ExpertsFn: gather every expert's weights, compute this device's tokens."""
    tokens = P((EXPERT_AXIS,))

    def body(x, experts, weights, w):
        full = ExpertWeights(*(jax.lax.all_gather(t, EXPERT_AXIS, axis=0, tiled=True) for t in w))
        out, computed = local_experts(x, experts, weights, full)
        return out, jax.lax.psum(computed, EXPERT_AXIS)

    def experts_fn(x, experts, weights, w):
        split = ExpertWeights(P(EXPERT_AXIS), P(EXPERT_AXIS), P(EXPERT_AXIS))
        return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, split), out_specs=(tokens, P()))(
            x, experts, weights, w
        )

    return experts_fn


def expert_parallel_vs_allgather(tokens: int, repeats: int) -> list[dict]:
    mesh = jax.make_mesh((EP,), (EXPERT_AXIS,), axis_types=(AxisType.Auto,))
    x = jax.device_put(
        jax.random.normal(jax.random.key(1), (tokens, D_MODEL), jnp.float32), NamedSharding(mesh, P(EXPERT_AXIS))
    )
    rows = []
    fns, meta = {}, {}
    for n_experts in (8, 64):
        moe, params = make_block(n_experts)
        placed = {
            "router": jax.device_put(params["router"], NamedSharding(mesh, P())),
            "shared": jax.device_put(params["shared"], NamedSharding(mesh, P())),
            "routed": jax.device_put(params["routed"], NamedSharding(mesh, P(EXPERT_AXIS))),
        }
        n_assign = tokens // EP * TOP_K  # (token, slot) rows per device
        # ep: the dispatch buffer [ep, n_assign, d] and the combine buffer go to the other ranks,
        # forward and (transposed) backward: 4 all-to-alls of (ep-1)/ep of the buffer.
        ep_bytes = 4 * (EP - 1) * n_assign * D_MODEL * BYTES
        # allgather: each device's expert shard to every other device, and the gradient's
        # reduce-scatter back: 2 x (ep-1) shards of 3 x d x hidden per local expert.
        ag_bytes = 2 * (EP - 1) * (n_experts // EP) * 3 * D_MODEL * HIDDEN * BYTES
        for how, fn, sent in (
            ("ep", expert_parallel_experts(mesh), ep_bytes),
            ("allgather", allgather_experts(mesh), ag_bytes),
        ):
            step = train_step_fn(moe, "uniform", fn)
            fns[how, n_experts] = functools.partial(step, placed, x)
            meta[how, n_experts] = sent
    best = best_times(fns, repeats)
    for (how, n_experts), t in best.items():
        rows.append(
            {
                "how": how,
                "experts": n_experts,
                "seconds": t,
                "tokens_per_s": tokens / t,
                "mib_sent_per_device": meta[how, n_experts] / 2**20,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    load_before = os.getloadavg()
    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, {args.tokens} tokens, "
        f"best of {args.repeats}"
    )
    print("\npart 1: one device, forward+backward of one MoE block (top-4, constant active parameters)")
    print("| experts | step ms | tokens/s |\n|---:|---:|---:|")
    for r in scaling(args.tokens, args.repeats):
        print(f"| {r['experts']} | {r['seconds'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} |")
    print("\npart 1b: the router's top-k, before (jax.lax.top_k) and now (argmax passes)")
    print("| top-k | experts | step ms |\n|---|---:|---:|")
    for r in top_k_before_and_after(args.tokens, args.repeats):
        print(f"| {r['top_k']} | {r['experts']} | {r['seconds'] * 1e3:.1f} |")
    print(f"\npart 2: {EP} devices, experts split over expert={EP}, uniform routing")
    print("| experts | how | step ms | tokens/s (all devices) | MiB sent per device per step |")
    print("|---:|---|---:|---:|---:|")
    for r in expert_parallel_vs_allgather(args.tokens, args.repeats):
        print(
            f"| {r['experts']} | {r['how']} | {r['seconds'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{r['mib_sent_per_device']:.2f} |"
        )
    load_after = os.getloadavg()
    print(f"\nload average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()

"""The mixture-of-experts feed-forward block of the JAX model (issue 8).

Maths (the contract shared with the Torch trainer and ``olmo_model.reference``):

- router logits ``r = x @ W_router`` in float32; probabilities ``p = softmax(r)`` (or
  ``sigmoid(r)``); each token takes the top-k of ``p`` (``lax.top_k`` puts the lower expert
  index first among equal values, as the reference's stable sort does); weights
  ``w = p[top-k]``, renormalised to sum 1 if ``normalize_top_k``;
- ``out = sum_k w_k SwiGLU_{e_k}(x) + sum_s SwiGLU_shared_s(x)``; the shared experts are
  stored concatenated along their hidden axis, which is the same sum computed as one SwiGLU;
- dropless: all T*k (token, slot) assignments are computed. They are sorted by expert (a
  stable argsort, token order kept inside a group), the group sizes counted on device, and
  each of the three SwiGLU matmuls is ONE ``jax.lax.ragged_dot`` over the variable-size
  groups (it runs on CPU in jax 0.10, forward and backward, so no fallback is needed);
- aux losses of a layer over the tokens it is given, which in the jitted global view is the
  whole global micro-batch whatever the device count: load balancing
  ``E * sum_e f_e P_e`` (f_e: share of the T*k assignments that went to e, P_e: mean
  probability of e) and router z-loss ``mean(logsumexp(r)^2)``.

Routing modes (a runtime knob, not in the spec): ``learned`` (above); ``random``: scores
are i.i.d. uniform numbers from the key of (seed, step, layer), the weights are the
softmax of the chosen k scores; ``uniform``: token t of the micro-batch goes to experts
``(t*k + j) mod E`` with weight 1/k. In both the router still runs, on stopped gradients,
so its aux losses are reported; their weight in the loss is 0 (``aux_loss``).

Where the routed experts run is a pluggable ``ExpertsFn``: ``local_experts`` here (all
experts on this device, or under plain data parallelism the global view), or
``expert_parallel.expert_parallel_experts(mesh)``, which moves tokens to the devices of an
``expert`` mesh axis that hold their experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from olmo_model import MoESpec

ROUTING_MODES: tuple[str, ...] = ("learned", "random", "uniform")


class ExpertWeights(NamedTuple):
    """Routed experts stacked on a leading expert axis, (in, out) kernels: gate/up
    [E, d, hidden], down [E, hidden, d]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


# (tokens [T, d], experts [T, k] int32, weights [T, k] float32, expert weights)
#   -> (routed output [T, d] in the tokens' dtype, assignments computed: int32 scalar)
ExpertsFn = Callable[[jax.Array, jax.Array, jax.Array, ExpertWeights], tuple[jax.Array, jax.Array]]


class MoEStats(NamedTuple):
    """Routing of one MoE layer (or, from ``OlmoModel.forward_with_aux``, of all MoE layers:
    losses averaged over layers, counts summed)."""

    load_balancing: jax.Array  # [] float32, E * sum_e f_e P_e
    router_z: jax.Array  # [] float32, mean over tokens of logsumexp(router logits)^2
    tokens_per_expert: jax.Array  # [E] int32, (token, slot) assignments per expert
    dropped: jax.Array  # [] int32, assignments not computed; 0 by construction (dropless)


def route(
    logits: jax.Array, moe: MoESpec, mode: str = "learned", key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routing of T tokens from float32 router ``logits`` [T, E] -> (experts [T, k] int32,
    weights [T, k] float32, router probabilities [T, E])."""
    probs = jax.nn.softmax(logits, axis=-1) if moe.gating == "softmax" else jax.nn.sigmoid(logits)
    n_tokens, n_experts, k = logits.shape[0], moe.n_experts, moe.top_k
    if mode == "learned":
        weights, experts = jax.lax.top_k(probs, k)
        if moe.normalize_top_k:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    elif mode == "random":
        if key is None:
            raise ValueError("routing='random' needs a PRNG key (routing_key) derived from (seed, step)")
        scores, experts = jax.lax.top_k(jax.random.uniform(key, (n_tokens, n_experts), jnp.float32), k)
        weights = jax.nn.softmax(scores, axis=-1)
    elif mode == "uniform":
        experts = jnp.arange(n_tokens * k, dtype=jnp.int32).reshape(n_tokens, k) % n_experts
        weights = jnp.full((n_tokens, k), 1.0 / k, jnp.float32)
    else:
        raise ValueError(f"routing='{mode}' is unknown; use one of: {', '.join(ROUTING_MODES)}")
    return experts.astype(jnp.int32), weights.astype(jnp.float32), probs


def routing_stats(logits: jax.Array, probs: jax.Array, experts: jax.Array, computed: jax.Array) -> MoEStats:
    """Aux losses and counts of one layer over the T tokens of ``logits`` [T, E]."""
    n_tokens, n_experts = probs.shape
    k = experts.shape[-1]
    counts = jnp.bincount(experts.reshape(-1), length=n_experts).astype(jnp.int32)
    # Counts carry no gradient (they are integers); the mean probabilities do.
    share = counts.astype(jnp.float32) / (n_tokens * k)
    load_balancing = n_experts * jnp.sum(share * jnp.mean(probs, axis=0))
    lse = jax.nn.logsumexp(logits, axis=-1)
    return MoEStats(load_balancing, jnp.mean(lse * lse), counts, jnp.int32(n_tokens * k) - computed)


def sort_by_expert(experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order, group_sizes): ``order`` [A] lists the flat (token, slot) indices of
    ``experts`` [A] grouped by expert, token order kept inside a group; ``group_sizes`` [E]
    int32. Ids >= n_experts (padding) sort last and are not counted."""
    order = jnp.argsort(experts, stable=True)
    return order, jnp.bincount(experts, length=n_experts).astype(jnp.int32)


def grouped_swiglu(xs: jax.Array, w: ExpertWeights, group_sizes: jax.Array) -> jax.Array:
    """Rows of ``xs`` [N, d], sorted into consecutive groups of ``group_sizes`` [E] rows, each
    through its own expert's SwiGLU -> [N, d]; rows past sum(group_sizes) come back zero."""
    dtype = xs.dtype
    gate = jax.lax.ragged_dot(xs, w.gate.astype(dtype), group_sizes)
    up = jax.lax.ragged_dot(xs, w.up.astype(dtype), group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w.down.astype(dtype), group_sizes)


def combine(ys_flat: jax.Array, weights: jax.Array) -> jax.Array:
    """Expert outputs per flat (token, slot) [T*k, d] and weights [T, k] -> [T, d]: the
    weighted sum over a token's k slots, accumulated in float32."""
    n_tokens, k = weights.shape
    ys = ys_flat.reshape(n_tokens, k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", ys, weights).astype(ys_flat.dtype)


def local_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights) -> tuple[jax.Array, jax.Array]:
    """The routed part with every expert on this device (an ``ExpertsFn``)."""
    n_experts = w.gate.shape[0]
    k = experts.shape[-1]
    order, sizes = sort_by_expert(experts.reshape(-1), n_experts)
    ys_sorted = grouped_swiglu(x[order // k], w, sizes)
    ys = jnp.zeros_like(ys_sorted).at[order].set(ys_sorted)
    return combine(ys, weights), jnp.sum(sizes)


def moe_block(
    x: jax.Array,
    router: jax.Array,
    routed: ExpertWeights,
    shared: ExpertWeights | None,
    moe: MoESpec,
    *,
    routing: str = "learned",
    key: jax.Array | None = None,
    experts_fn: ExpertsFn = local_experts,
) -> tuple[jax.Array, MoEStats]:
    """One MoE feed-forward block on tokens ``x`` [T, d] (compute dtype) -> (output [T, d],
    MoEStats). ``router`` [d, E]; ``shared`` holds the shared experts concatenated along
    their hidden axis (gate/up [d, S*hidden], down [S*hidden, d]), or None."""
    learned = routing == "learned"
    router_in = x if learned else jax.lax.stop_gradient(x)
    router_w = router if learned else jax.lax.stop_gradient(router)
    logits = jnp.dot(router_in.astype(jnp.float32), router_w.astype(jnp.float32))
    experts, weights, probs = route(logits, moe, routing, key)
    out, computed = experts_fn(x, experts, weights, routed)
    if shared is not None:
        dtype = x.dtype
        hidden = jax.nn.silu(x @ shared.gate.astype(dtype)) * (x @ shared.up.astype(dtype))
        out = out + hidden @ shared.down.astype(dtype)
    return out, routing_stats(logits, probs, experts, computed)


def aux_loss(stats: MoEStats, moe: MoESpec, routing: str = "learned") -> jax.Array:
    """The aux term of the training loss, lb_weight * lb + router_z_weight * router_z; zero
    for random/uniform routing, whose router is not trained."""
    if routing != "learned":
        return jnp.zeros((), jnp.float32)
    return moe.load_balancing_loss_weight * stats.load_balancing + moe.router_z_loss_weight * stats.router_z


def moe_metrics(stats: MoEStats, ep_size: int) -> dict[str, float | int | list[int]]:
    """The MoE keys of a train line (the contract shared with the Torch trainer) from one
    step's stats: counts summed over MoE layers, per expert-rank load, losses unweighted."""
    counts = np.asarray(jax.device_get(stats.tokens_per_expert)).astype(np.int64)
    return {
        "moe_tokens_per_expert": counts.tolist(),
        "moe_rank_load_max_over_mean": rank_load_max_over_mean(counts, ep_size),
        "moe_dropped_tokens": int(stats.dropped),
        "moe_lb_loss": float(stats.load_balancing),
        "moe_router_z_loss": float(stats.router_z),
    }


def rank_load_max_over_mean(tokens_per_expert: np.ndarray, ep_size: int) -> float:
    """Per expert-parallel rank (contiguous blocks of E/ep experts): the assignments it
    computes over their mean; 1.0 is perfect balance, ep_size the worst case."""
    counts = np.asarray(tokens_per_expert, dtype=np.float64)
    if counts.shape[0] % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide n_experts={counts.shape[0]}; choose a divisor")
    per_rank = counts.reshape(ep_size, -1).sum(axis=1)
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0

"""The mixture-of-experts feed-forward block of the JAX model (issue 8).

Maths (the contract shared with the Torch trainer and ``olmo_model.reference``):

- router logits ``r = x @ W_router`` in float32; probabilities ``p = softmax(r)`` (or
  ``sigmoid(r)``); each token takes the top-k of ``p`` (``top_k_lowest_index_on_ties`` puts the
  lower expert index first among equal values, as the reference's stable sort does); weights
  ``w = p[top-k]``, renormalised to sum 1 if ``normalize_top_k``, then times k (summing to k) if
  ``restore_weight_scale``;
- ``out = sum_k w_k SwiGLU_{e_k}(x) + sum_s SwiGLU_shared_s(x)``; the shared experts are
  stored concatenated along their hidden axis, which is the same sum computed as one SwiGLU;
- dropless: all T*k (token, slot) assignments are computed. They are sorted by expert (a
  stable argsort, token order kept inside a group), the group sizes counted on device, and
  each of the three SwiGLU matmuls is ONE grouped GEMM over the variable-size groups
  (``grouped_gemm.grouped_swiglu``): ``jax.lax.ragged_dot`` on TPU, JAX's Hopper Mosaic GPU kernels on
  H100/H200 (XLA:GPU lowers ragged_dot densely over all groups), and on CPU (dense there
  too) the rows padded into one-expert tiles with the matmuls batched over tiles;
- with a capacity factor (``olmo_model.moe``'s rule, per (sequence, expert); ``capacity``):
  the kept assignments fill a static buffer of E x B x C rows run as one batched SwiGLU,
  a dropped assignment adds nothing, and ``RoutingStats.dropped`` counts it;
- aux losses of a layer over the tokens it is given, which in the jitted global view is the
  whole global micro-batch whatever the device count: load balancing
  ``E * sum_e f_e P_e`` (f_e: share of the T*k assignments that went to e, P_e: mean
  probability of e) and router z-loss ``mean(logsumexp(r)^2)``.

Routing modes (a runtime knob, not in the spec): ``learned`` (above); ``random``: scores
are i.i.d. uniform numbers from the key of (seed, step, layer), the weights are the
softmax of the chosen k scores; ``uniform``: token t of the micro-batch goes to experts
``(t*k + j) mod E`` with weight 1/k. In both the router still runs, on stopped gradients,
so its aux losses are reported; their weight in the loss is 0 (``aux_loss``).

MXFP8 (``mxfp8=True`` on ``local_experts`` / ``expert_parallel``; the recipe's ``moe.mxfp8``): the
emulation of OCP MX FP8 that ``grouped_gemm`` describes, the same as the Torch block's.

Where the routed experts run is a pluggable ``ExpertsFn``: ``local_experts`` here (all
experts on this device, or under plain data parallelism the global view), or
``expert_parallel.expert_parallel_experts(mesh)``, which moves tokens to the devices of an
``expert`` mesh axis that hold their experts.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from olmo_model import MoESpec
from olmo_model.moe import aux_loss as weighted_aux_loss
from olmo_model.moe import check_routing, moe_train_metrics

from .capacity import local_buffer, routed_with_capacity
from .grouped_gemm import ExpertWeights, grouped_swiglu
from .layers import linear, swiglu_down


class ExpertsFn(Protocol):
    """(tokens [T, d], experts [T, k] int32, weights [T, k] float32, expert weights; the tokens
    are sequences of ``sequence_length``, None: one sequence) -> (routed output [T, d] in the
    tokens' dtype, assignments computed: int32 scalar)."""

    def __call__(
        self, x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights, *, sequence_length: int | None
    ) -> tuple[jax.Array, jax.Array]: ...


class RoutingStats(NamedTuple):
    """Routing of one MoE layer (or, as ``OlmoModel``'s ``ModelOutput.moe``, of all MoE layers:
    losses averaged over layers, counts summed)."""

    load_balancing: jax.Array  # [] float32, E * sum_e f_e P_e
    router_z: jax.Array  # [] float32, mean over tokens of logsumexp(router logits)^2
    tokens_per_expert: jax.Array  # [E] int32, (token, slot) assignments per expert
    dropped: jax.Array  # [] int32, assignments the capacity rule dropped (0 when dropless)


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed pairwise tree of elementwise adds.

    Why not ``jnp.sum``: XLA:CPU's reduction emitter picks its vectorisation, and with it
    the summation order, from the array's shape, so a sum over 8 experts rounds differently
    for 256 tokens (one device of four) than for 1024 (measured: 1 ulp in the softmax).
    A top-k choice turns such an ulp into a different expert at a near-tie, so routing would
    depend on the device layout; elementwise adds round the same way on every layout."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def softmax_and_logsumexp(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(softmax, logsumexp) over the last axis, layout-invariant (``row_sum``): the max is
    exact in any order, and the shift does not change either value, so it carries no
    gradient."""
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(logits - shift)
    total = row_sum(e)
    return e / total[..., None], jnp.log(total) + shift[..., 0]


def top_k_lowest_index_on_ties(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, indices int32) of the k largest entries along the last axis, largest first and
    the lower index first among equal values (``jax.lax.top_k``'s order, and the torch
    trainer's ``top_k_lowest_index_on_ties``), for finite ``x``. k passes of argmax over E
    instead of ``lax.top_k``, which XLA:CPU ran inside the block's gradient step as a full sort
    of the [T, E] scores (``bench/bench_moe.py`` part 1b; figures in
    ``bench/results/2026-11-29-moe-scaling-cpu.md``). The values are gathered from
    ``x``, so the gradient reaches the chosen entries as ``lax.top_k``'s does."""
    cols = jnp.arange(x.shape[-1], dtype=jnp.int32)
    scores = jax.lax.stop_gradient(x)
    picked = []
    for _ in range(k):
        i = jnp.argmax(scores, axis=-1).astype(jnp.int32)  # the first maximum: the lowest index
        picked.append(i)
        scores = jnp.where(cols == i[..., None], -jnp.inf, scores)
    indices = jnp.stack(picked, axis=-1)
    return jnp.take_along_axis(x, indices, axis=-1), indices


def route(
    logits: jax.Array, moe: MoESpec, mode: str = "learned", key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routing of T tokens from float32 router ``logits`` [T, E] -> (experts [T, k] int32,
    weights [T, k] float32, router probabilities [T, E])."""
    probs = softmax_and_logsumexp(logits)[0] if moe.gating == "softmax" else jax.nn.sigmoid(logits)
    n_tokens, n_experts, k = logits.shape[0], moe.n_experts, moe.top_k
    if mode == "learned":
        weights, experts = top_k_lowest_index_on_ties(probs, k)
        if moe.normalize_top_k:
            weights = weights / row_sum(weights)[..., None]
    elif mode == "random":
        if key is None:
            raise ValueError("routing='random' needs a PRNG key (routing_key) derived from (seed, step)")
        scores, experts = top_k_lowest_index_on_ties(jax.random.uniform(key, (n_tokens, n_experts), jnp.float32), k)
        weights = softmax_and_logsumexp(scores)[0]
    elif mode == "uniform":
        experts = jnp.arange(n_tokens * k, dtype=jnp.int32).reshape(n_tokens, k) % n_experts
        weights = jnp.full((n_tokens, k), 1.0 / k, jnp.float32)
    else:
        check_routing(mode)
        raise AssertionError(mode)  # a mode check_routing accepts but this function does not handle
    if moe.restore_weight_scale:  # every mode's k weights sum to 1 here; OLMo-core 3 scales them to sum to k
        weights = weights * k
    return experts.astype(jnp.int32), weights.astype(jnp.float32), probs


def routing_stats(logits: jax.Array, probs: jax.Array, experts: jax.Array, computed: jax.Array) -> RoutingStats:
    """Aux losses and counts of one layer over the T tokens of ``logits`` [T, E]."""
    n_tokens, n_experts = probs.shape
    k = experts.shape[-1]
    counts = jnp.bincount(experts.reshape(-1), length=n_experts).astype(jnp.int32)
    # Counts carry no gradient (they are integers); the mean probabilities do.
    share = counts.astype(jnp.float32) / (n_tokens * k)
    load_balancing = n_experts * jnp.sum(share * jnp.mean(probs, axis=0))
    lse = softmax_and_logsumexp(logits)[1]
    return RoutingStats(load_balancing, jnp.mean(lse * lse), counts, jnp.int32(n_tokens * k) - computed)


def sort_by_expert(experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order, group_sizes): ``order`` [A] lists the flat (token, slot) indices of
    ``experts`` [A] grouped by expert, token order kept inside a group; ``group_sizes`` [E]
    int32. Ids >= n_experts (padding) sort last and are not counted."""
    order = jnp.argsort(experts, stable=True)
    return order, jnp.bincount(experts, length=n_experts).astype(jnp.int32)


def combine(ys_flat: jax.Array, weights: jax.Array) -> jax.Array:
    """Expert outputs per flat (token, slot) [T*k, d] and weights [T, k] -> [T, d]: the
    weighted sum over a token's k slots, accumulated in float32 in slot order (elementwise,
    so the same rounding on every layout; see ``row_sum``)."""
    n_tokens, k = weights.shape
    ys = ys_flat.reshape(n_tokens, k, -1).astype(jnp.float32)
    out = ys[:, 0] * weights[:, :1]
    for j in range(1, k):
        out = out + ys[:, j] * weights[:, j : j + 1]
    return out.astype(ys_flat.dtype)


def local_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    w: ExpertWeights,
    *,
    sequence_length: int | None = None,
    capacity_factor: float | None = None,
    mxfp8: bool = False,
    gemm: str = "auto",
    device: jax.Device | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The routed part with every expert on this device (an ``ExpertsFn`` as it stands;
    ``functools.partial(local_experts, mxfp8=True)`` for the MXFP8 emulation, ``gemm=`` to
    force a grouped GEMM backend, ``device=`` the device ``auto`` chooses it for,
    ``capacity_factor=`` for ``olmo_model.moe``'s capacity rule, ``capacity``; None: dropless)."""
    n_experts = w.gate.shape[0]
    k = experts.shape[-1]
    if capacity_factor is not None:
        run = local_buffer(w, mxfp8)
        s = x.shape[0] if sequence_length is None else sequence_length
        ys, kept = routed_with_capacity(x, experts, n_experts, s, capacity_factor, run)
        return combine(ys, weights), kept
    order, sizes = sort_by_expert(experts.reshape(-1), n_experts)
    ys_sorted = grouped_swiglu(x[order // k], w, sizes, mxfp8=mxfp8, gemm=gemm, device=device)
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
    sequence_length: int | None = None,
) -> tuple[jax.Array, RoutingStats]:
    """One MoE feed-forward block on tokens ``x`` [T, d] (compute dtype) -> (output [T, d],
    RoutingStats). ``router`` [d, E]; ``shared`` holds the shared experts concatenated along
    their hidden axis (gate/up [d, S*hidden], down [S*hidden, d]), or None;
    ``sequence_length``: the tokens are sequences of that many (the capacity rule's unit;
    None: one sequence)."""
    learned = routing == "learned"
    router_in = x if learned else jax.lax.stop_gradient(x)
    router_w = router if learned else jax.lax.stop_gradient(router)
    # HIGHEST: float32 logits on every backend (TPU/GPU would otherwise use bf16/tf32
    # passes under bf16 compute), since a top-k choice is sensitive to their last bits.
    logits = jnp.dot(router_in.astype(jnp.float32), router_w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    experts, weights, probs = route(logits, moe, routing, key)
    out, computed = experts_fn(x, experts, weights, routed, sequence_length=sequence_length)
    if shared is not None:
        dtype = x.dtype
        # The dense MLP's layers (layers.py): the backward keeps g and u, not six [T, hidden].
        gate = linear(x, shared.gate.astype(dtype))
        out = out + swiglu_down(gate, linear(x, shared.up.astype(dtype)), shared.down.astype(dtype))
    return out, routing_stats(logits, probs, experts, computed)


def aux_loss(stats: RoutingStats, moe: MoESpec, routing: str = "learned") -> jax.Array:
    """The aux term of the training loss, lb_weight * lb + router_z_weight * router_z; zero
    for random/uniform routing, whose router is not trained."""
    return weighted_aux_loss(stats.load_balancing, stats.router_z, moe, routing)


def moe_metrics(stats: RoutingStats, ep_size: int) -> dict[str, float | int | list[int]]:
    """The MoE keys of a train line (the contract shared with the Torch trainer) from one
    step's stats: counts summed over MoE layers, per expert-rank load, losses unweighted."""
    counts = np.asarray(jax.device_get(stats.tokens_per_expert))
    return moe_train_metrics(counts, int(stats.dropped), float(stats.load_balancing), float(stats.router_z), ep_size)

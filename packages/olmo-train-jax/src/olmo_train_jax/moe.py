"""The mixture-of-experts feed-forward block of the JAX model (issue 8).

Maths (the contract shared with the Torch trainer and ``olmo_model.reference``):

- router logits ``r = x @ W_router`` in float32; probabilities ``p = softmax(r)`` (or
  ``sigmoid(r)``); each token takes the top-k of ``p`` (``top_k_lowest_index_on_ties`` puts the
  lower expert index first among equal values, as the reference's stable sort does); weights
  ``w = p[top-k]``, renormalised to sum 1 if ``normalize_top_k``;
- ``out = sum_k w_k SwiGLU_{e_k}(x) + sum_s SwiGLU_shared_s(x)``; the shared experts are
  stored concatenated along their hidden axis, which is the same sum computed as one SwiGLU;
- dropless: all T*k (token, slot) assignments are computed. They are sorted by expert (a
  stable argsort, token order kept inside a group), the group sizes counted on device, and
  each of the three SwiGLU matmuls is ONE grouped GEMM over the variable-size groups
  (``grouped_swiglu``): ``jax.lax.ragged_dot`` on TPU, JAX's Hopper Mosaic GPU kernels on
  H100/H200 (XLA:GPU lowers ragged_dot densely over all groups), and on CPU (dense there
  too) the rows padded into one-expert tiles with the matmuls batched over tiles;
- aux losses of a layer over the tokens it is given, which in the jitted global view is the
  whole global micro-batch whatever the device count: load balancing
  ``E * sum_e f_e P_e`` (f_e: share of the T*k assignments that went to e, P_e: mean
  probability of e) and router z-loss ``mean(logsumexp(r)^2)``.

Routing modes (a runtime knob, not in the spec): ``learned`` (above); ``random``: scores
are i.i.d. uniform numbers from the key of (seed, step, layer), the weights are the
softmax of the chosen k scores; ``uniform``: token t of the micro-batch goes to experts
``(t*k + j) mod E`` with weight 1/k. In both the router still runs, on stopped gradients,
so its aux losses are reported; their weight in the loss is 0 (``aux_loss``).

MXFP8 (``mxfp8=True`` on ``local_experts`` / ``expert_parallel``; the recipe's ``moe.mxfp8``):
the same emulation of OCP MX FP8 as the Torch block. Both operands of each routed-expert
matmul are rounded through e4m3 with one power-of-two (e8m0) scale per 32 contiguous
elements along the reduction axis (``mxfp8_quantize``), then multiplied in the working
dtype; gradients pass straight through to the unrounded tensors (the backward matmuls are
not quantised). The fast path is block-scaled FP8 hardware (B200/B300 tcgen05 MMA, or a TPU
generation with MX support) through XLA's scaled dot / ``jax.nn.scaled_dot_general`` with
float8_e4m3fn operands and float8_e8m0fnu scales; this machine (CPU) has no such unit, and
Hopper (H100/H200) has FP8 tensor cores but no MX block scaling.

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

from olmo_model import ModelSpec, MoESpec, UnknownDeviceError, resolve_device_kind
from olmo_model.moe import E4M3_MAX, MX_BLOCK, check_routing, moe_train_metrics
from olmo_model.moe import aux_loss as weighted_aux_loss
from olmo_run.recipe import RecipeError

from .layers import linear, swiglu_down

# XLA flushes float32 subnormals on CPU, so the smallest scale is the smallest normal
# 2^-126 rather than e8m0's 2^-127; only blocks with amax < 448 * 2^-126 notice.
_MIN_SCALE_EXPONENT = -126


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
    """Routing of one MoE layer (or, as ``OlmoModel``'s ``ModelOutput.moe``, of all MoE layers:
    losses averaged over layers, counts summed)."""

    load_balancing: jax.Array  # [] float32, E * sum_e f_e P_e
    router_z: jax.Array  # [] float32, mean over tokens of logsumexp(router logits)^2
    tokens_per_expert: jax.Array  # [E] int32, (token, slot) assignments per expert
    dropped: jax.Array  # [] int32, assignments not computed; 0 by construction (dropless)


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
    return experts.astype(jnp.int32), weights.astype(jnp.float32), probs


def routing_stats(logits: jax.Array, probs: jax.Array, experts: jax.Array, computed: jax.Array) -> MoEStats:
    """Aux losses and counts of one layer over the T tokens of ``logits`` [T, E]."""
    n_tokens, n_experts = probs.shape
    k = experts.shape[-1]
    counts = jnp.bincount(experts.reshape(-1), length=n_experts).astype(jnp.int32)
    # Counts carry no gradient (they are integers); the mean probabilities do.
    share = counts.astype(jnp.float32) / (n_tokens * k)
    load_balancing = n_experts * jnp.sum(share * jnp.mean(probs, axis=0))
    lse = softmax_and_logsumexp(logits)[1]
    return MoEStats(load_balancing, jnp.mean(lse * lse), counts, jnp.int32(n_tokens * k) - computed)


def sort_by_expert(experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order, group_sizes): ``order`` [A] lists the flat (token, slot) indices of
    ``experts`` [A] grouped by expert, token order kept inside a group; ``group_sizes`` [E]
    int32. Ids >= n_experts (padding) sort last and are not counted."""
    order = jnp.argsort(experts, stable=True)
    return order, jnp.bincount(experts, length=n_experts).astype(jnp.int32)


def mxfp8_quantize(x: jax.Array, axis: int = -1) -> jax.Array:
    """``x`` rounded through MXFP8 and back: blocks of 32 along ``axis`` share a scale
    2^ceil(log2(amax / 448)), values are cast to e4m3 and multiplied back by the scale.

    Rounding the scale exponent up keeps every scaled value inside e4m3's range, so nothing
    saturates: each element's error is at most 2^-4 of itself (3 mantissa bits, round to
    nearest) or, in e4m3's subnormal range, 2^-10 of the scale. Computes in float32 and
    returns x's dtype; a trailing partial block is padded with zeros."""
    moved = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
    n = moved.shape[-1]
    pad = (-n) % MX_BLOCK
    if pad:
        moved = jnp.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
    blocks = moved.reshape(*moved.shape[:-1], -1, MX_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    exponent = jnp.ceil(jnp.log2(jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / E4M3_MAX))
    # 2^e built from its float32 bits: exact (XLA:CPU's exp2 can land just under 2^-126, which
    # flushes to 0, and e8m0 has no zero: the cast gave NaN scales for all-zero blocks, e.g.
    # the padding rows of tiled_swiglu). The e8m0 round trip is exact; it keeps the scale honest.
    biased = (jnp.clip(exponent, _MIN_SCALE_EXPONENT, 127).astype(jnp.int32) + 127) << 23
    scale = jax.lax.bitcast_convert_type(biased, jnp.float32).astype(jnp.float8_e8m0fnu).astype(jnp.float32)
    q = (blocks / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    out = q.reshape(moved.shape)[..., :n]
    return jnp.moveaxis(out, -1, axis).astype(x.dtype)


def _mx(x: jax.Array, axis: int) -> jax.Array:
    # Forward value: the MXFP8-rounded tensor; gradient: identity to the original.
    return x + jax.lax.stop_gradient(mxfp8_quantize(x, axis) - x)


def grouped_swiglu(
    xs: jax.Array,
    w: ExpertWeights,
    group_sizes: jax.Array,
    *,
    mxfp8: bool = False,
    gemm: str = "auto",
    device: jax.Device | None = None,
) -> jax.Array:
    """Rows of ``xs`` [N, d], sorted into consecutive groups of ``group_sizes`` [E] rows, each
    through its own expert's SwiGLU -> [N, d]; rows past sum(group_sizes) come back zero.
    ``mxfp8``: both operands of each matmul rounded through MXFP8 along its reduction axis.

    ``gemm`` picks the grouped GEMM (``gemm_backend`` for ``auto``): ``ragged``, one
    ``jax.lax.ragged_dot`` per matmul (TPU); ``tiled``, ``tiled_swiglu`` (CPU: XLA:CPU lowers
    ragged_dot as a dense contraction over all E groups, cost ~ N x E; tiles cost ~ N + E x
    tile); ``mgpu``, JAX's Hopper grouped-GEMM kernels (XLA:GPU's ragged_dot is dense too).
    ``device``: the device ``auto`` chooses for (None: ``jax.devices()[0]``)."""
    dtype = xs.dtype
    gate, up, down = (t.astype(dtype) for t in w)
    if mxfp8:
        # Kernels are (in, out): the reduction axis is -2 of the weights, -1 of the rows.
        xs, gate, up, down = _mx(xs, -1), _mx(gate, -2), _mx(up, -2), _mx(down, -2)
    backend = gemm_backend(xs.dtype, xs.shape[1], gate.shape[2], device) if gemm == "auto" else gemm
    if backend == "tiled":
        return tiled_swiglu(xs, ExpertWeights(gate, up, down), group_sizes, mxfp8=mxfp8)
    if backend == "mgpu":
        return _swiglu(lambda a, b: mgpu_grouped_matmul(a, b, group_sizes), xs, ExpertWeights(gate, up, down), mxfp8)
    if backend != "ragged":
        raise ValueError(f"gemm='{gemm}' is unknown; use one of: {', '.join(GEMM_BACKENDS)}")
    return _swiglu(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), xs, ExpertWeights(gate, up, down), mxfp8)


# ---- grouped GEMM backends -------------------------------------------------------------------

GEMM_BACKENDS = ("auto", "ragged", "tiled", "mgpu")
# Tiles of JAX's Hopper grouped-GEMM kernels (jax.experimental.pallas.ops.gpu): the forward
# and d x use ragged_dot_mgpu, the weight gradient transposed_ragged_dot_mgpu. Widths must be
# multiples of MGPU_ALIGN (block_k of the first, block_m/block_n of the second).
MGPU_RAGGED = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
MGPU_TRANSPOSED = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=2, grid_block_n=1)
MGPU_ALIGN = 128


def gemm_backend(dtype, d_in: int, d_hidden: int, device: jax.Device | None = None) -> str:
    """``auto``'s choice for ``device``, a device of the mesh the step is compiled for (None:
    ``jax.devices()[0]``; compiled ahead of time on a CPU host, an abstract TPU or GPU device of
    the target, ``dry_run``). XLA:CPU lowers ragged_dot densely over all groups (cost ~ N x E): tiles.
    XLA:GPU does the same in jax 0.11 (measured on an H200: 8 -> 128 experts made one MoE
    block's step 15x slower), so Hopper GPUs run JAX's own Mosaic GPU grouped-GEMM kernels
    (bf16/fp16, widths multiples of 128); TPUs and other cases keep ragged_dot."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return "tiled"
    if mgpu_unsupported(dtype, d_in, d_hidden, device) is None:
        return "mgpu"
    return "ragged"


def mgpu_unsupported(dtype, d_in: int, d_hidden: int, device: jax.Device) -> str | None:
    """Why JAX's Mosaic GPU grouped-GEMM kernels cannot run the experts on ``device``; None if they can."""
    if device.platform != "gpu" or not _is_hopper(device):
        return f"its kernels need a Hopper GPU (the step is compiled for {device.device_kind})"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"its kernels take bf16 or fp16, not {jnp.dtype(dtype).name} (train.precision)"
    if d_in % MGPU_ALIGN or d_hidden % MGPU_ALIGN:
        return f"d_model={d_in} and moe.expert_hidden={d_hidden} must be multiples of {MGPU_ALIGN}"
    return None


def recipe_gemm(gemm: str, spec: ModelSpec, precision: str, device: jax.Device) -> str:
    """The grouped GEMM an MoE ``spec``'s layers run on ``device`` at ``precision`` for the
    recipe's ``jax.moe_gemm`` (``gemm_backend``'s choice for ``auto``)."""
    if gemm != "auto" or spec.moe is None:
        return gemm
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    return gemm_backend(dtype, spec.d_model, spec.moe.expert_hidden, device)


def check_gemm(gemm: str, spec: ModelSpec, precision: str, device: jax.Device) -> None:
    """Refuse ``jax.moe_gemm=mgpu`` where its kernels cannot run, in one line, before anything
    is written (the other backends run everywhere)."""
    if gemm != "mgpu" or spec.moe is None:
        return
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    why = mgpu_unsupported(dtype, spec.d_model, spec.moe.expert_hidden, device)
    if why is not None:
        raise RecipeError(f"jax.moe_gemm=mgpu: {why}; use jax.moe_gemm=auto")


# The Hopper kinds of olmo_model's peak table (compute capability 9.0).
HOPPER_KINDS = ("h100", "h200")


def _is_hopper(device: jax.Device) -> bool:
    """Whether ``device`` is a Hopper GPU: its compute capability where the device has one (a
    GPU this process runs on), else the kind its name resolves to (the abstract devices of an
    ahead-of-time GPU target, ``dry_run``, carry only their name)."""
    capability = getattr(device, "compute_capability", None)
    if capability is not None:
        return str(capability).startswith("9.")
    try:
        return resolve_device_kind(device.device_kind).kind in HOPPER_KINDS
    except UnknownDeviceError:
        return False


def _mgpu_kernels():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    def forward(x, w, sizes, transpose_rhs=False):
        # ignore: the block sizes are int keywords; mypy cannot see that none is transpose_rhs.
        return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, transpose_rhs=transpose_rhs, **MGPU_RAGGED)  # type: ignore[arg-type]

    def weight_grad(x, dy, sizes):
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy, group_sizes=sizes, **MGPU_TRANSPOSED)

    return forward, weight_grad


def reference_kernels():
    """The two kernels' maths in plain ``ragged_dot`` (any backend): what the Mosaic kernels
    compute, for tests of ``grouped_matmul_vjp`` where they cannot run."""

    def forward(x, w, sizes, transpose_rhs=False):
        return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, sizes)

    def weight_grad(x, dy, sizes):
        # [N, I], [N, O] -> [G, I, O]: per group, x_g^T dy_g (rows are the ragged contraction).
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
        )
        return jax.lax.ragged_dot_general(x, dy, sizes, ragged_dot_dimension_numbers=dims)

    return forward, weight_grad


def grouped_matmul_vjp(kernels):
    """rows [N, I] in consecutive groups of ``sizes`` [G], each times its own w[g] [I, O] ->
    [N, O], differentiable, from (forward, weight_grad) kernels: y = forward(x, w), dx =
    forward(dy, w^T) (``transpose_rhs``: the kernel reads w[g] transposed, nothing is copied),
    dw = weight_grad(x, dy). Rows past sum(sizes) belong to no group: their outputs and input
    gradients are zero (the kernels leave them unwritten)."""
    forward, weight_grad = kernels

    def mask(t, sizes):
        return jnp.where((jnp.arange(t.shape[0]) < jnp.sum(sizes))[:, None], t, jnp.zeros((), t.dtype))

    @jax.custom_vjp
    def matmul(x, w, sizes):
        return mask(forward(x, w, sizes), sizes)

    def fwd(x, w, sizes):
        return matmul(x, w, sizes), (x, w, sizes)

    def bwd(res, dy):
        x, w, sizes = res
        dy = mask(dy, sizes)
        dx = mask(forward(dy, w, sizes, transpose_rhs=True), sizes)
        dw = weight_grad(x, dy, sizes).astype(w.dtype)
        return dx, dw, None

    matmul.defvjp(fwd, bwd)
    return matmul


def mgpu_grouped_matmul(x, w, sizes):
    """``ragged_dot(x, w, sizes)`` with JAX's Hopper Mosaic GPU kernels, forward and backward."""
    return grouped_matmul_vjp(_mgpu_kernels())(x, w, sizes.astype(jnp.int32))


def _swiglu(matmul, x: jax.Array, w: ExpertWeights, mxfp8: bool) -> jax.Array:
    """silu(x @ gate) * (x @ up) @ down with ``matmul`` doing the grouping (ragged or tiled);
    ``mxfp8`` also rounds the hidden activations, the down matmul's left operand."""
    hidden = jax.nn.silu(matmul(x, w.gate)) * matmul(x, w.up)
    if mxfp8:
        hidden = _mx(hidden, -1)
    return matmul(hidden, w.down)


# Rows per tile of ``tiled_swiglu``. One constant, not a function of the row or expert count:
# the per-tile matmul then has the same shape on every layout (one device, expert-parallel
# shards), so each row rounds the same way; an adaptive tile (128 rows at 8 experts) was ~10%
# faster but moved the first near-tie routing flip between 1 and 4 devices from step 5 to 3.
# Padding costs up to E x 31 rows (64 experts, 8192 rows: +24%).
TILE = 32


def tiled_swiglu(
    xs: jax.Array, w: ExpertWeights, group_sizes: jax.Array, *, tile: int | None = None, mxfp8: bool = False
) -> jax.Array:
    """``grouped_swiglu`` as tiles (the MegaBlocks layout, in plain XLA): each expert's rows
    are padded to a multiple of ``tile`` so that every tile belongs to one expert; the tiles'
    expert weights are gathered and the three matmuls are batched over tiles. Static shapes:
    N + E x tile padded rows at most (rounded up to tiles), whatever the routing. ``w`` is
    already in the rows' dtype (and MXFP8-rounded when ``mxfp8``)."""
    n, _ = xs.shape
    n_groups = w.gate.shape[0]
    tile = TILE if tile is None else tile
    n_tiles = -(-n // tile) + n_groups
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded = -(-sizes // tile) * tile
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    rows = jnp.arange(n, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), n_groups - 1)
    valid = rows < ends[-1]
    # Row r of group g goes to padded row padded_starts[g] + (r - starts[g]); rows past the
    # groups go nowhere (index n_tiles * tile is dropped).
    dest = jnp.where(valid, padded_starts[group] + rows - starts[group], n_tiles * tile)
    x_tiles = jnp.zeros((n_tiles * tile, xs.shape[1]), xs.dtype).at[dest].set(xs, mode="drop")
    x_tiles = x_tiles.reshape(n_tiles, tile, -1)
    # Tiles past the last group compute on zero rows with the last expert (their rows are dropped).
    tile_group = jnp.minimum(
        jnp.searchsorted(padded_ends, jnp.arange(n_tiles, dtype=jnp.int32) * tile, side="right"), n_groups - 1
    )

    def tiles_matmul(a, weight):
        return jnp.einsum("tri,tio->tro", a, weight[tile_group])

    out = _swiglu(tiles_matmul, x_tiles, w, mxfp8).reshape(n_tiles * tile, -1)
    return jnp.where(valid[:, None], out[jnp.minimum(dest, n_tiles * tile - 1)], 0).astype(xs.dtype)


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
    mxfp8: bool = False,
    gemm: str = "auto",
    device: jax.Device | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The routed part with every expert on this device (an ``ExpertsFn`` as it stands;
    ``functools.partial(local_experts, mxfp8=True)`` for the MXFP8 emulation, ``gemm=`` to
    force a grouped GEMM backend, ``device=`` the device ``auto`` chooses it for)."""
    n_experts = w.gate.shape[0]
    k = experts.shape[-1]
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
) -> tuple[jax.Array, MoEStats]:
    """One MoE feed-forward block on tokens ``x`` [T, d] (compute dtype) -> (output [T, d],
    MoEStats). ``router`` [d, E]; ``shared`` holds the shared experts concatenated along
    their hidden axis (gate/up [d, S*hidden], down [S*hidden, d]), or None."""
    learned = routing == "learned"
    router_in = x if learned else jax.lax.stop_gradient(x)
    router_w = router if learned else jax.lax.stop_gradient(router)
    # HIGHEST: float32 logits on every backend (TPU/GPU would otherwise use bf16/tf32
    # passes under bf16 compute), since a top-k choice is sensitive to their last bits.
    logits = jnp.dot(router_in.astype(jnp.float32), router_w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    experts, weights, probs = route(logits, moe, routing, key)
    out, computed = experts_fn(x, experts, weights, routed)
    if shared is not None:
        dtype = x.dtype
        # The dense MLP's layers (layers.py): the backward keeps g and u, not six [T, hidden].
        gate = linear(x, shared.gate.astype(dtype))
        out = out + swiglu_down(gate, linear(x, shared.up.astype(dtype)), shared.down.astype(dtype))
    return out, routing_stats(logits, probs, experts, computed)


def aux_loss(stats: MoEStats, moe: MoESpec, routing: str = "learned") -> jax.Array:
    """The aux term of the training loss, lb_weight * lb + router_z_weight * router_z; zero
    for random/uniform routing, whose router is not trained."""
    return weighted_aux_loss(stats.load_balancing, stats.router_z, moe, routing)


def moe_metrics(stats: MoEStats, ep_size: int) -> dict[str, float | int | list[int]]:
    """The MoE keys of a train line (the contract shared with the Torch trainer) from one
    step's stats: counts summed over MoE layers, per expert-rank load, losses unweighted."""
    counts = np.asarray(jax.device_get(stats.tokens_per_expert))
    return moe_train_metrics(counts, int(stats.dropped), float(stats.load_balancing), float(stats.router_z), ep_size)

"""The routed experts' SwiGLU as grouped GEMMs: rows sorted into consecutive groups of one
expert each, every matmul one GEMM over the variable-size groups (``grouped_swiglu``).

Backends (the recipe's ``jax.moe_gemm``; ``auto`` picks by the device the step is compiled for,
``gemm_backend``): ``ragged``, ``jax.lax.ragged_dot`` (TPU); ``mgpu``, JAX's Hopper Mosaic GPU
kernels on H100/H200 (XLA:GPU lowers ragged_dot densely over all groups), with their own VJP
(``grouped_matmul_vjp``); ``tiled``, the rows padded into one-expert tiles and the matmuls batched
over tiles (``tiled_swiglu``; XLA:CPU lowers ragged_dot densely too).

MXFP8 (``mxfp8=True`` on ``local_experts`` / ``expert_parallel``; the recipe's ``moe.mxfp8``):
the same emulation of OCP MX FP8 as the Torch block. Both operands of each routed-expert
matmul are rounded through e4m3 with one power-of-two (e8m0) scale per 32 contiguous
elements along the reduction axis (``mxfp8_quantize``), then multiplied in the working
dtype; gradients pass straight through to the unrounded tensors (the backward matmuls are
not quantised). The fast path is block-scaled FP8 hardware (B200/B300 tcgen05 MMA, or a TPU
generation with MX support) through XLA's scaled dot / ``jax.nn.scaled_dot_general`` with
float8_e4m3fn operands and float8_e8m0fnu scales; this machine (CPU) has no such unit, and
Hopper (H100/H200) has FP8 tensor cores but no MX block scaling.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmo_model import ModelSpec, UnknownDeviceError, resolve_device_kind
from olmo_model.moe import E4M3_MAX, MX_BLOCK
from olmo_run.recipe import RecipeError

# XLA flushes float32 subnormals on CPU, so the smallest scale is the smallest normal
# 2^-126 rather than e8m0's 2^-127; only blocks with amax < 448 * 2^-126 notice.
_MIN_SCALE_EXPONENT = -126


class ExpertWeights(NamedTuple):
    """Routed experts stacked on a leading expert axis, (in, out) kernels: gate/up
    [E, d, hidden], down [E, hidden, d]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


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
    xs, (gate, up, down) = _operands(xs, w, mxfp8)
    backend = gemm_backend(xs.dtype, xs.shape[1], gate.shape[2], device) if gemm == "auto" else gemm
    if backend == "tiled":
        return tiled_swiglu(xs, ExpertWeights(gate, up, down), group_sizes, mxfp8=mxfp8)
    if backend == "mgpu":
        return _swiglu(lambda a, b: mgpu_grouped_matmul(a, b, group_sizes), xs, ExpertWeights(gate, up, down), mxfp8)
    if backend != "ragged":
        raise ValueError(f"gemm='{gemm}' is unknown; use one of: {', '.join(GEMM_BACKENDS)}")
    return _swiglu(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), xs, ExpertWeights(gate, up, down), mxfp8)


def _operands(xs: jax.Array, w: ExpertWeights, mxfp8: bool) -> tuple[jax.Array, ExpertWeights]:
    """The rows and the weights in the rows' dtype, both MXFP8-rounded when ``mxfp8``."""
    gate, up, down = (t.astype(xs.dtype) for t in w)
    if mxfp8:
        # Kernels are (in, out): the reduction axis is -2 of the weights, -1 of the rows.
        xs, gate, up, down = _mx(xs, -1), _mx(gate, -2), _mx(up, -2), _mx(down, -2)
    return xs, ExpertWeights(gate, up, down)


def batched_swiglu(xs: jax.Array, w: ExpertWeights, *, mxfp8: bool = False) -> jax.Array:
    """Equal groups: ``xs`` [E, rows, d], expert e's rows in ``xs[e]`` (the capacity layout,
    ``capacity``) -> SwiGLU outputs [E, rows, d], three matmuls batched over experts (no ragged
    GEMM: every group has the same static size). Zero rows (empty capacity slots) give zero."""
    xs, weights = _operands(xs, w, mxfp8)
    return _swiglu(lambda a, b: jnp.einsum("eri,eio->ero", a, b), xs, weights, mxfp8)


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

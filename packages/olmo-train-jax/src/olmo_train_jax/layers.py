"""Dense layers of the JAX model with their own backward passes, shared by the dense MLP
(``model``) and the MoE block's shared experts (``moe``): what each backward keeps is
stated in its docstring.

``flat`` (default True): a backward contracts the weight gradient over the tokens flattened to
one axis, which XLA:CPU runs fastest. A batch whose sequence axis is split over devices (context
parallelism) cannot be flattened in place: row-major [B, S] -> [B S] is not a contiguous split
when S is split and B holds more than one row per device, so XLA would all-gather the activations
first; with ``flat=False`` the same sums contract over the leading axes as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .precision import matmul_precision


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def linear(x: jax.Array, w: jax.Array, flat: bool = True) -> jax.Array:
    """x [..., d_in] @ w [d_in, d_out], with a backward that contracts the weight gradient over
    the flattened tokens: d w = x2^T d y2 ([tokens, d_in], [tokens, d_out]).

    Autodiff of ``x @ w`` contracts over (batch, seq) and XLA:CPU then materialised the
    transposed [d_out, tokens] cotangent, fused into the elementwise op that produced it
    (SwiGLU's backward: ~50 ms per [768, 4096] copy at olmo3-30m); with one token axis it
    transposes only the thin operand. Same maths and FLOPs; remat policies see the same dot."""
    return _linear_fwd(x, w, flat)[0]


def _linear_fwd(x, w, flat=True):
    return jnp.matmul(x, w, precision=matmul_precision(x.dtype)), (x, w)


def _linear_bwd(flat, residuals, dy):
    x, w = residuals
    precision = matmul_precision(x.dtype)
    if flat:
        dw = jnp.einsum("td,tf->df", x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), precision=precision)
    else:
        dw = jnp.einsum("...d,...f->df", x, dy, precision=precision)
    return jnp.matmul(dy, w.T, precision=precision), dw


linear.defvjp(_linear_fwd, _linear_bwd)


def _swiglu_hidden(g: jax.Array, u: jax.Array) -> jax.Array:
    return jax.nn.silu(g) * u


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def swiglu_down(g: jax.Array, u: jax.Array, w: jax.Array, flat: bool = True) -> jax.Array:
    """(silu(g) * u) @ w: the SwiGLU MLP after its gate and up projections.

    Its backward keeps g and u (and w) only and recomputes the hidden product: autodiff kept
    six [tokens, mlp_hidden] tensors per layer (g, u, silu's intermediates, the product) where
    two suffice. The arithmetic is autodiff's own (``jax.vjp`` of silu(g) * u for dg, du; the
    down projection as ``linear``: dh = dy w^T, dw over flattened tokens), so gradients equal
    the plain composition's to float32 rounding (a first version with its own d silu formula
    failed the trainer's 1- vs 8-device agreement test, 1e-5 per step)."""
    return _swiglu_down_fwd(g, u, w, flat)[0]


def _swiglu_down_fwd(g, u, w, flat=True):
    return jnp.matmul(_swiglu_hidden(g, u), w, precision=matmul_precision(g.dtype)), (g, u, w)


def _swiglu_down_bwd(flat, residuals, dy):
    g, u, w = residuals
    h, hidden_vjp = jax.vjp(_swiglu_hidden, g, u)
    dh, dw = _linear_bwd(flat, (h, w), dy)
    dg, du = hidden_vjp(dh)
    return dg, du, dw


swiglu_down.defvjp(_swiglu_down_fwd, _swiglu_down_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, flat: bool = True) -> jax.Array:
    """RMSNorm over the last axis in float32, returned in x's dtype (as transformers' Olmo3RMSNorm).

    Its backward keeps x (in x's dtype) and the float32 1/rms per row, nothing else: autodiff
    kept two float32 copies of x's size (x upcast and x / rms), 256 MiB per olmo3-1b layer (its
    four norms) at 4096 tokens with remat none. With xh = x / rms and g = weight * dy (float32):
    dx = (g - xh mean(g xh)) / rms, d weight = sum over rows of dy xh."""
    return _rms_norm_fwd(x, weight, eps, flat)[0]


def _rms_norm_fwd(x, weight, eps, flat=True):
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * (xf * inv)).astype(x.dtype), (x, weight, inv)


def _rms_norm_bwd(eps, flat, residuals, dy):
    x, weight, inv = residuals
    xh = x.astype(jnp.float32) * inv
    dyf = dy.astype(jnp.float32)
    g = weight.astype(jnp.float32) * dyf
    dx = (g - xh * jnp.mean(g * xh, axis=-1, keepdims=True)) * inv
    if flat:
        dw = jnp.sum((dyf * xh).reshape(-1, x.shape[-1]), axis=0).reshape(weight.shape)
    else:
        dw = jnp.sum(dyf * xh, axis=tuple(range(x.ndim - 1))).reshape(weight.shape)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


# The same functions by plain autodiff (what the custom VJPs replace): references for the test
# of their gradients and for bench/memory_step.py --plain.
def plain_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def plain_swiglu_down(g: jax.Array, u: jax.Array, w: jax.Array) -> jax.Array:
    return linear(_swiglu_hidden(g, u), w)

"""The MXFP8 emulation of the JAX expert GEMMs (``grouped_gemm.mxfp8_quantize``, ``grouped_swiglu(mxfp8=True)``)
and the layout-invariant reductions of the router (``moe.row_sum``), CPU, float32. The same
numbers from the torch trainer's emulation: tests/test_moe_twins.py (repository root).

    uv run --frozen pytest packages/olmo-train-jax/tests/test_moe_mxfp8.py -n 0 -q
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from olmo_train_jax.grouped_gemm import ExpertWeights, grouped_swiglu, mxfp8_quantize
from olmo_train_jax.moe import row_sum


def _e4m3_round(y: np.ndarray) -> np.ndarray:
    """Round to the nearest float8 e4m3fn number (ties to even), derived by hand: 3 mantissa
    bits, normal range from 2^-6, subnormal step 2^-9; |y| <= 448 here (no saturation)."""
    y = y.astype(np.float64)
    exponent = np.floor(np.log2(np.maximum(np.abs(y), 2.0**-6)))
    step = 2.0 ** (exponent - 3)
    return np.round(y / step) * step  # np.round rounds halves to even


def test_quantize_matches_a_hand_derived_reference():
    rng = np.random.default_rng(2)
    t = (rng.standard_normal((8, 96)) * np.logspace(-3, 3, 8)[:, None]).astype(np.float32)
    q = np.asarray(mxfp8_quantize(jnp.asarray(t), axis=-1), np.float64)
    for row in range(8):
        for b in range(3):
            blk = t[row, 32 * b : 32 * b + 32].astype(np.float64)
            scale = 2.0 ** math.ceil(math.log2(np.abs(blk).max() / 448.0))
            want = _e4m3_round(blk / scale) * scale
            np.testing.assert_array_equal(q[row, 32 * b : 32 * b + 32], want)
            # Half an e4m3 step: 2^-4 relative, or 2^-10 * scale in e4m3's subnormals.
            bound = np.maximum(np.abs(blk) * 2.0**-4, 2.0**-10 * scale)
            assert (np.abs(q[row, 32 * b : 32 * b + 32] - blk) <= bound).all()
    # Hand-built: amax 1000 -> scale 2^ceil(log2(1000/448)) = 4; 1000/4 = 250 lies between the
    # e4m3 neighbours 240 and 256, nearer 256 -> 1024; 3/4 = 0.75 is exact.
    blk = np.zeros(32, np.float32)
    blk[0], blk[1] = 1000.0, 3.0
    assert np.asarray(mxfp8_quantize(jnp.asarray(blk)))[:2].tolist() == [1024.0, 3.0]


def test_quantize_along_another_axis_and_a_partial_block():
    rng = np.random.default_rng(5)
    t = rng.standard_normal((40, 3)).astype(np.float32)  # 40 = one block of 32 + 8 padded
    along0 = np.asarray(mxfp8_quantize(jnp.asarray(t), axis=0))
    np.testing.assert_array_equal(along0, np.asarray(mxfp8_quantize(jnp.asarray(t.T), axis=-1)).T)
    tail = t[32:, 0].astype(np.float64)
    scale = 2.0 ** math.ceil(math.log2(np.abs(tail).max() / 448.0))
    np.testing.assert_array_equal(along0[32:, 0], _e4m3_round(tail / scale) * scale)


def test_mxfp8_matmul_error_within_the_e4m3_bound_and_against_bf16():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((256, 512)), rng.standard_normal((512, 384))
    exact = x @ w
    xq = np.asarray(mxfp8_quantize(jnp.asarray(x, jnp.float32), -1), np.float64)
    wq = np.asarray(mxfp8_quantize(jnp.asarray(w, jnp.float32), 0), np.float64)  # reduce over w's rows
    mx = xq @ wq
    bf16 = np.asarray(
        jnp.dot(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), preferred_element_type=jnp.float32),
        np.float64,
    )

    def rel(y):
        return float(np.linalg.norm(y - exact) / np.linalg.norm(exact))

    # Per output |error| <= sum_k (ex |w| + |x| ew + ex ew), e <= 2^-4 relative per operand.
    e = 2.0**-4
    assert (np.abs(mx - exact) <= (2 * e + e * e) * (np.abs(x) @ np.abs(w)) + 1e-3).all()
    # RMS rounding error ~2^-4/sqrt(3) per operand, in quadrature: 0.03-0.05; bf16 ~0.003.
    assert 0.01 < rel(mx) < 0.06
    assert rel(bf16) < 0.005
    assert 4 < rel(mx) / rel(bf16) < 40


def test_mxfp8_grouped_swiglu_close_to_fp32_with_straight_through_gradients():
    rng = np.random.default_rng(4)
    n_experts, d, hidden = 4, 64, 64
    xs = jnp.asarray(rng.standard_normal((96, d)), jnp.float32)
    w = ExpertWeights(
        *(
            jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32)
            for s in ((n_experts, d, hidden), (n_experts, d, hidden), (n_experts, hidden, d))
        )
    )
    sizes = jnp.asarray([30, 0, 50, 16], jnp.int32)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(grouped_swiglu(xs, w, sizes))
        got = np.asarray(grouped_swiglu(xs, w, sizes, mxfp8=True))
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        # Four rounded operands (x, gate/up, hidden, down) of ~2.4% RMS each.
        assert 0.01 < rel < 0.08

        def loss(w, mxfp8):
            return jnp.sum(grouped_swiglu(xs, w, sizes, mxfp8=mxfp8) ** 2)

        g_mx, g_ref = jax.grad(loss)(w, True), jax.grad(loss)(w, False)
    for a, b in zip(g_mx, g_ref):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a[1]).max() == 0  # the empty group gets no gradient
        # Straight-through: the gradient of the rounded forward, close to the exact one.
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.15


def test_row_sum_is_a_fixed_pairwise_tree():
    x = np.array([[1e8, 1.0, -1e8, 1.0, 3.0]], np.float32)
    # ((1e8 + 1) + (-1e8 + 1)) + (3 + 0) in float32: 1e8 + 1 rounds to 1e8, so 0 + 3.
    assert float(row_sum(jnp.asarray(x))[0]) == 3.0
    rng = np.random.default_rng(0)
    v = rng.standard_normal((4096, 8)).astype(np.float32)
    want = ((v[:, 0] + v[:, 1]) + (v[:, 2] + v[:, 3])) + ((v[:, 4] + v[:, 5]) + (v[:, 6] + v[:, 7]))
    f = jax.jit(row_sum)
    # The same bits for every row count (jnp.sum over 8 does not give that on XLA:CPU).
    for rows in (256, 1024, 4096):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(v[:rows]))), want[:rows])

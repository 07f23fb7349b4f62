"""The JAX MoE block's grouped GEMM backends (grouped_gemm.grouped_swiglu's ``gemm``).

``grouped_matmul_vjp`` wires a forward kernel and a weight-gradient kernel into a
differentiable grouped matmul (dx = forward(dy, w^T), dw = weight_grad(x, dy)). Its wiring is
checked here on CPU with ``reference_kernels`` (the same maths in ``ragged_dot``) against JAX's
own autodiff of ``jax.lax.ragged_dot``: outputs and both gradients, with an empty group and
rows past the last group. The Mosaic GPU kernels themselves need a Hopper GPU: the last test
compares them with ``ragged_dot`` in bf16 and runs only there (the device benchmark script,
tools/bench/gpu/run_h200.sh, runs this file on an H200).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_train_jax import grouped_gemm


def _problem(seed: int, sizes, n_rows: int, d_in=128, d_out=256, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n_rows, d_in)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), d_in, d_out)) / np.sqrt(d_in), dtype)
    dy = jnp.asarray(rng.standard_normal((n_rows, d_out)), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32), dy


def _value_and_grads(matmul, x, w, sizes, dy):
    def f(x, w):
        y = matmul(x, w, sizes)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), (dx, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)
    return y, dx, dw


@pytest.mark.parametrize("sizes,n_rows", [([5, 0, 17, 10], 32), ([3, 9, 0, 4], 20)])
def test_vjp_wiring_matches_ragged_dot_autodiff(sizes, n_rows):
    x, w, sizes, dy = _problem(0, sizes, n_rows)
    ours = _value_and_grads(grouped_gemm.grouped_matmul_vjp(grouped_gemm.reference_kernels()), x, w, sizes, dy)
    ref = _value_and_grads(jax.lax.ragged_dot, x, w, sizes, dy)
    for name, a, b in zip(("y", "dx", "dw"), ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
    total = int(np.sum(np.asarray(sizes)))
    # Rows past the groups: zero output and zero input gradient (the second case has 4 of them).
    assert not np.asarray(ours[0])[total:].any() and not np.asarray(ours[1])[total:].any()


def test_auto_backend_on_cpu_is_tiled():
    assert jax.default_backend() != "cpu" or grouped_gemm.gemm_backend(jnp.bfloat16, 2048, 1024) == "tiled"


def test_unknown_backend_fails():
    x, w, sizes, _ = _problem(0, [4, 4], 8)
    ew = grouped_gemm.ExpertWeights(w, w, jnp.swapaxes(w, 1, 2))
    with pytest.raises(ValueError, match="gemm='cutlass' is unknown"):
        grouped_gemm.grouped_swiglu(x, ew, sizes, gemm="cutlass")


def _hopper() -> bool:
    return jax.default_backend() == "gpu" and grouped_gemm._is_hopper(jax.devices()[0])


@pytest.mark.skipif(not _hopper(), reason="JAX's Mosaic GPU grouped-GEMM kernels need a Hopper GPU")
def test_mgpu_kernels_match_ragged_dot_on_hopper():
    # The MoE shape family of the benchmark, with an empty group and uneven groups.
    sizes = [700, 0, 1500, 33, 4000, 1959, 96, 1904]
    x, w, sizes, dy = _problem(1, sizes, 10192, d_in=512, d_out=256, dtype=jnp.bfloat16)
    ours = jax.jit(lambda x, w, s, dy: _value_and_grads(grouped_gemm.mgpu_grouped_matmul, x, w, s, dy))(x, w, sizes, dy)
    x32, w32, dy32 = (t.astype(jnp.float32) for t in (x, w, dy))
    ref = jax.jit(lambda x, w, s, dy: _value_and_grads(jax.lax.ragged_dot, x, w, s, dy))(x32, w32, sizes, dy32)
    for name, a, b in zip(("y", "dx", "dw"), ours, ref):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        print(f"mgpu {name}: relative error {rel:.2e} against float32 ragged_dot")
        assert np.isfinite(a).all() and rel < 1e-2, (name, rel)  # bf16 operands, f32 accumulation

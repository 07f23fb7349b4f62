"""``jax.attention``: which kernel a layer's attention runs, and cuDNN's fused path against ours.

On CPU (CI): ``auto`` must run the XLA path (bitwise the same as ``xla``), ``cudnn`` must refuse
with a message naming the knob, and an unknown value must fail. On a GPU (the device benchmark
script runs this file there, tools/bench/gpu/run_h200.sh): cuDNN's flash attention in bf16 against
the XLA path in float32 on the same bf16 inputs, forward and gradients, global and sliding
layers, GQA; cuDNN's error must be of bf16 size and no worse than twice the XLA path's own bf16
error against that reference. The GPU tests are skipped where JAX has no GPU backend: CI has
none, and nothing here can emulate cuDNN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_train_jax.causal_attention import attention

ON_GPU = jax.default_backend() == "gpu"


def _qkv(seed: int, b=2, s=512, n=8, k=2, h=64, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s, n, h), dtype=np.float32)
    kk = rng.standard_normal((b, s, k, h), dtype=np.float32)
    v = rng.standard_normal((b, s, k, h), dtype=np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, kk, v))


def test_auto_is_xla_off_gpu():
    if ON_GPU:
        pytest.skip("on a GPU auto picks cuDNN for bf16; this checks the CPU choice")
    q, k, v = _qkv(0, s=256)
    for window in (None, 64):
        a = attention(q, k, v, window, None, "auto")
        x = attention(q, k, v, window, None, "xla")
        np.testing.assert_array_equal(np.asarray(a), np.asarray(x))


def test_cudnn_refuses_clearly_off_gpu():
    if ON_GPU:
        pytest.skip("cuDNN runs here")
    q, k, v = _qkv(0, s=128, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"jax.attention=cudnn cannot run here: the backend is cpu"):
        attention(q, k, v, None, None, "cudnn")


def test_unknown_impl_fails():
    q, k, v = _qkv(0, s=64)
    with pytest.raises(ValueError, match=r"jax.attention='flash' is unknown"):
        attention(q, k, v, None, None, "flash")


def test_recipe_rejects_unknown_attention():
    from olmo_run.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="attention"):
        load_recipe(None, ["--jax.attention=flash"])


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.skipif(not ON_GPU, reason="cuDNN fused attention needs a GPU backend (device benchmark runs this)")
@pytest.mark.parametrize("window", [None, 256])
def test_cudnn_matches_xla_on_gpu(window):
    q, k, v = _qkv(1, s=1024, dtype=jnp.bfloat16)
    do = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape, dtype=np.float32), jnp.bfloat16)

    def run(impl, dtype):
        def f(q, k, v):
            out = attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), window, None, impl)
            return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [out, *grads]

    reference = run("xla", jnp.float32)  # same bf16 inputs, float32 arithmetic
    cudnn = run("cudnn", jnp.bfloat16)
    xla_bf16 = run("xla", jnp.bfloat16)
    for name, c, x, r in zip(("out", "dq", "dk", "dv"), cudnn, xla_bf16, reference):
        assert np.isfinite(np.asarray(c, np.float32)).all(), name
        err_c, err_x = _rel(c, r), _rel(x, r)
        print(f"window={window} {name}: cudnn {err_c:.2e}, xla bf16 {err_x:.2e}")
        # bf16 operands land between 1e-3 and 1e-2 against a float32 result; cuDNN keeps its
        # softmax statistics in float32 as our XLA path does, so it must be about as close.
        assert err_c < 2e-2, (name, err_c)
        assert err_c <= 2 * err_x + 1e-3, (name, err_c, err_x)

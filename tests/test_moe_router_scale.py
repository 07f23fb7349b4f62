"""OLMo-core 3's router scale (moe.restore_weight_scale: the renormalised top-k weights times k,
summing to k) in both trainers' routing against the float64 numpy reference, and tiny-olmoe3's
architecture with heads wider than d_model / n_heads through both trainers' whole model.

    uv run --frozen pytest tests/test_moe_router_scale.py -n 0 -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from olmo_model import get_preset, reference
from olmo_train_jax import model_from_hf as jax_model_from_hf
from olmo_train_jax.moe import route as jax_route
from olmo_train_torch import model_from_hf as torch_model_from_hf
from olmo_train_torch.moe import route as torch_route

TINY = get_preset("tiny-olmoe3")  # 8 experts, top-4, renormalised and restored
# fp32 softmax and renormalisation of O(1) logits are a few ulp (6e-8 relative) off float64;
# weights are at most k = 4, so 1e-6 is over 4 ulp of the largest with room to spare.
WEIGHT_TOL = 1e-6


def _by_expert(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's (expert, weight) pairs in ascending expert order (the trainers order the k
    slots differently: torch by expert index, JAX and the reference best first)."""
    order = np.argsort(experts, axis=-1)
    return np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("restore", [True, False])
def test_learned_routing_matches_the_reference(restore):
    assert TINY.moe is not None
    moe = TINY.moe.model_copy(update={"restore_weight_scale": restore})
    logits = np.random.default_rng(0).standard_normal((64, moe.n_experts)).astype(np.float32)
    want_experts, want_weights = _by_expert(*reference.route(moe, logits.astype(np.float64))[:2])
    np.testing.assert_allclose(want_weights.sum(-1), moe.top_k if restore else 1.0, rtol=1e-14)

    routing, _ = torch_route(torch.from_numpy(logits), moe)
    experts, weights, _ = jax_route(jnp.asarray(logits), moe)
    for got in (
        _by_expert(routing.experts.numpy(), routing.weights.numpy()),
        _by_expert(np.asarray(experts), np.asarray(weights)),
    ):
        np.testing.assert_array_equal(got[0], want_experts)
        np.testing.assert_allclose(got[1], want_weights, atol=WEIGHT_TOL, rtol=0)


def test_random_and_uniform_weights_sum_to_top_k():
    """The benchmark modes scale their weights as the learned router does (OLMo-core multiplies
    whatever weights its router made by k)."""
    moe = TINY.moe
    assert moe is not None
    logits = np.zeros((32, moe.n_experts), np.float32)
    gen = torch.Generator().manual_seed(0)
    sums = [
        torch_route(torch.from_numpy(logits), moe, "random", gen)[0].weights.sum(-1).numpy(),
        torch_route(torch.from_numpy(logits), moe, "uniform")[0].weights.sum(-1).numpy(),
        np.asarray(jax_route(jnp.asarray(logits), moe, "random", jax.random.key(0))[1].sum(-1)),
        np.asarray(jax_route(jnp.asarray(logits), moe, "uniform")[1].sum(-1)),
    ]
    for s in sums:
        np.testing.assert_allclose(s, moe.top_k, rtol=1e-6)


def test_wide_heads_and_restored_router_through_both_models():
    """tiny-olmoe3, two layers, both MoE, with heads of 24 (q width 96 at d_model 64, as OLMoE3-dev-
    s001 and larger have n_heads * 128 != d_model): per-head QK-norm, GQA 4:1 and the restored
    router in both trainers' whole model against the float64 reference. Tolerance 1e-4 on logits
    of size ~1: fp32 through two blocks and a 4096-wide head (the trainers' MoE tests' bound)."""
    assert TINY.moe is not None
    spec = TINY.replace(n_layers=2, head_dim=24, moe={**TINY.moe.model_dump(), "layers": None})
    params = reference.init_params(spec, seed=4)
    ids = np.random.default_rng(5).integers(0, spec.vocab_size, size=(2, 24))
    want = reference.forward(spec, params, ids)
    with torch.no_grad():
        torch_logits = torch_model_from_hf(spec, params).eval()(torch.from_numpy(ids)).logits.double().numpy()
    with jax.default_matmul_precision("highest"):
        jax_logits = np.asarray(jax_model_from_hf(spec, params)(jnp.asarray(ids, jnp.int32)).logits, np.float64)
    assert np.abs(torch_logits - want).max() <= 1e-4
    assert np.abs(jax_logits - want).max() <= 1e-4
    # The restored scale matters at this size: the same weights without it give other logits.
    unscaled = spec.replace(moe={**spec.moe.model_dump(), "restore_weight_scale": False})
    assert np.abs(reference.forward(unscaled, params, ids) - want).max() > 1e-2

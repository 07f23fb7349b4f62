"""The two trainers' MoE pieces against each other on the same inputs (CPU, float32): the JAX
MoE block and the torch one on the same weights (and both against the float64 numpy reference),
and the MXFP8 emulation of the expert GEMMs giving the same numbers in both. Each trainer's own
tests hold its pieces to the reference; these hold the twins to each other.

    uv run --frozen pytest tests/test_moe_twins.py -n 0 -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from olmo_model import get_preset, reference
from olmo_train_jax import model_from_hf
from olmo_train_jax.grouped_gemm import ExpertWeights
from olmo_train_jax.grouped_gemm import mxfp8_quantize as jax_mxfp8_quantize
from olmo_train_jax.moe import moe_block
from olmo_train_torch.grouped_gemm import mxfp8_quantize as torch_mxfp8_quantize
from olmo_train_torch.moe import MoE as TorchMoE

VARIANT = get_preset("tiny-moe-sigmoid")  # sigmoid router, renormalised top-k, two shared experts


def _numpy_layer(spec, params, layer):
    pre = f"model.layers.{layer}.mlp."
    return {k[len(pre) :]: v for k, v in params.items() if k.startswith(pre)}


def test_block_matches_torch_moe_block():
    """The JAX block and the torch trainer's block (olmo_train_torch.moe.MoE) on the same weights."""
    spec = VARIANT
    moe = spec.moe
    params = reference.init_params(spec, seed=5)
    layer = _numpy_layer(spec, params, 0)
    x = np.random.default_rng(6).standard_normal((96, spec.d_model)).astype(np.float32)

    block = TorchMoE(moe, spec.d_model, layer=0)
    with torch.no_grad():
        block.router.weight.copy_(torch.from_numpy(layer["gate.weight"]))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = np.stack([layer[f"experts.{e}.{proj}.weight"] for e in range(moe.n_experts)])
            getattr(block.experts, proj).copy_(torch.from_numpy(stacked))
            for s in range(moe.n_shared_experts):
                getattr(block.shared_experts[s], proj).weight.copy_(
                    torch.from_numpy(layer[f"shared_experts.{s}.{proj}.weight"])
                )
    torch_out, torch_stats = block(torch.from_numpy(x))

    model = model_from_hf(spec, params)
    w = model.layers
    routed = ExpertWeights(w.expert_gate_proj[0], w.expert_up_proj[0], w.expert_down_proj[0])
    shared = ExpertWeights(w.shared_gate_proj[0], w.shared_up_proj[0], w.shared_down_proj[0])
    with jax.default_matmul_precision("highest"):
        out, stats = jax.jit(lambda x: moe_block(x, w.router[0], routed, shared, moe))(jnp.asarray(x))
    assert np.abs(np.asarray(out) - torch_out.detach().numpy()).max() <= 1e-5
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), torch_stats.tokens_per_expert.numpy())
    ref_layer = {"m." + k: v.astype(np.float64) for k, v in layer.items()}
    ref_out, ref_lb, ref_z = reference.moe_block(moe, ref_layer, "m.", x.astype(np.float64))
    assert np.abs(np.asarray(out) - ref_out).max() <= 1e-5
    assert float(stats.load_balancing) == pytest.approx(ref_lb, rel=1e-5)
    assert float(stats.router_z) == pytest.approx(ref_z, rel=1e-5)


def test_mxfp8_quantize_gives_the_same_numbers_in_both_trainers():
    """The inputs of packages/olmo-train-jax/tests/test_moe_mxfp8.py's hand-derived check (rows
    spanning six decades)."""
    rng = np.random.default_rng(2)
    t = (rng.standard_normal((8, 96)) * np.logspace(-3, 3, 8)[:, None]).astype(np.float32)
    q = np.asarray(jax_mxfp8_quantize(jnp.asarray(t), axis=-1), np.float64)
    np.testing.assert_array_equal(q, torch_mxfp8_quantize(torch.from_numpy(t), dim=-1).double().numpy())

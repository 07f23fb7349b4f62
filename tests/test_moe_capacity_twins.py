"""The capacity rule (``moe.capacity_factor``, ``olmo_model.moe``) in both trainers on the same
batch and weights (CPU, float32): capacity 1.0 drops here, and torch and JAX drop the identical
set of (token, expert) pairs (compared as masks, and both against the numpy rule), their MoE
blocks agree as in test_moe_twins.py, and the tiny-moe model's loss agrees within the bound of
two fp32 runs from equal weights.

    uv run --frozen pytest tests/test_moe_capacity_twins.py -n 0 -q
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from olmo_model import get_preset, layout_loss_tolerance, reference
from olmo_model.moe import capacity_keep, expert_capacity, kept_pairs
from olmo_train_jax import model_from_hf as jax_model_from_hf
from olmo_train_jax.capacity import capacity_slots as jax_capacity_slots
from olmo_train_jax.grouped_gemm import ExpertWeights
from olmo_train_jax.moe import local_experts, moe_block
from olmo_train_jax.moe import route as jax_route
from olmo_train_torch import model_from_hf as torch_model_from_hf
from olmo_train_torch.capacity import capacity_slots as torch_capacity_slots
from olmo_train_torch.moe import MoE as TorchMoE
from olmo_train_torch.moe import configure_moe
from olmo_train_torch.moe import route as torch_route

SPEC = get_preset("tiny-moe")  # 8 experts, top-4, one shared expert
B, S = 4, 16  # C = ceil(1.0 x 16 x 4 / 8) = 8 assignments per (sequence, expert)


def _torch_block(layer: dict) -> TorchMoE:
    moe = SPEC.moe
    block = TorchMoE(moe, SPEC.d_model, layer=0)
    with torch.no_grad():
        block.router.weight.copy_(torch.from_numpy(layer["gate.weight"]))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = np.stack([layer[f"experts.{e}.{proj}.weight"] for e in range(moe.n_experts)])
            getattr(block.experts, proj).copy_(torch.from_numpy(stacked))
            for s in range(moe.n_shared_experts):
                getattr(block.shared_experts[s], proj).weight.copy_(
                    torch.from_numpy(layer[f"shared_experts.{s}.{proj}.weight"])
                )
    configure_moe(block, capacity_factor=1.0)
    return block


def test_both_trainers_drop_the_same_pairs_of_a_block():
    moe = SPEC.moe
    params = reference.init_params(SPEC, seed=5)
    pre = "model.layers.0.mlp."
    layer = {k[len(pre) :]: v for k, v in params.items() if k.startswith(pre)}
    x = (2.0 * np.random.default_rng(6).standard_normal((B, S, SPEC.d_model))).astype(np.float32)
    c = expert_capacity(1.0, S, moe.top_k, moe.n_experts)

    block = _torch_block(layer)
    torch_out, torch_stats = block(torch.from_numpy(x))
    logits = torch.from_numpy(x.reshape(-1, SPEC.d_model)) @ block.router.weight.T
    torch_experts = torch_route(logits, moe)[0].experts.reshape(B, S, moe.top_k)
    torch_keep = torch_capacity_slots(torch_experts, moe.n_experts, c).keep.numpy()

    model = jax_model_from_hf(SPEC, params)
    w = model.layers
    routed = ExpertWeights(w.expert_gate_proj[0], w.expert_up_proj[0], w.expert_down_proj[0])
    shared = ExpertWeights(w.shared_gate_proj[0], w.shared_up_proj[0], w.shared_down_proj[0])
    experts_fn = functools.partial(local_experts, capacity_factor=1.0)
    with jax.default_matmul_precision("highest"):
        out, stats = jax.jit(
            lambda x: moe_block(x, w.router[0], routed, shared, moe, experts_fn=experts_fn, sequence_length=S)
        )(jnp.asarray(x.reshape(-1, SPEC.d_model)))
        jax_logits = jnp.asarray(x.reshape(-1, SPEC.d_model)) @ w.router[0]
        jax_experts = jax_route(jax_logits, moe)[0].reshape(B, S, moe.top_k)
    jax_keep = np.asarray(jax_capacity_slots(jax_experts, moe.n_experts, c).keep)

    torch_mask = kept_pairs(torch_experts.numpy(), torch_keep, moe.n_experts)
    jax_mask = kept_pairs(np.asarray(jax_experts), jax_keep, moe.n_experts)
    np.testing.assert_array_equal(torch_mask, jax_mask)
    numpy_keep = capacity_keep(np.asarray(jax_experts), moe.n_experts, c)
    np.testing.assert_array_equal(jax_mask, kept_pairs(np.asarray(jax_experts), numpy_keep, moe.n_experts))
    assert 0 < int(torch_stats.dropped) == int(stats.dropped) == int((~numpy_keep).sum())
    # The dropless twins' bound (test_moe_twins.py): the same products summed in another order.
    assert np.abs(np.asarray(out) - torch_out.detach().numpy().reshape(-1, SPEC.d_model)).max() <= 1e-5


def test_both_trainers_give_the_same_loss_with_capacity():
    params = reference.init_params(SPEC, seed=7)
    ids = np.random.default_rng(8).integers(0, SPEC.vocab_size, (B, S + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    model = torch_model_from_hf(SPEC, params)
    configure_moe(model, capacity_factor=1.0)
    with torch.no_grad():
        out = model(torch.from_numpy(inputs))
    flat = out.logits.float().reshape(-1, out.logits.shape[-1])
    torch_loss = float(torch.nn.functional.cross_entropy(flat, torch.from_numpy(labels).reshape(-1)))
    torch_dropped = sum(int(s.dropped) for s in out.moe)

    jax_model = jax_model_from_hf(SPEC, params)
    jax_model.experts_fn = functools.partial(local_experts, capacity_factor=1.0)
    graphdef, state = nnx.split(jax_model)
    jax_out = jax.jit(lambda st: nnx.merge(graphdef, st)(jnp.asarray(inputs)))(state)
    lse = jax.nn.logsumexp(jax_out.logits, -1)
    picked = jnp.take_along_axis(jax_out.logits, jnp.asarray(labels)[..., None], -1)[..., 0]
    jax_loss = float(jnp.mean(lse - picked))

    assert torch_dropped == int(jax_out.moe.dropped) > 0
    # Two fp32 forwards from equal weights: the step-1 bound of a reordered loss sum.
    assert abs(torch_loss - jax_loss) <= layout_loss_tolerance(torch_loss, B * S, 1), (torch_loss, jax_loss)

"""MoE in the JAX model on one CPU device (fp32): logits, aux losses and the total loss vs the
float64 numpy reference, gradients vs finite differences of the reference, the block vs
transformers' OlmoeSparseMoeBlock on the same weights, routing modes, metrics, HF names round
trip. The block against the torch trainer's: tests/test_moe_twins.py (repository root).

    uv run --frozen pytest packages/olmo-train-jax/tests/test_moe.py -n 0 -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from olmo_model import get_preset, reference
from olmo_model.moe import rank_load_max_over_mean
from olmo_train_jax import model_from_hf, to_hf
from olmo_train_jax.grouped_gemm import ExpertWeights, tiled_swiglu
from olmo_train_jax.moe import (
    RoutingStats,
    aux_loss,
    moe_block,
    moe_metrics,
    route,
    top_k_lowest_index_on_ties,
)

TINY_MOE = get_preset("tiny-moe")
VARIANT = get_preset("tiny-moe-sigmoid")  # sigmoid router, renormalised top-k, two shared experts
IGNORE = -100


def _ids(spec, batch=2, seq=48, seed=0):
    return np.random.default_rng(seed).integers(0, spec.vocab_size, (batch, seq)).astype(np.int32)


def _labels(ids):
    labels = np.roll(ids, -1, axis=1).astype(np.int32)
    labels[:, -1] = IGNORE
    labels[0, :5] = IGNORE
    return labels


def _numpy_total(spec, logits, stats, labels):
    """reference.loss's total from the JAX logits and aux values, in float64 numpy."""
    keep = labels != IGNORE
    z = np.asarray(logits, np.float64)[keep]
    top = z.max(-1)
    lse = np.log(np.exp(z - top[:, None]).sum(-1)) + top
    ce = np.mean(lse - z[np.arange(len(z)), labels[keep]])
    moe = spec.moe
    return (
        ce
        + spec.z_loss_weight * np.mean(lse**2)
        + moe.load_balancing_loss_weight * float(stats.load_balancing)
        + moe.router_z_loss_weight * float(stats.router_z)
    )


def _loss_fn(graphdef, spec, routing="learned"):
    """(total loss, (logits, stats)), CE and z-loss as reference.loss defines them."""

    def fn(state, ids, labels):
        out = nnx.merge(graphdef, state)(ids, routing=routing)
        logits, stats = out.logits, out.moe
        keep = labels != IGNORE
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, jnp.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
        n = jnp.sum(keep)
        ce = jnp.sum(jnp.where(keep, lse - picked, 0.0)) / n
        z = jnp.sum(jnp.where(keep, lse * lse, 0.0)) / n
        return ce + spec.z_loss_weight * z + aux_loss(stats, spec.moe, routing), (logits, stats)

    return fn


def _check_against_reference(spec, params, ids, labels, logits, stats, total):
    ref_logits, ref_aux = reference.forward_with_aux(spec, params, ids)
    ref_loss = reference.loss(spec, params, ids, labels, ignore_index=IGNORE)
    assert np.abs(np.asarray(logits) - ref_logits).max() <= 1e-4
    assert float(stats.load_balancing) == pytest.approx(ref_aux["load_balancing_loss"], rel=1e-5)
    assert float(stats.router_z) == pytest.approx(ref_aux["router_z_loss"], rel=1e-5)
    assert int(stats.dropped) == 0
    assert int(stats.tokens_per_expert.sum()) == spec.n_layers * ids.size * spec.moe.top_k
    assert abs(total - ref_loss["total"]) <= 1e-5


def test_tiny_moe_logits_aux_and_total_loss_match_numpy_reference():
    spec = TINY_MOE
    params = reference.init_params(spec, seed=1)
    ids = _ids(spec, seq=40)
    labels = _labels(ids)
    graphdef, state = nnx.split(model_from_hf(spec, params))
    out = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))(state, ids)
    logits, stats = out.logits, out.moe
    _check_against_reference(spec, params, ids, labels, logits, stats, _numpy_total(spec, logits, stats, labels))


# Parameter groups whose gradients are checked one by one (HF-name substrings).
GRAD_GROUPS = {
    "router": ("mlp.gate.weight",),
    "routed experts": ("mlp.experts.",),
    "shared experts": ("mlp.shared_experts.",),
    "attention": ("self_attn.",),
    "embedding and head": ("embed_tokens", "lm_head"),
    "norms": ("layernorm", "model.norm"),
}


def test_variant_loss_and_gradients_match_reference_and_finite_differences():
    """Sigmoid router, renormalised top-k, two shared experts: logits, aux and total loss vs
    the reference; for each parameter group, the fp32 gradient along a random direction in
    that group vs a central difference of the float64 numpy reference's total loss."""
    spec = VARIANT
    params = reference.init_params(spec, seed=2)
    ids = _ids(spec, batch=2, seq=24, seed=3)
    labels = _labels(ids)

    model = model_from_hf(spec, params)
    graphdef, state = nnx.split(model)
    (total, (logits, stats)), grads = jax.jit(jax.value_and_grad(_loss_fn(graphdef, spec), has_aux=True))(
        state, ids, labels
    )
    _check_against_reference(spec, params, ids, labels, logits, stats, float(total))
    # The adapter's to_hf is a linear re-layout (transposes, unstacking, slicing the
    # concatenated shared experts), so it carries the gradient to HF names exactly.
    hf_grads = to_hf(nnx.merge(graphdef, grads), spec)

    rng = np.random.default_rng(4)
    eps = 1e-6  # moves of 1e-6 x 0.02 per weight change no top-k choice: the loss is smooth along them
    for group, keys in GRAD_GROUPS.items():
        names = [n for n in params if any(k in n for k in keys)]
        assert names, group
        direction = {n: 0.02 * rng.standard_normal(params[n].shape) for n in names}

        def moved(sign, direction=direction):
            return {
                n: v.astype(np.float64) + (sign * eps * direction[n] if n in direction else 0.0)
                for n, v in params.items()
            }

        numeric = (
            reference.loss(spec, moved(1), ids, labels, ignore_index=IGNORE)["total"]
            - reference.loss(spec, moved(-1), ids, labels, ignore_index=IGNORE)["total"]
        ) / (2 * eps)
        analytic = sum(float(np.vdot(hf_grads[n].astype(np.float64), direction[n])) for n in names)
        assert analytic == pytest.approx(numeric, rel=1e-4), group
    assert np.abs(hf_grads["model.layers.0.mlp.gate.weight"]).max() > 0  # learned routing trains the router


def _olmoe_spec(normalize: bool):
    return TINY_MOE.replace(
        sliding_window=None,
        norm_placement="pre",
        moe=TINY_MOE.moe.model_copy(update={"n_shared_experts": 0, "normalize_top_k": normalize}),
    )


@pytest.mark.parametrize("normalize", [False, True])
def test_logits_match_transformers_olmoe_for_causal_lm(normalize):
    """The whole pre-norm MoE model against transformers' OlmoeForCausalLM on the same weights
    (olmo_model.hf_moe.olmoe_state_dict), fp32, and against the float64 numpy reference."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from olmo_model.hf_moe import olmoe_config, olmoe_state_dict

    spec = _olmoe_spec(normalize)
    params = reference.init_params(spec, seed=9)
    hf = OlmoeForCausalLM(OlmoeConfig(**olmoe_config(spec))).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in olmoe_state_dict(params, spec).items()}, strict=True)
    ids = np.random.default_rng(10).integers(0, spec.vocab_size, (2, 40))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lambda m, x: m(x).logits)(model_from_hf(spec, params), jnp.asarray(ids)))
    assert np.abs(got - want).max() <= 1e-4
    assert np.abs(got - reference.forward(spec, params, ids)).max() <= 1e-4


@pytest.mark.parametrize("normalize", [False, True])
def test_block_matches_transformers_olmoe_sparse_moe_block(normalize):
    """transformers' OlmoeSparseMoeBlock (no shared expert, softmax router) on the same
    weights, converted by olmo_model.hf_moe."""
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    from olmo_model.hf_moe import olmoe_block_tensors, olmoe_config

    spec = _olmoe_spec(normalize)
    params = reference.init_params(spec, seed=11)
    hf_block = OlmoeSparseMoeBlock(OlmoeConfig(**olmoe_config(spec)))
    hf_block.load_state_dict({k: torch.from_numpy(v) for k, v in olmoe_block_tensors(params, spec, layer=2).items()})
    x = 2.0 * np.random.default_rng(12).standard_normal((2, 40, spec.d_model)).astype(np.float32)
    with torch.no_grad():
        want = hf_block(torch.from_numpy(x)).numpy()

    w = model_from_hf(spec, params).layers
    routed = ExpertWeights(w.expert_gate_proj[2], w.expert_up_proj[2], w.expert_down_proj[2])
    with jax.default_matmul_precision("highest"):
        got, _ = jax.jit(lambda x: moe_block(x, w.router[2], routed, None, spec.moe))(jnp.asarray(x.reshape(80, -1)))
    assert np.abs(np.asarray(got).reshape(x.shape) - want).max() <= 1e-5


@pytest.mark.parametrize("n_experts", [8, 64])
def test_top_k_takes_the_lower_index_among_ties_like_a_stable_sort(n_experts):
    """The argmax-pass top-k against numpy's stable argsort of -x (the reference's rule) on
    scores full of ties, and its gradient against jax.lax.top_k's on distinct scores."""
    rng = np.random.default_rng(n_experts)
    tied = rng.integers(0, 4, (512, n_experts)).astype(np.float32)  # ~n/4 equal values per row
    values, indices = jax.jit(top_k_lowest_index_on_ties, static_argnums=1)(jnp.asarray(tied), 4)
    want = np.argsort(-tied, axis=-1, kind="stable")[:, :4]
    np.testing.assert_array_equal(np.asarray(indices), want)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(tied, want, axis=-1))
    assert indices.dtype == jnp.int32

    x = jnp.asarray(rng.standard_normal((256, n_experts)).astype(np.float32))
    weights = jnp.asarray(rng.standard_normal((256, 4)).astype(np.float32))

    def loss(top_k, x):
        return jnp.sum(top_k(jax.nn.softmax(x), 4)[0] * weights)

    ours = jax.grad(lambda x: loss(top_k_lowest_index_on_ties, x))(x)
    theirs = jax.grad(lambda x: loss(jax.lax.top_k, x))(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-8)
    assert np.abs(np.asarray(ours)).max() > 1e-3  # the gradient is not trivially zero


def test_random_routing_is_near_uniform_and_reproducible():
    moe = TINY_MOE.moe
    n_tokens = 8192
    logits = jnp.zeros((n_tokens, moe.n_experts))
    key = jax.random.fold_in(jax.random.key(7), 3)
    experts, weights, _ = jax.jit(lambda scores, k: route(scores, moe, "random", k))(logits, key)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=moe.n_experts)
    expected = n_tokens * moe.top_k / moe.n_experts  # 4096 per expert
    # A binomial count with p = 1/2 has sd sqrt(8192 / 4) ~ 45, so 5% (205) is > 4.5 sd.
    assert np.abs(counts - expected).max() <= 0.05 * expected
    assert all(len(set(row)) == moe.top_k for row in np.asarray(experts)[:100])  # k distinct experts
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    again, _, _ = route(logits, moe, "random", key)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(experts))
    other, _, _ = route(logits, moe, "random", jax.random.fold_in(jax.random.key(7), 4))
    assert (np.asarray(other) != np.asarray(experts)).mean() > 0.5


def test_uniform_routing_is_exactly_balanced_and_router_untrained():
    spec = TINY_MOE
    params = reference.init_params(spec, seed=8)
    ids = _ids(spec, batch=2, seq=32)
    graphdef, state = nnx.split(model_from_hf(spec, params))
    stats = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids, routing="uniform").moe)(state, ids)
    # 64 tokens x 4 slots over 8 experts in 4 layers: 32 per expert per layer.
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), np.full(8, 4 * 32))
    assert rank_load_max_over_mean(np.asarray(stats.tokens_per_expert), 4) == 1.0
    experts, weights, _ = route(jnp.zeros((3, 8)), spec.moe, "uniform")
    np.testing.assert_array_equal(np.asarray(experts), [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]])
    np.testing.assert_array_equal(np.asarray(weights), np.full((3, 4), 0.25))

    # Block level: with the aux losses in the objective, no gradient reaches the router.
    w = nnx.merge(graphdef, state).layers
    routed = ExpertWeights(w.expert_gate_proj[0], w.expert_up_proj[0], w.expert_down_proj[0])
    x = jnp.asarray(np.random.default_rng(9).standard_normal((16, spec.d_model)), jnp.float32)

    def objective(router, routed):
        out, stats = moe_block(x, router, routed, None, spec.moe, routing="uniform")
        return jnp.sum(out**2) + aux_loss(stats, spec.moe, "uniform") + stats.load_balancing + stats.router_z

    g_router, g_routed = jax.jit(jax.grad(objective, argnums=(0, 1)))(w.router[0], routed)
    assert not np.asarray(g_router).any()
    assert np.asarray(g_routed.up).any()


def test_random_routing_in_the_model_depends_on_step_and_layer():
    spec = TINY_MOE
    model = model_from_hf(spec, reference.init_params(spec, seed=9))
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, ids, key: nnx.merge(graphdef, st)(ids, routing="random", routing_key=key).logits)
    ids = _ids(spec, batch=2, seq=32)
    base = jax.random.key(0)
    a = fwd(state, ids, jax.random.fold_in(base, 1))
    b = fwd(state, ids, jax.random.fold_in(base, 1))
    c = fwd(state, ids, jax.random.fold_in(base, 2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-3
    with pytest.raises(ValueError, match="routing_key"):
        model(jnp.asarray(ids), routing="random")
    with pytest.raises(ValueError, match="routing='greedy' is unknown"):
        model(jnp.asarray(ids), routing="greedy")


def test_hf_round_trip_and_interleaved_layers():
    """The interleaved stack (dense, MoE, dense, MoE) is held since mixed stacks are (its forward
    against the reference: test_moe_mixed_stacks.py)."""
    interleaved = TINY_MOE.replace(moe=TINY_MOE.moe.model_copy(update={"layers": (1, 3)}))
    for spec in (VARIANT, interleaved):
        params = reference.init_params(spec, seed=10)
        back = to_hf(model_from_hf(spec, params), spec)
        assert list(back) == list(params)
        for name in params:
            np.testing.assert_array_equal(back[name], params[name], err_msg=name)


def test_rank_load_and_metrics_by_hand():
    # 4 ranks of 2 experts: loads 10, 2, 4, 0 -> mean 4, max 10.
    assert rank_load_max_over_mean(np.array([6, 4, 1, 1, 2, 2, 0, 0]), 4) == 2.5
    stats = RoutingStats(
        jnp.float32(1.25), jnp.float32(3.5), jnp.array([6, 4, 1, 1, 2, 2, 0, 0], jnp.int32), jnp.int32(0)
    )
    assert moe_metrics(stats, 2) == {
        "moe_tokens_per_expert": [6, 4, 1, 1, 2, 2, 0, 0],
        "moe_rank_load_max_over_mean": 12 / 8,  # ranks hold 12 and 4
        "moe_dropped_tokens": 0,
        "moe_lb_loss": 1.25,
        "moe_router_z_loss": 3.5,
    }
    with pytest.raises(ValueError, match="ep_size=3 does not divide n_experts=8"):
        rank_load_max_over_mean(np.zeros(8), 3)


@pytest.mark.parametrize("tile", [None, 4, 64], ids=["default-tile", "tile-4", "tile-64-one-per-group"])
def test_tiled_grouped_swiglu_matches_per_expert_numpy(tile):
    """The CPU grouped GEMM (tiles of one expert each): every row through its own expert's
    SwiGLU, computed per expert in float64 numpy; empty groups, a one-row group and rows past
    the groups (which must come back zero); gradients against ragged_dot's."""
    rng = np.random.default_rng(0)
    n_experts, d, h, n = 6, 16, 12, 50
    sizes = np.array([7, 0, 13, 1, 9, 5], np.int32)  # 35 rows in groups, 15 past them
    xs = rng.standard_normal((n, d)).astype(np.float32)
    gate, up = (rng.standard_normal((n_experts, d, h)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((n_experts, h, d)).astype(np.float32) * 0.3
    w = ExpertWeights(*(jnp.asarray(a) for a in (gate, up, down)))
    got = np.asarray(jax.jit(lambda x, w: tiled_swiglu(x, w, jnp.asarray(sizes), tile=tile))(jnp.asarray(xs), w))
    want = np.zeros((n, d))
    start = 0
    for e, size in enumerate(sizes):
        x = xs[start : start + size].astype(np.float64)
        a, b = x @ gate[e], x @ up[e]
        want[start : start + size] = (a / (1 + np.exp(-a)) * b) @ down[e]
        start += size
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[35:].any()

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w)))

    def ragged(x, w):
        g = jnp.asarray(sizes)
        hidden = jax.nn.silu(jax.lax.ragged_dot(x, w.gate, g)) * jax.lax.ragged_dot(x, w.up, g)
        return jax.lax.ragged_dot(hidden, w.down, g)

    ours = jax.grad(loss(lambda x, w: tiled_swiglu(x, w, jnp.asarray(sizes), tile=tile)), argnums=(0, 1))
    ref = jax.grad(loss(ragged), argnums=(0, 1))
    for a, b in zip(jax.tree.leaves(ours(jnp.asarray(xs), w)), jax.tree.leaves(ref(jnp.asarray(xs), w)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))

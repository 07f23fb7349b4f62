"""The numpy reference against transformers (Olmo3ForCausalLM, OLMoE's sparse MoE block),
both in float64, and against hand-built formulations for what transformers lacks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers
from transformers.models.olmo3 import modeling_olmo3
from transformers.models.olmoe import modeling_olmoe

from olmo_model import FULL, SpecError, get_preset, hf_config
from olmo_model import reference as ref


def to_torch(params):
    return {name: torch.from_numpy(np.asarray(value, dtype=np.float64)) for name, value in params.items()}


def _hf_olmo3(spec, params):
    cfg = transformers.Olmo3Config(**hf_config(spec))
    cfg._attn_implementation = "sdpa"  # eager attention softmaxes in float32
    model = transformers.Olmo3ForCausalLM(cfg).double().eval()
    model.load_state_dict(to_torch(params), strict=True)
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def _set_float64_inv_freq(spec, model):
    """transformers builds inv_freq in float32; its formula is checked against ours to
    float32 rounding in test_rope_inv_freq_matches_transformers, and the float64 values
    are put in its buffers so the whole-model comparison can be tight."""
    rotary = model.model.rotary_emb
    for kind in set(spec.layer_types):
        inv_freq, _ = ref.rope_inv_freq(spec, spec.layer_types.index(kind))
        getattr(rotary, f"{kind}_inv_freq").copy_(torch.from_numpy(inv_freq))


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa", "tiny-yarn"])
def test_rope_inv_freq_matches_transformers(preset):
    spec = get_preset(preset)
    cfg = transformers.Olmo3Config(**hf_config(spec))
    rotary = modeling_olmo3.Olmo3RotaryEmbedding(cfg)
    for kind in set(spec.layer_types):
        ours, scale = ref.rope_inv_freq(spec, spec.layer_types.index(kind))
        theirs = getattr(rotary, f"{kind}_inv_freq").double().numpy()
        # transformers computes in float32: agreement to float32 rounding.
        np.testing.assert_allclose(ours, theirs, rtol=3e-7, atol=0)
        assert scale == pytest.approx(getattr(rotary, f"{kind}_attention_scaling"), rel=1e-12)
    if spec.yarn is not None:
        # YaRN really changes the global layers: low frequencies are divided by the factor.
        full, scale = ref.rope_inv_freq(spec, spec.layer_types.index(FULL))
        plain = 1.0 / spec.rope_theta ** (np.arange(0, spec.head_dim, 2) / spec.head_dim)
        assert full[-1] == pytest.approx(plain[-1] / spec.yarn.factor, rel=1e-12)
        assert full[0] == pytest.approx(plain[0], rel=1e-12)
        assert scale == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-12)


@pytest.mark.parametrize(("preset", "seq_len"), [("tiny", 64), ("tiny-gqa", 64), ("tiny-yarn", 128)])
def test_logits_match_transformers(olmo3_float64, preset, seq_len):
    spec = get_preset(preset)
    assert spec.sliding_window < seq_len  # both attention kinds are exercised
    params = ref.init_params(spec, seed=1)
    model = _hf_olmo3(spec, params)
    _set_float64_inv_freq(spec, model)
    ids = np.random.default_rng(0).integers(0, spec.vocab_size, size=(2, seq_len))
    ours = ref.forward(spec, params, ids)
    theirs = _hf_logits(model, ids)
    assert ours.dtype == np.float64 and ours.shape == (2, seq_len, spec.padded_vocab_size)
    assert np.abs(ours - theirs).max() < 1e-9
    # The comparison can see a wrong mask: the same weights with every layer global differ.
    all_global = spec.replace(layer_types=(FULL,) * spec.n_layers)
    assert np.abs(ref.forward(all_global, params, ids) - theirs).max() > 1e-4


def test_loss_matches_torch_cross_entropy(olmo3_float64):
    spec = get_preset("tiny")
    params = ref.init_params(spec, seed=2)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, spec.vocab_size, size=(2, 40))
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[0, :5] = -100
    logits = torch.from_numpy(_hf_logits(_hf_olmo3(spec, params), ids))
    target = torch.from_numpy(labels)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    keep = target != -100
    z = (torch.logsumexp(logits, dim=-1)[keep] ** 2).mean()
    out = ref.loss(spec, params, ids, labels)
    assert out["ce"] == pytest.approx(ce.item(), abs=1e-9)
    assert out["z_loss"] == pytest.approx(z.item(), abs=1e-9)
    assert out["total"] == pytest.approx(ce.item() + 1e-5 * z.item(), abs=1e-9)
    # A fresh model is near uniform over the padded vocab: ce ~ ln(4096).
    assert abs(out["ce"] - math.log(spec.padded_vocab_size)) < 0.1


def test_per_head_qk_norm_equals_full_with_one_head():
    """With one head the per-head and the full-width norm normalise the same vector."""
    full = get_preset("tiny").replace(n_heads=1)
    per_head = full.replace(qk_norm="per_head")
    params = ref.init_params(full, seed=4)
    ids = np.random.default_rng(5).integers(0, full.vocab_size, size=(1, 48))
    np.testing.assert_allclose(ref.forward(per_head, params, ids), ref.forward(full, params, ids), rtol=0, atol=1e-12)
    # and with several heads it is a different model
    four = get_preset("tiny")
    four_params = ref.init_params(four, seed=4)
    per_head_params = {
        k: (np.ones(four.head_dim, np.float32) if k.endswith(("q_norm.weight", "k_norm.weight")) else v)
        for k, v in four_params.items()
    }
    diff = ref.forward(four.replace(qk_norm="per_head"), per_head_params, ids) - ref.forward(four, four_params, ids)
    assert np.abs(diff).max() > 1e-4


def test_init_params_truncated_normal():
    spec = get_preset("tiny")
    params = ref.init_params(spec, seed=0)
    emb = params["model.embed_tokens.weight"].astype(np.float64)
    assert emb.dtype == np.float64 and params["model.embed_tokens.weight"].dtype == np.float32
    assert np.abs(emb).max() <= 3 * 0.02 + 1e-9
    # Std of a normal truncated at +-3 sigma: sigma * sqrt(1 - 2*3*phi(3) / (2*Phi(3) - 1)).
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    big_phi3 = 0.5 * (1 + math.erf(3 / math.sqrt(2)))
    expected_std = 0.02 * math.sqrt(1 - 6 * phi3 / (2 * big_phi3 - 1))
    assert emb.std() == pytest.approx(expected_std, rel=0.01)
    assert abs(emb.mean()) < 1e-4
    assert np.all(params["model.layers.0.self_attn.q_norm.weight"] == 1.0)
    assert np.all(params["model.norm.weight"] == 1.0)
    again = ref.init_params(spec, seed=0)
    other = ref.init_params(spec, seed=1)
    assert np.array_equal(again["lm_head.weight"], params["lm_head.weight"])
    assert not np.array_equal(other["lm_head.weight"], params["lm_head.weight"])


def test_bad_inputs_are_one_line_errors():
    spec = get_preset("tiny")
    params = ref.init_params(spec)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 4096\)"):
        ref.forward(spec, params, np.array([[0, 4096]]))
    broken = dict(params)
    del broken["lm_head.weight"]
    with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
        ref.forward(spec, broken, np.array([[0, 1]]))
    with pytest.raises(ValueError, match="every label equals ignore_index"):
        ref.loss(spec, params, np.array([[0, 1]]), np.array([[-100, -100]]))


# ---- MoE ------------------------------------------------------------------------------


def _moe_spec(normalize: bool, gating: str = "softmax", shared: int = 0):
    return get_preset("tiny-moe").replace(
        n_layers=2,
        moe=dict(
            n_experts=8, top_k=3, expert_hidden=32, n_shared_experts=shared, gating=gating, normalize_top_k=normalize
        ),
    )


def _scaled_moe_params(spec, seed):
    """Init weights with the routers x25 (routing far from uniform) and the experts x10
    (outputs of order one, so an absolute 1e-9 is a tight bound)."""

    def scale(name):
        if name.endswith("mlp.gate.weight"):
            return 25.0
        return 10.0 if "experts." in name else 1.0

    return {k: v * scale(k) for k, v in ref.init_params(spec, seed=seed).items()}


def _olmoe_block(spec, params, prefix):
    moe = spec.moe
    cfg = transformers.OlmoeConfig(
        hidden_size=spec.d_model,
        intermediate_size=moe.expert_hidden,
        num_experts=moe.n_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.normalize_top_k,
    )
    block = modeling_olmoe.OlmoeSparseMoeBlock(cfg).double()
    t = to_torch(params)
    # transformers v5 stores experts fused: gate_up_proj [E, 2*hidden, d] (gate rows first), down_proj [E, d, hidden].
    gate_up = torch.stack(
        [
            torch.cat([t[f"{prefix}experts.{e}.gate_proj.weight"], t[f"{prefix}experts.{e}.up_proj.weight"]])
            for e in range(moe.n_experts)
        ]
    )
    down = torch.stack([t[f"{prefix}experts.{e}.down_proj.weight"] for e in range(moe.n_experts)])
    with torch.no_grad():
        block.gate.weight.copy_(t[prefix + "gate.weight"])
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block


@pytest.mark.parametrize("normalize", [False, True])
def test_moe_block_matches_olmoe(olmoe_float64, normalize):
    spec = _moe_spec(normalize)
    params = _scaled_moe_params(spec, seed=6)
    prefix = "model.layers.1.mlp."
    x = np.random.default_rng(7).normal(size=(2, 24, spec.d_model))
    block = _olmoe_block(spec, params, prefix)
    with torch.no_grad():
        theirs = block(torch.from_numpy(x)).numpy()
        logits = torch.nn.functional.linear(torch.from_numpy(x.reshape(-1, spec.d_model)), block.gate.weight)
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    ours, lb, z = ref.moe_block(spec.moe, p64, prefix, x.reshape(-1, spec.d_model))
    assert np.abs(ours.reshape(x.shape) - theirs).max() < 1e-9
    assert np.abs(theirs).max() > 0.1  # 1e-9 is tight against outputs of this size
    # transformers' f_e is count_e / T (summing to top_k); ours is the share of the T*k slots.
    hf_lb = modeling_olmoe.load_balancing_loss_func((logits,), spec.moe.n_experts, spec.moe.top_k).item()
    assert lb == pytest.approx(hf_lb / spec.moe.top_k, rel=1e-6)
    assert z == pytest.approx((torch.logsumexp(logits, dim=-1) ** 2).mean().item(), rel=1e-12)


def _expert(p, prefix, x):
    h = x @ p[prefix + "gate_proj.weight"].T
    return (h / (1 + np.exp(-h)) * (x @ p[prefix + "up_proj.weight"].T)) @ p[prefix + "down_proj.weight"].T


@pytest.mark.parametrize("normalize", [False, True])
def test_sigmoid_gating_and_shared_expert_token_by_token(normalize):
    """No transformers model has sigmoid routing with a shared expert; this is the same
    block written one token at a time with an explicit sort."""
    spec = _moe_spec(normalize, gating="sigmoid", shared=1)
    p = {k: v.astype(np.float64) for k, v in _scaled_moe_params(spec, seed=8).items()}
    prefix = "model.layers.0.mlp."
    x = np.random.default_rng(9).normal(size=(16, spec.d_model))
    ours, lb, z = ref.moe_block(spec.moe, p, prefix, x)
    expected = np.zeros_like(x)
    counts = np.zeros(8)
    score_sum = np.zeros(8)
    for t in range(x.shape[0]):
        logits = p[prefix + "gate.weight"] @ x[t]
        scores = 1 / (1 + np.exp(-logits))
        order = sorted(range(8), key=lambda e: (-scores[e], e))[:3]
        w = scores[order] / (scores[order].sum() if normalize else 1.0)
        for weight, e in zip(w, order):
            expected[t] += weight * _expert(p, f"{prefix}experts.{e}.", x[t])
            counts[e] += 1
        expected[t] += _expert(p, f"{prefix}shared_experts.0.", x[t])
        score_sum += scores
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-12)
    assert lb == pytest.approx(8 * np.sum(counts / (16 * 3) * score_sum / 16), rel=1e-12)


def test_router_ties_go_to_lower_experts():
    spec = _moe_spec(normalize=False)
    p = {k: v.astype(np.float64) for k, v in ref.init_params(spec, seed=10).items()}
    prefix = "model.layers.0.mlp."
    p[prefix + "gate.weight"][:] = 0.0  # every expert scores 1/8
    x = np.random.default_rng(11).normal(size=(5, spec.d_model))
    ours, lb, z = ref.moe_block(spec.moe, p, prefix, x)
    expected = sum(_expert(p, f"{prefix}experts.{e}.", x) / 8 for e in range(3))
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-12)
    # f = (1/3, 1/3, 1/3, 0, ...), P = 1/8 each: 8 * 3 * (1/3 * 1/8) = 1.
    assert lb == pytest.approx(1.0, rel=1e-12)
    assert z == pytest.approx(math.log(8) ** 2, rel=1e-12)


def test_moe_model_loss_adds_weighted_aux():
    spec = _moe_spec(normalize=False, shared=1)
    params = ref.init_params(spec, seed=12)
    ids = np.random.default_rng(13).integers(0, spec.vocab_size, size=(1, 40))
    _, aux = ref.forward_with_aux(spec, params, ids)
    assert set(aux) == {"load_balancing_loss", "router_z_loss"}
    assert aux["load_balancing_loss"] > 0 and aux["router_z_loss"] > 0
    out = ref.loss(spec, params, ids, np.roll(ids, -1, axis=1))
    assert out["total"] == pytest.approx(
        out["ce"] + 1e-5 * out["z_loss"] + 0.01 * aux["load_balancing_loss"] + 0.001 * aux["router_z_loss"], rel=1e-12
    )


def test_pre_norm_reference_matches_olmoe_for_causal_lm():
    """norm_placement='pre': the numpy reference of a whole OLMoE-shaped model against
    transformers' OlmoeForCausalLM (float32) on the same weights (hf_moe.olmoe_state_dict).
    The reordered-norm reference on the same weights must not match (the field is used)."""
    from olmo_model.hf_moe import olmoe_config, olmoe_state_dict, spec_from_olmoe_config

    spec = _moe_spec(False).replace(sliding_window=None, norm_placement="pre")
    assert spec_from_olmoe_config(olmoe_config(spec)).norm_placement == "pre"
    params = ref.init_params(spec, seed=3)
    model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**olmoe_config(spec))).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in olmoe_state_dict(params, spec).items()}, strict=True)
    ids = np.random.default_rng(4).integers(0, spec.vocab_size, size=(2, 24))
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(ids)).logits.double().numpy()
    assert np.abs(ref.forward(spec, params, ids) - theirs).max() <= 1e-4
    reordered = ref.forward(spec.replace(norm_placement="reordered"), params, ids)
    assert np.abs(reordered - theirs).max() > 1e-2
    with pytest.raises(SpecError, match="norm_placement='pre' cannot be expressed by Olmo3ForCausalLM"):
        hf_config(spec.replace(moe=None))

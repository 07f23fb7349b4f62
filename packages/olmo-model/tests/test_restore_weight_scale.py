"""moe.restore_weight_scale (OLMo-core 3's router option: the renormalised top-k weights times k)
in the spec, the numpy reference and the OLMoE export, and head_dim in the reference against
transformers' Olmo3."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers

from olmo_model import SpecError, get_preset, hf_config, spec_from_dict
from olmo_model import reference as ref
from olmo_model.hf_moe import olmoe_config
from olmo_model.spec import MoESpec


def _silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def _one_token_block(moe: MoESpec) -> dict[str, np.ndarray]:
    """d_model 2, expert hidden 1. Router logits of token [1, 0] are log(1, 2, 3, 4), so its
    softmax is (0.1, 0.2, 0.3, 0.4); expert e maps it to ((e + 1) * silu(1), 0)."""
    p = {"m.gate.weight": np.array([[math.log(v), 0.0] for v in (1, 2, 3, 4)])}
    for e in range(moe.n_experts):
        p[f"m.experts.{e}.gate_proj.weight"] = np.array([[1.0, 0.0]])
        p[f"m.experts.{e}.up_proj.weight"] = np.array([[1.0, 0.0]])
        p[f"m.experts.{e}.down_proj.weight"] = np.array([[e + 1.0], [0.0]])
    return p


@pytest.mark.parametrize("restore", [False, True])
def test_reference_block_by_hand(restore):
    """Top-2 of (0.1, 0.2, 0.3, 0.4) are experts 3 and 2, renormalised to 4/7 and 3/7; restored,
    times 2: 8/7 and 6/7, which sum to k = 2. The block's output is then
    (8/7 * 4 + 6/7 * 3) * silu(1) = 50/7 * silu(1), twice the unscaled 25/7 * silu(1)."""
    moe = MoESpec(n_experts=4, top_k=2, expert_hidden=1, normalize_top_k=True, restore_weight_scale=restore)
    p = _one_token_block(moe)
    x = np.array([[1.0, 0.0]])
    chosen, weights, _ = ref.route(moe, x @ p["m.gate.weight"].T)
    scale = 2.0 if restore else 1.0
    np.testing.assert_array_equal(chosen, [[3, 2]])
    np.testing.assert_allclose(weights, [[4 / 7 * scale, 3 / 7 * scale]], rtol=1e-15)
    out, _, _ = ref.moe_block(moe, p, "m.", x)
    np.testing.assert_allclose(out, [[25 / 7 * scale * _silu(1.0), 0.0]], rtol=1e-15, atol=0)


def test_restored_weights_sum_to_top_k():
    moe = get_preset("tiny-olmoe3").moe
    assert moe is not None and moe.restore_weight_scale
    logits = np.random.default_rng(0).standard_normal((64, moe.n_experts))
    _, weights, _ = ref.route(moe, logits)
    np.testing.assert_allclose(weights.sum(axis=-1), moe.top_k, rtol=1e-14)


def test_restore_needs_renormalised_weights():
    with pytest.raises(SpecError) as err:
        spec_from_dict(
            {"preset": "tiny-moe", "moe": {**get_preset("tiny-moe").moe.model_dump(), "restore_weight_scale": True}}
        )
    msg = str(err.value)
    assert "\n" not in msg and "moe.restore_weight_scale" in msg and "normalize_top_k: true" in msg


def _olmoe_expressible():
    """tiny-moe made OLMoE-shaped: pre-norm, global attention, no shared expert, renormalised."""
    base = get_preset("tiny-moe")
    assert base.moe is not None
    moe = base.moe.model_copy(update={"n_shared_experts": 0, "normalize_top_k": True})
    return base.replace(norm_placement="pre", sliding_window=None, moe=moe.model_dump())


def test_olmoe_export_refuses_restore_weight_scale_and_head_dim():
    spec = _olmoe_expressible()
    assert olmoe_config(spec)["norm_topk_prob"] is True
    assert spec.moe is not None
    restored = spec.replace(moe={**spec.moe.model_dump(), "restore_weight_scale": True})
    with pytest.raises(SpecError, match=r"^olmoe_config: moe.restore_weight_scale .* set it to false"):
        olmoe_config(restored)
    wide_heads = spec.replace(head_dim=32)  # 4 heads of 32 = 128 != d_model 64
    with pytest.raises(SpecError, match=r"^olmoe_config: head_dim=32 \(n_heads \* head_dim = 128 != d_model = 64\)"):
        olmoe_config(wide_heads)


def test_reference_head_dim_matches_transformers(olmo3_float64):
    """tiny-gqa with heads of 24 (q width 96, kv width 48 at d_model 64) against transformers'
    Olmo3ForCausalLM told the same head_dim (its attention reads config.head_dim)."""
    spec = get_preset("tiny-gqa").replace(head_dim=24)
    assert (spec.q_width, spec.kv_width) == (96, 48)
    params = ref.init_params(spec, seed=2)
    cfg = transformers.Olmo3Config(**hf_config(spec))  # hf_config writes head_dim
    cfg._attn_implementation = "sdpa"  # eager attention softmaxes in float32
    model = transformers.Olmo3ForCausalLM(cfg).double().eval()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in params.items()}, strict=True)
    rotary = model.model.rotary_emb
    for kind in set(spec.layer_types):
        inv_freq, _ = ref.rope_inv_freq(spec, spec.layer_types.index(kind))
        assert inv_freq.shape == (12,)
        getattr(rotary, f"{kind}_inv_freq").copy_(torch.from_numpy(inv_freq))
    ids = np.random.default_rng(1).integers(0, spec.vocab_size, size=(2, 48))
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)).logits.numpy()
    # float64 on both sides (the fixture takes transformers' float32 casts out): ~1e-13 apart.
    assert np.abs(ref.forward(spec, params, ids) - theirs).max() < 1e-9

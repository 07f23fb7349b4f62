"""OLMo-core 3's peri-norm blocks (``norm_placement: peri``: an input RMSNorm on attention and on the
MLP besides the two output norms, ``use_peri_norm``) and its embedding (times ``embedding_scale``,
then an RMSNorm with its own weight, ``embedding_norm``) in the spec, the numpy reference, the
parameter count and the HF export refusals. The OLMo-core forward itself is in
tools/tests/test_olmo_core_peri_norm.py, both trainers in tests/test_peri_norm_twins.py."""

from __future__ import annotations

import numpy as np
import pytest

from olmo_model import (
    HFLayoutError,
    SpecError,
    get_preset,
    hf_config,
    hf_param_shapes,
    param_counts,
    spec_from_dict,
    validate_hf_tensors,
)
from olmo_model import reference as ref
from olmo_model.hf_moe import olmoe_config

DENSE = get_preset("tiny").replace(n_layers=2, norm_placement="peri", embedding_scale=8.0, embedding_norm=True)


def _tiny_olmoe3(n_layers: int):
    spec = get_preset("tiny-olmoe3")
    assert spec.moe is not None
    return spec.replace(n_layers=n_layers, moe={**spec.moe.model_dump(), "layers": tuple(range(1, n_layers))})


def _params(spec, seed=0):
    """Reference init with every norm weight drawn 1 +- 0.3, so an input norm taken for an output
    norm (or one left out) changes the numbers."""
    params = ref.init_params(spec, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name, value in params.items():
        if value.ndim == 1:
            params[name] = (1.0 + 0.3 * rng.standard_normal(value.shape)).astype(np.float32)
    return params


def test_the_new_weights_and_their_names():
    names = hf_param_shapes(DENSE)
    d = DENSE.d_model
    assert names["model.embed_norm.weight"] == (d,)
    for i in range(2):
        assert names[f"model.layers.{i}.input_layernorm.weight"] == (d,)
        assert names[f"model.layers.{i}.pre_feedforward_layernorm.weight"] == (d,)
    plain = hf_param_shapes(get_preset("tiny").replace(n_layers=2))
    assert set(names) - set(plain) == {
        "model.embed_norm.weight",
        *(f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "pre_feedforward_layernorm")),
    }
    # Norm weights count as stored and active: 2 * d per layer and d for the embedding norm.
    before, after = param_counts(get_preset("tiny").replace(n_layers=2)), param_counts(DENSE)
    assert after.total - before.total == after.active - before.active == d * (2 * 2 + 1)


def test_embedding_is_scaled_then_normalised():
    """RMSNorm(s x) = x / sqrt(mean(x^2) + eps / s^2) * w: scaling first changes only how eps
    weighs, which a tiny row shows (at eps 1e-6 and rows of RMS 1e-3 the scale moves the output
    by about 40%)."""
    params = {k: v.astype(np.float64) for k, v in _params(DENSE).items()}
    ids = np.array([[3, 7, 11]])
    rows = params["model.embed_tokens.weight"][ids] * 1e-1  # RMS ~ 2e-3 at init_std 0.02
    params["model.embed_tokens.weight"][ids] = rows
    w, eps, s = params["model.embed_norm.weight"], DENSE.norm_eps, 8.0
    by_hand = rows / np.sqrt(np.mean(rows**2, -1, keepdims=True) + eps / s**2) * w
    np.testing.assert_allclose(ref.embed(DENSE, params, ids), by_hand, rtol=1e-12)
    unscaled = ref.embed(DENSE.replace(embedding_scale=None), params, ids)
    assert np.abs(unscaled - by_hand).max() > 0.1 * np.abs(by_hand).max()
    plain = ref.embed(DENSE.replace(embedding_scale=None, embedding_norm=False), params, ids)
    np.testing.assert_array_equal(plain, rows)


@pytest.mark.parametrize("moe", [False, True])
def test_a_peri_norm_block_by_hand(moe):
    """h = x + norm_out(attn(norm_in(x))), out = h + norm_out'(mlp(norm_in'(h))), each norm written
    out in float64 here, the sublayers the reference's own (tested on their own elsewhere)."""
    spec = DENSE if not moe else _tiny_olmoe3(n_layers=2)
    params = {k: v.astype(np.float64) for k, v in _params(spec, seed=2).items()}
    x = np.random.default_rng(3).standard_normal((2, 5, spec.d_model))

    def norm(a, name):
        return a / np.sqrt(np.mean(a * a, -1, keepdims=True) + spec.norm_eps) * params[f"model.layers.1.{name}.weight"]

    h = x + norm(
        ref.attention(spec, params, "model.layers.1.self_attn.", 1, norm(x, "input_layernorm")),
        "post_attention_layernorm",
    )
    m_in = norm(h, "pre_feedforward_layernorm")
    if moe:
        assert spec.is_moe_layer(1)
        m = ref.moe_block(spec.moe, params, "model.layers.1.mlp.", m_in.reshape(10, -1))[0].reshape(m_in.shape)
    else:
        m = ref.swiglu(m_in, *(params[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up", "down")))
    want = h + norm(m, "post_feedforward_layernorm")
    got, _ = ref.block(spec, params, 1, x)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # The same weights as a reordered block (no input norms) give other numbers.
    reordered, _ = ref.block(spec.replace(norm_placement="reordered"), params, 1, x)
    assert np.abs(reordered - want).max() > 1e-2


def test_bad_values_and_the_hf_refusals():
    with pytest.raises(SpecError, match="embedding_scale"):
        spec_from_dict({"preset": "tiny", "embedding_scale": 0.0})
    with pytest.raises(SpecError, match="norm_placement"):
        spec_from_dict({"preset": "tiny", "norm_placement": "sandwich"})
    with pytest.raises(SpecError, match="norm_placement='peri' cannot be expressed by Olmo3ForCausalLM"):
        hf_config(get_preset("tiny").replace(norm_placement="peri"))
    with pytest.raises(SpecError, match="embedding_norm=True, embedding_scale=None cannot be expressed"):
        hf_config(get_preset("tiny").replace(embedding_norm=True))
    with pytest.raises(SpecError, match="embedding_scale=8.0 cannot be expressed"):
        hf_config(get_preset("tiny").replace(embedding_scale=8.0))
    base = get_preset("tiny-moe")
    assert base.moe is not None
    moe = {**base.moe.model_dump(), "n_shared_experts": 0}
    olmoe = base.replace(norm_placement="pre", sliding_window=None, moe=moe)
    olmoe_config(olmoe)  # expressible as it is
    with pytest.raises(SpecError, match="norm_placement='peri' cannot be expressed by OlmoeForCausalLM"):
        olmoe_config(olmoe.replace(norm_placement="peri"))
    with pytest.raises(SpecError, match="embedding_norm=True, embedding_scale=8.0 cannot be expressed by Olmoe"):
        olmoe_config(olmoe.replace(embedding_norm=True, embedding_scale=8.0))


def test_the_olmoe3_presets_use_them():
    """The OLMoE3-dev scripts: peri-norm, embedding times sqrt(d_model) then normalised; the
    benchmark (moe_8l_ddp.py, use_peri_norm=False) the embedding only."""
    for name in ("olmoe3-t001", "olmoe3-u001", "tiny-olmoe3"):
        spec = get_preset(name)
        assert spec.norm_placement == "peri" and spec.embedding_norm, name
        assert spec.embedding_scale == pytest.approx(spec.d_model**0.5, rel=1e-15), name
    bench = get_preset("olmoe3-bench-e128")
    assert bench.norm_placement == "reordered" and bench.embedding_norm and bench.embedding_scale == 64.0


def test_a_peri_norm_checkpoint_for_a_reordered_spec_says_so():
    """A peri-norm model's tensors read with a spec that lacks norm_placement: peri: the one-line
    error names the fix."""
    plain = DENSE.replace(norm_placement="reordered")
    shapes = hf_param_shapes(DENSE)
    with pytest.raises(HFLayoutError, match="input_layernorm.* a peri-norm model .*set norm_placement: peri"):
        validate_hf_tensors(plain, shapes, "ckpt")
    without_input = {k: v for k, v in shapes.items() if not k.endswith("input_layernorm.weight")}
    with pytest.raises(HFLayoutError, match="pre_feedforward_layernorm.* a peri-norm layer .*set norm_placement: peri"):
        validate_hf_tensors(plain, without_input, "ckpt")
    with pytest.raises(HFLayoutError, match="embed_norm.* set embedding_norm: true"):
        validate_hf_tensors(DENSE.replace(embedding_norm=False), shapes, "ckpt")

"""``validate_hf_tensors``: the one check that HF-named tensors fit a spec.

The names and shapes that pass are transformers' own (an ``Olmo3ForCausalLM`` state dict);
the OLMoE cases use an ``OlmoeForCausalLM`` state dict, whose experts transformers fuses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from olmo_model import HFLayoutError, get_preset, hf_config, validate_hf_tensors
from olmo_model.hf_moe import block_tensors_from_olmoe, spec_from_olmoe_config

SOURCE = "ckpt/model.safetensors"


def _olmo3_state(preset: str) -> dict[str, torch.Tensor]:
    cfg = transformers.Olmo3Config(**hf_config(get_preset(preset)))
    with torch.device("meta"):  # names, shapes and dtypes only
        return dict(transformers.Olmo3ForCausalLM(cfg).state_dict())


def _shapes(state) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in state.items()}


def _error(spec, shapes, **kwargs) -> str:
    with pytest.raises(HFLayoutError) as err:
        validate_hf_tensors(spec, shapes, SOURCE, **kwargs)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message and message.startswith(f"{SOURCE}: ")
    return message


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa", "tiny-yarn"])
def test_transformers_state_dict_passes(preset):
    state = _olmo3_state(preset)
    validate_hf_tensors(get_preset(preset), _shapes(state), SOURCE, dtypes={k: t.dtype for k, t in state.items()})


def _drop_two(shapes):
    del shapes["model.layers.2.self_attn.k_norm.weight"], shapes["model.layers.3.mlp.up_proj.weight"]


def _extra_layer(shapes):
    shapes["model.layers.4.mlp.up_proj.weight"] = (192, 64)


def _wrong_kv_width(shapes):
    for i in range(4):
        shapes[f"model.layers.{i}.self_attn.k_proj.weight"] = (32, 64)


def _other_vocab(shapes):
    shapes["model.embed_tokens.weight"] = shapes["lm_head.weight"] = (4224, 64)


def _other_d_model(shapes):
    shapes["model.embed_tokens.weight"] = (4096, 128)


@pytest.mark.parametrize(
    ("corrupt", "needles"),
    [
        (
            _drop_two,
            [
                "missing tensor 'model.layers.2.self_attn.k_norm.weight' (expected shape (64,)) (and 1 more)",
                "spec_from_hf_config",
            ],
        ),
        (
            _extra_layer,
            [
                "unexpected tensor 'model.layers.4.mlp.up_proj.weight' is not a parameter of spec 'tiny'",
                "more layers than n_layers=4",
            ],
        ),
        (
            _wrong_kv_width,
            [
                "tensor 'model.layers.0.self_attn.k_proj.weight' has shape (32, 64), expected (64, 64) "
                "(and 3 more) for spec 'tiny'",
                "n_kv_heads",
            ],
        ),
        (
            _other_vocab,
            [
                "vocab mismatch in 'model.embed_tokens.weight': checkpoint has 4224 rows, "
                "spec padded_vocab_size is 4096",
                "set padded_vocab_size",
            ],
        ),
        # Rows fit but the width does not: a size mismatch, not a vocab one.
        (_other_d_model, ["tensor 'model.embed_tokens.weight' has shape (4096, 128), expected (4096, 64)"]),
    ],
    ids=["missing", "unexpected", "shape", "vocab", "d_model"],
)
def test_bad_tensors_are_one_line_naming_tensor_shapes_and_fix(corrupt, needles):
    shapes = _shapes(_olmo3_state("tiny"))
    corrupt(shapes)
    message = _error(get_preset("tiny"), shapes)
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("dtype", [np.dtype(np.int64), torch.int32])
def test_integer_dtype_is_refused(dtype):
    spec = get_preset("tiny")
    shapes = _shapes(_olmo3_state("tiny"))
    dtypes = {name: torch.bfloat16 for name in shapes} | {"model.norm.weight": dtype}
    message = _error(spec, shapes, dtypes=dtypes)
    name = str(dtype).removeprefix("torch.")
    assert f"tensor 'model.norm.weight' has dtype {name}, expected a floating-point type" in message
    validate_hf_tensors(spec, shapes, SOURCE, dtypes={name: np.dtype(np.float32) for name in shapes})


def test_non_strict_skips_missing_and_extra_but_not_a_wrong_shape():
    spec = get_preset("tiny")
    shapes = _shapes(_olmo3_state("tiny"))
    del shapes["model.norm.weight"]
    shapes["model.layers.9.mlp.up_proj.weight"] = (3,)
    validate_hf_tensors(spec, shapes, SOURCE, strict=False)
    shapes["lm_head.weight"] = (4096, 65)
    assert "tensor 'lm_head.weight' has shape (4096, 65)" in _error(spec, shapes, strict=False)


@pytest.fixture(scope="module")
def olmoe():
    """An OLMoE model's config-derived spec and its transformers state dict (fused experts)."""
    cfg = transformers.OlmoeConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        eos_token_id=0,
        pad_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    state = transformers.OlmoeForCausalLM(cfg).state_dict()
    return spec_from_olmoe_config(cfg.to_dict(), source="olmoe/config.json"), state


def test_fused_olmoe_experts_point_to_hf_moe_and_split_ones_pass(olmoe):
    spec, state = olmoe
    # transformers' fused experts split per expert by hf_moe: our layout, which passes.
    split = {}
    for layer in range(spec.n_layers):
        block = {
            k.removeprefix(f"model.layers.{layer}.mlp."): v.numpy()
            for k, v in state.items()
            if k.startswith(f"model.layers.{layer}.mlp.")
        }
        split.update(block_tensors_from_olmoe(block, spec, layer))
    shapes = {n: tuple(t.shape) for n, t in state.items() if ".mlp." not in n and "input_layernorm" not in n}
    shapes |= {name: t.shape for name, t in split.items()}
    # OLMoE has no post_feedforward_layernorm; give the reordered-norm spec its own.
    shapes |= {f"model.layers.{i}.post_feedforward_layernorm.weight": (spec.d_model,) for i in range(spec.n_layers)}
    validate_hf_tensors(spec, shapes, SOURCE)

    # Layer 0's experts left as transformers holds them.
    fused = {k: v for k, v in shapes.items() if not k.startswith("model.layers.0.mlp.experts.")}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        fused[name] = tuple(state[name].shape)
    message = _error(spec, fused)
    assert "unexpected tensor 'model.layers.0.mlp.experts.gate_up_proj' (and 1 more)" in message
    assert "olmo_model.hf_moe.block_tensors_from_olmoe" in message

    prenorm = "model.layers.1.input_layernorm.weight"
    assert "a pre-norm (OLMoE/Llama) layer" in _error(spec, shapes | {prenorm: tuple(state[prenorm].shape)})


def test_moe_tensors_for_a_dense_spec_name_the_moe_section(olmoe):
    _, state = olmoe
    spec = get_preset("tiny")
    shapes = _shapes(_olmo3_state("tiny")) | {"model.layers.0.mlp.gate.weight": (4, 64)}
    message = _error(spec, shapes)
    assert "unexpected tensor 'model.layers.0.mlp.gate.weight'" in message
    assert "layer 0 of the spec is dense" in message and "spec_from_olmoe_config" in message
    down = "model.layers.0.mlp.experts.down_proj"
    fused = _shapes(_olmo3_state("tiny")) | {down: tuple(state[down].shape)}
    assert "an OLMoE checkpoint, but the spec has no moe section" in _error(spec, fused)


def test_dense_mlp_in_an_moe_layer_names_moe_layers():
    spec = get_preset("tiny-moe")
    shapes = _shapes(_olmo3_state("tiny"))  # a dense checkpoint of the same sizes
    message = _error(spec, shapes)
    assert "unexpected tensor 'model.layers.0.mlp.gate_proj.weight' (and 11 more)" in message
    assert "layer 0 of the spec is MoE: check moe.layers" in message

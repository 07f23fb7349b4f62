"""Spec validation messages and the HF config.json round trip through transformers."""

from __future__ import annotations

import math

import pytest
import transformers

from olmo_model import (
    SLIDING,
    SpecError,
    UnknownDeviceError,
    get_preset,
    hf_config,
    hf_param_shapes,
    load_spec,
    param_counts,
    resolve_device_kind,
    spec_from_dict,
    spec_from_hf_config,
)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa", "tiny-yarn", "olmo3-7b", "olmo3-32b"])
def test_hf_config_round_trip_through_transformers(preset):
    spec = get_preset(preset)
    cfg = transformers.Olmo3Config(**hf_config(spec)).to_dict()
    assert spec_from_hf_config(cfg) == spec


def test_hf_config_fields_transformers_reads():
    spec = get_preset("olmo3-32b")
    cfg = transformers.Olmo3Config(**hf_config(spec))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        5120,
        64,
        40,
        8,
    )
    assert cfg.intermediate_size == 27648 and cfg.vocab_size == 100352 and cfg.sliding_window == 4096
    assert cfg.layer_types[:4] == ["sliding_attention"] * 3 + ["full_attention"]
    yarn = transformers.Olmo3Config(**hf_config(get_preset("tiny-yarn"))).rope_parameters["full_attention"]
    assert yarn["rope_type"] == "yarn" and yarn["factor"] == 4.0 and yarn["original_max_position_embeddings"] == 64


def test_param_shapes_are_transformers_state_dict():
    spec = get_preset("tiny-gqa")
    model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**hf_config(spec)))
    theirs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert theirs == hf_param_shapes(spec)
    assert sum(math.prod(shape) for shape in theirs.values()) == param_counts(spec).total


def _one_line_error(exc_type, fn, *args):
    with pytest.raises(exc_type) as err:
        fn(*args)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_unknown_field():
    msg = _one_line_error(SpecError, spec_from_dict, {"preset": "tiny", "d_modle": 64}, "my.yaml")
    assert msg.startswith("my.yaml: unknown field 'd_modle'") and "remove it or use one of" in msg and "d_model" in msg


def test_heads_must_divide_d_model():
    msg = _one_line_error(SpecError, spec_from_dict, {"preset": "tiny", "n_heads": 5})
    assert "n_heads=5 does not divide d_model=64" in msg and "choose n_heads" in msg


def test_window_must_be_positive():
    msg = _one_line_error(SpecError, spec_from_dict, {"preset": "tiny", "sliding_window": 0})
    assert "sliding_window=0" in msg and "set sliding_window >= 1" in msg


def test_top_k_at_most_n_experts():
    msg = _one_line_error(
        SpecError, spec_from_dict, {"preset": "tiny", "moe": {"n_experts": 4, "top_k": 8, "expert_hidden": 32}}
    )
    assert "moe.top_k=8 exceeds moe.n_experts=4" in msg and "set top_k <= n_experts" in msg


def test_unknown_preset():
    msg = _one_line_error(SpecError, get_preset, "olmo3-8b")
    assert "unknown preset 'olmo3-8b'" in msg and "olmo3-7b" in msg and "spec file" in msg


def test_unknown_device_kind():
    msg = _one_line_error(UnknownDeviceError, resolve_device_kind, "Radeon 9000")
    assert "unknown device kind 'Radeon 9000'" in msg and "use one of" in msg


def test_spec_file_errors(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("d_model: [64\n")
    msg = _one_line_error(SpecError, load_spec, bad_yaml)
    assert msg.startswith(f"{bad_yaml}: not valid YAML") and "fix the file" in msg
    missing = tmp_path / "nope.yaml"
    assert "spec file not found" in _one_line_error(SpecError, load_spec, missing)
    good = tmp_path / "spec.yaml"
    good.write_text("preset: tiny\nsliding_window: 8\n")
    spec = load_spec(good)
    assert spec.sliding_window == 8 and spec.layer_types.count(SLIDING) == 3

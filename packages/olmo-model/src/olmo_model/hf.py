"""The interchange format: transformers' Olmo3 config.json and parameter names/shapes.

HF's ``vocab_size`` is the padded (embedding) size; the tokenizer's own vocab size and
the fields HF has no place for travel under ``olmo_*`` keys, which transformers keeps
as plain attributes, so a spec survives ModelSpec -> config.json -> ModelSpec exactly.

``validate_hf_tensors`` is the one check that a set of HF-named tensors fits a spec; the
Torch and JAX adapters and olmo-convert run it before they copy or write anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .presets import SpecError, spec_from_dict
from .spec import ModelSpec


def _check_olmo3_expressible(spec: ModelSpec) -> None:
    """A one-line SpecError naming the first field transformers' Olmo3 has no place for."""
    if spec.moe is not None:
        raise SpecError("hf_config: MoE specs use the OLMoE layout, not Olmo3; see olmo_model.hf_moe")
    if spec.norm_placement != "reordered":
        raise SpecError(
            f"hf_config: norm_placement='{spec.norm_placement}' cannot be expressed by Olmo3ForCausalLM "
            "(its blocks normalise the sublayer outputs); use norm_placement='reordered'"
        )
    if spec.embedding_norm or spec.embedding_scale is not None:
        raise SpecError(
            f"hf_config: embedding_norm={spec.embedding_norm}, embedding_scale={spec.embedding_scale} cannot be "
            "expressed by Olmo3ForCausalLM (its embedding output goes to the first layer as is); "
            "use embedding_norm: false and embedding_scale: null"
        )
    if spec.qk_norm != "full":
        raise SpecError(
            f"hf_config: qk_norm='{spec.qk_norm}' cannot be expressed by Olmo3ForCausalLM "
            "(it normalises q and k over the full width); use qk_norm='full'"
        )


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json contents for transformers' Olmo3ForCausalLM."""
    _check_olmo3_expressible(spec)
    sliding_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.yarn is not None:
        full_rope = {
            "rope_type": "yarn",
            "rope_theta": spec.rope_theta,
            "factor": spec.yarn.factor,
            "original_max_position_embeddings": spec.yarn.original_max_position_embeddings,
            "beta_fast": spec.yarn.beta_fast,
            "beta_slow": spec.yarn.beta_slow,
        }
        if spec.yarn.attention_factor is not None:
            full_rope["attention_factor"] = spec.yarn.attention_factor
    assert spec.layer_types is not None  # filled by ModelSpec._fill_layer_types
    return {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "vocab_size": spec.padded_vocab_size,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_hidden,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,  # transformers' Olmo3 honours it; OLMoE3 s001+ differ from d_model / heads
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.init_std,
        "pad_token_id": spec.pad_token_id,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
        "tie_word_embeddings": False,
        "rope_parameters": {"sliding_attention": sliding_rope, "full_attention": full_rope},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": spec.norm_eps,
        "sliding_window": spec.sliding_window,
        "layer_types": list(spec.layer_types),
        # Fields Olmo3Config has no slot for; transformers keeps them as attributes.
        "olmo_vocab_size": spec.vocab_size,
        "olmo_init_cutoff": spec.init_cutoff,
        "olmo_z_loss_weight": spec.z_loss_weight,
        "olmo_name": spec.name,
    }


def _rope_from_hf(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the yarn section or None) of an Olmo3 config.json: one theta for both layer
    types, YaRN (in rope_parameters or the legacy rope_scaling) on the full-attention layers only."""
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    sliding = rope.get("sliding_attention") or {}
    theta = full.get("rope_theta", cfg.get("rope_theta", 500_000.0))
    if sliding and sliding.get("rope_theta", theta) != theta:
        raise SpecError(f"{source}: different rope_theta per layer type is not supported")
    if sliding.get("rope_type", "default") != "default":
        raise SpecError(f"{source}: RoPE scaling on sliding layers is not supported (Olmo 3 scales global layers)")
    yarn = None
    legacy = cfg.get("rope_scaling") or {}
    if full.get("rope_type", "default") == "yarn" or (legacy and legacy.get("rope_type") == "yarn"):
        y = full if full.get("rope_type") == "yarn" else legacy
        yarn = {
            "factor": y["factor"],
            "original_max_position_embeddings": y["original_max_position_embeddings"],
            "beta_fast": y.get("beta_fast", 32.0),
            "beta_slow": y.get("beta_slow", 1.0),
            "attention_factor": y.get("attention_factor"),
        }
    elif full.get("rope_type", "default") != "default":
        raise SpecError(f"{source}: rope_type '{full['rope_type']}' is not supported (default or yarn)")
    return theta, yarn


def spec_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """A ModelSpec from an Olmo3 config.json dict (ours or one from the hub)."""
    model_type = cfg.get("model_type")
    if model_type not in (None, "olmo3"):
        raise SpecError(f"{source}: model_type '{model_type}' is not olmo3; convert an Olmo 3 checkpoint")
    if cfg.get("tie_word_embeddings"):
        raise SpecError(f"{source}: tie_word_embeddings=true, but Olmo 3 has an untied output head")
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecError(f"{source}: hidden_act '{cfg['hidden_act']}' is not silu (SwiGLU)")
    theta, yarn = _rope_from_hf(cfg, source)
    padded = cfg["vocab_size"]
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    data: dict[str, Any] = {
        "name": cfg.get("olmo_name"),
        "d_model": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        "head_dim": cfg.get("head_dim"),  # None: hidden_size / num_attention_heads
        "mlp_hidden": cfg["intermediate_size"],
        "vocab_size": cfg.get("olmo_vocab_size", padded),
        "padded_vocab_size": padded,
        "eos_token_id": eos,
        "pad_token_id": cfg.get("pad_token_id"),
        "bos_token_id": cfg.get("bos_token_id"),
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "qk_norm": "full",
        "rope_theta": theta,
        "yarn": yarn,
        "sliding_window": cfg.get("sliding_window"),
        "layer_types": tuple(cfg["layer_types"]) if cfg.get("layer_types") else None,
        "max_position_embeddings": cfg.get("max_position_embeddings", 65536),
        "init_std": cfg.get("initializer_range", 0.02),
    }
    if "olmo_init_cutoff" in cfg:
        data["init_cutoff"] = cfg["olmo_init_cutoff"]
    if "olmo_z_loss_weight" in cfg:
        data["z_loss_weight"] = cfg["olmo_z_loss_weight"]
    if data["n_kv_heads"] == data["n_heads"]:
        data["n_kv_heads"] = None
    return spec_from_dict(data, source=source)


def hf_param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical parameter names (transformers' Olmo3ForCausalLM) and shapes, in order.

    Linear weights are (out_features, in_features) as torch.nn.Linear stores them."""
    d = spec.d_model
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.padded_vocab_size, d)}
    if spec.embedding_norm:
        shapes["model.embed_norm.weight"] = (d,)
    peri = spec.norm_placement == "peri"
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        if peri:
            shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (spec.q_width, d)
        shapes[p + "self_attn.k_proj.weight"] = (spec.kv_width, d)
        shapes[p + "self_attn.v_proj.weight"] = (spec.kv_width, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, spec.q_width)
        if spec.qk_norm == "full":
            shapes[p + "self_attn.q_norm.weight"] = (spec.q_width,)
            shapes[p + "self_attn.k_norm.weight"] = (spec.kv_width,)
        elif spec.qk_norm == "per_head":
            shapes[p + "self_attn.q_norm.weight"] = (spec.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (spec.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if peri:
            shapes[p + "pre_feedforward_layernorm.weight"] = (d,)
        if spec.is_moe_layer(i):
            moe = spec.moe
            assert moe is not None
            shapes[p + "mlp.gate.weight"] = (moe.n_experts, d)
            for e in range(moe.n_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (moe.expert_hidden, d)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (moe.expert_hidden, d)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (d, moe.expert_hidden)
            for s in range(moe.n_shared_experts):
                shapes[p + f"mlp.shared_experts.{s}.gate_proj.weight"] = (moe.shared_hidden, d)
                shapes[p + f"mlp.shared_experts.{s}.up_proj.weight"] = (moe.shared_hidden, d)
                shapes[p + f"mlp.shared_experts.{s}.down_proj.weight"] = (d, moe.shared_hidden)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (spec.mlp_hidden, d)
            shapes[p + "mlp.up_proj.weight"] = (spec.mlp_hidden, d)
            shapes[p + "mlp.down_proj.weight"] = (d, spec.mlp_hidden)
        shapes[p + "post_feedforward_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (spec.padded_vocab_size, d)
    return shapes


VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MOE_SUFFIX = re.compile(r"mlp\.(gate\.weight|experts\.\d+\..+|shared_experts\.\d+\..+)")
_DENSE_MLP_SUFFIX = re.compile(r"mlp\.(gate|up|down)_proj\.weight")
# transformers 5 fuses OLMoE's per-expert weights in memory (olmo_model.hf_moe docstring).
_FUSED_EXPERTS_SUFFIX = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)")


class HFLayoutError(ValueError):
    """HF-named tensors that do not fit a spec; the one-line message names the source, the
    tensor, what the spec expects, what was found and the fix."""


def _unexpected_fix(spec: ModelSpec, name: str) -> str:
    """The fix for an unexpected tensor, as specific as its name allows."""
    generic = (
        "build the spec from the checkpoint's config.json (olmo_model.spec_from_hf_config), "
        "or check n_layers/qk_norm/moe"
    )
    if name == "model.embed_norm.weight":
        return "an embedding norm (OLMo-core 3's embedding_norm): set embedding_norm: true (and its embedding_scale)"
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        return generic
    layer, suffix = int(match[1]), match[2]
    if layer >= spec.n_layers:
        return f"the checkpoint has more layers than n_layers={spec.n_layers}; {generic}"
    if _FUSED_EXPERTS_SUFFIX.fullmatch(suffix):
        if spec.moe is None:
            return (
                "an OLMoE checkpoint, but the spec has no moe section: "
                "build it with olmo_model.hf_moe.spec_from_olmoe_config"
            )
        return (
            "transformers' fused OLMoE expert layout: split each layer with olmo_model.hf_moe.block_tensors_from_olmoe"
        )
    if suffix == "input_layernorm.weight":
        return (
            "a pre-norm (OLMoE/Llama) layer: for an OLMoE checkpoint build the spec with "
            "olmo_model.hf_moe.spec_from_olmoe_config (norm_placement='pre') and convert the "
            "tensors with olmo_model.hf_moe.tensors_from_olmoe; with pre_feedforward_layernorm as well, "
            "a peri-norm model (OLMo-core 3's use_peri_norm): set norm_placement: peri"
        )
    if suffix == "pre_feedforward_layernorm.weight":
        return "a peri-norm layer (input norms besides the output norms, OLMo-core 3): set norm_placement: peri"
    if _MOE_SUFFIX.fullmatch(suffix) and not spec.is_moe_layer(layer):
        return (
            f"an MoE tensor, but layer {layer} of the spec is dense: give the spec a moe section "
            "(olmo_model.hf_moe.spec_from_olmoe_config for an OLMoE config) or include the layer in moe.layers"
        )
    if _DENSE_MLP_SUFFIX.fullmatch(suffix) and spec.is_moe_layer(layer):
        return f"a dense MLP tensor, but layer {layer} of the spec is MoE: check moe.layers"
    if suffix.startswith("mlp.") and spec.moe is not None:
        return f"check moe.n_experts={spec.moe.n_experts} and moe.n_shared_experts={spec.moe.n_shared_experts}"
    return generic


def _more(names: Sequence[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _check_names(
    spec: ModelSpec, expected: dict[str, tuple[int, ...]], shapes: Mapping[str, Sequence[int]], source: str
) -> None:
    """No unexpected and no missing tensor (validate_hf_tensors' strict checks)."""
    unexpected = [name for name in shapes if name not in expected]
    if unexpected:
        name = unexpected[0]
        raise HFLayoutError(
            f"{source}: unexpected tensor '{name}'{_more(unexpected)} is not a parameter of spec '{spec.name}' "
            f"(n_layers={spec.n_layers}, qk_norm={spec.qk_norm}, moe={spec.moe is not None}); "
            f"{_unexpected_fix(spec, name)}"
        )
    missing = [name for name in expected if name not in shapes]
    if missing:
        name = missing[0]
        raise HFLayoutError(
            f"{source}: missing tensor '{name}' (expected shape {expected[name]}){_more(missing)} for spec "
            f"'{spec.name}'; the checkpoint is incomplete or was written for another spec: build the spec "
            "from its config.json (olmo_model.spec_from_hf_config)"
        )


def validate_hf_tensors(
    spec: ModelSpec,
    shapes: Mapping[str, Sequence[int]],
    source: str,
    *,
    strict: bool = True,
    dtypes: Mapping[str, Any] | None = None,
) -> None:
    """Raise one ``HFLayoutError`` line unless the HF-named tensors ``shapes`` (name -> shape)
    are exactly ``hf_param_shapes(spec)``; messages start with ``source`` (the file or folder).

    Checked in this order, the first failure reported (with a count of the others of its kind):
    unexpected names, missing names, a vocab mismatch (embedding or head rows differ from
    padded_vocab_size, the rest of the shape fits), a wrong shape, and, when ``dtypes`` (name ->
    dtype, as numpy or torch print it: ``float32``, ``torch.bfloat16``) is given, a
    non-floating dtype. ``strict=False`` ignores unexpected and skips missing tensors; a wrong
    shape or dtype is always an error."""
    expected = hf_param_shapes(spec)
    if strict:
        _check_names(spec, expected, shapes, source)
    present = [name for name in expected if name in shapes]
    wrong = [name for name in present if tuple(shapes[name]) != expected[name]]
    for name in wrong:
        got, want = tuple(shapes[name]), expected[name]
        if name in VOCAB_TENSORS and len(got) == len(want) and got[1:] == want[1:]:
            raise HFLayoutError(
                f"{source}: vocab mismatch in '{name}': checkpoint has {got[0]} rows, spec padded_vocab_size is "
                f"{spec.padded_vocab_size}; set padded_vocab_size (and vocab_size) to the checkpoint's "
                "(olmo_model.spec_from_hf_config reads them from its config.json)"
            )
    if wrong:
        name = wrong[0]
        raise HFLayoutError(
            f"{source}: tensor '{name}' has shape {tuple(shapes[name])}, expected {expected[name]}{_more(wrong)} "
            f"for spec '{spec.name}'; the checkpoint was written for another model size: build the spec from its "
            "config.json (check d_model, n_heads, n_kv_heads, mlp_hidden, moe)"
        )
    if dtypes is None:
        return
    for name in present:
        dtype = str(dtypes[name]).removeprefix("torch.")
        if not dtype.startswith(("float", "bfloat")):
            raise HFLayoutError(
                f"{source}: tensor '{name}' has dtype {dtype}, expected a floating-point type; "
                "re-export the weights as float32 or bfloat16"
            )

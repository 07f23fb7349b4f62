"""OLMoE interop: transformers' ``OlmoeForCausalLM`` config and tensor layout.

- the MoE block is the same maths: a softmax router ``mlp.gate.weight`` [E, d], top-k
  (``num_experts_per_tok``) with optional renormalisation (``norm_topk_prob``), SwiGLU
  experts, no shared expert. OLMoE checkpoints on the hub store experts one by one
  under exactly our names (``mlp.experts.{e}.{gate,up,down}_proj.weight``);
  transformers 5 fuses them in memory into ``mlp.experts.gate_up_proj`` [E, 2*hidden, d]
  (gate rows first, then up) and ``mlp.experts.down_proj`` [E, d, hidden]
  (``olmoe_block_tensors`` / ``block_tensors_from_olmoe`` convert one layer);
- the decoder layer is pre-norm (``input_layernorm`` before attention,
  ``post_attention_layernorm`` before the MLP): a spec with ``norm_placement="pre"``. Our
  tensor names keep one slot per sublayer norm whatever its placement, so
  ``olmoe_state_dict`` / ``tensors_from_olmoe`` map our ``post_attention_layernorm`` (the
  attention sublayer's norm) to OLMoE's ``input_layernorm`` and our
  ``post_feedforward_layernorm`` (the MLP sublayer's) to OLMoE's ``post_attention_layernorm``.

``olmoe_config(spec)`` writes the OlmoeConfig of the same model for the specs OLMoE can
express (pre-norm, not peri-norm; no embedding scale or norm; no shared expert, softmax router with weights summing to 1 at most (no
``restore_weight_scale``), every layer MoE, full attention, QK-norm over the full width, heads
of d_model / n_heads, no YaRN); ``spec_from_olmoe_config`` reads one back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .presets import SpecError, spec_from_dict
from .spec import SLIDING, ModelSpec


def _check_expressible(spec: ModelSpec) -> None:
    moe = spec.moe
    if moe is None:
        raise SpecError("olmoe_config: the spec has no moe section; dense specs use olmo_model.hf_config (Olmo3)")
    assert spec.layer_types is not None  # filled by ModelSpec._fill_layer_types
    problems = [
        (
            spec.norm_placement != "pre",
            f"norm_placement='{spec.norm_placement}'",
            "use 'pre' (OLMoE normalises the sublayer inputs)",
        ),
        (
            moe.n_shared_experts > 0,
            f"moe.n_shared_experts={moe.n_shared_experts}",
            "set it to 0 (OLMoE has no shared expert)",
        ),
        (
            spec.embedding_norm or spec.embedding_scale is not None,
            f"embedding_norm={spec.embedding_norm}, embedding_scale={spec.embedding_scale}",
            "set embedding_norm: false and embedding_scale: null (OLMoE feeds the raw embedding to layer 0)",
        ),
        (moe.gating != "softmax", f"moe.gating='{moe.gating}'", "use softmax (OLMoE's router)"),
        (moe.layers is not None, "moe.layers is set", "make every layer MoE (null), as in OLMoE"),
        (SLIDING in spec.layer_types, "sliding-window layers", "set sliding_window: null (OLMoE attends globally)"),
        (
            spec.qk_norm != "full",
            f"qk_norm='{spec.qk_norm}'",
            "use 'full' (OLMoE normalises q and k over the full width)",
        ),
        (spec.yarn is not None, "yarn", "remove yarn (OLMoE's config here uses default RoPE)"),
        (
            moe.restore_weight_scale,
            "moe.restore_weight_scale (top-k weights summing to top_k)",
            "set it to false (OLMoE's router weights sum to 1 at most)",
        ),
        (
            spec.q_width != spec.d_model,
            f"head_dim={spec.head_dim} (n_heads * head_dim = {spec.q_width} != d_model = {spec.d_model})",
            "use head_dim = d_model / n_heads (OLMoE's q_norm spans hidden_size)",
        ),
    ]
    for bad, what, fix in problems:
        if bad:
            raise SpecError(f"olmoe_config: {what} cannot be expressed by OlmoeForCausalLM; {fix}")


def olmoe_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json contents for transformers' OlmoeForCausalLM with the sizes of ``spec``."""
    _check_expressible(spec)
    moe = spec.moe
    assert moe is not None
    return {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "vocab_size": spec.padded_vocab_size,
        "hidden_size": spec.d_model,
        "intermediate_size": moe.expert_hidden,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.init_std,
        "rms_norm_eps": spec.norm_eps,
        "pad_token_id": spec.pad_token_id,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.normalize_top_k,
        "router_aux_loss_coef": moe.load_balancing_loss_weight,
        # Fields OlmoeConfig has no slot for; transformers keeps them as attributes.
        "olmo_vocab_size": spec.vocab_size,
        "olmo_router_z_loss_weight": moe.router_z_loss_weight,
        "olmo_z_loss_weight": spec.z_loss_weight,
        "olmo_init_cutoff": spec.init_cutoff,
        "olmo_name": spec.name,
    }


def spec_from_olmoe_config(cfg: Mapping[str, Any], source: str = "config.json") -> ModelSpec:
    """The ModelSpec of an OLMoE config (ours or the hub's): pre-norm blocks, its sizes and
    MoE routing."""
    if cfg.get("model_type") not in (None, "olmoe"):
        raise SpecError(f"{source}: model_type '{cfg.get('model_type')}' is not olmoe; pass an OLMoE config.json")
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecError(f"{source}: hidden_act '{cfg['hidden_act']}' is not silu (SwiGLU experts)")
    if cfg.get("clip_qkv") is not None:
        raise SpecError(
            f"{source}: clip_qkv={cfg['clip_qkv']} has no place in the spec; use a checkpoint trained without it"
        )
    if cfg.get("tie_word_embeddings"):
        raise SpecError(f"{source}: tie_word_embeddings=true, but the spec has an untied output head")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise SpecError(f"{source}: rope_type '{rope['rope_type']}' is not supported for OLMoE (default RoPE only)")
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    padded = cfg["vocab_size"]
    moe: dict[str, Any] = {
        "n_experts": cfg["num_experts"],
        "top_k": cfg["num_experts_per_tok"],
        "expert_hidden": cfg["intermediate_size"],
        "normalize_top_k": bool(cfg.get("norm_topk_prob", False)),
        "load_balancing_loss_weight": cfg.get("router_aux_loss_coef", 0.01),
    }
    if "olmo_router_z_loss_weight" in cfg:
        moe["router_z_loss_weight"] = cfg["olmo_router_z_loss_weight"]
    heads = cfg["num_attention_heads"]
    data: dict[str, Any] = {
        "name": cfg.get("olmo_name"),
        "d_model": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": None if cfg.get("num_key_value_heads", heads) == heads else cfg["num_key_value_heads"],
        "mlp_hidden": cfg["intermediate_size"],  # unused: every layer is MoE
        "vocab_size": cfg.get("olmo_vocab_size", padded),
        "padded_vocab_size": padded,
        "eos_token_id": eos,
        "pad_token_id": cfg.get("pad_token_id"),
        "bos_token_id": cfg.get("bos_token_id"),
        "norm_eps": cfg.get("rms_norm_eps", 1e-5),
        "qk_norm": "full",
        "norm_placement": "pre",
        "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)),
        "sliding_window": None,
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "init_std": cfg.get("initializer_range", 0.02),
        "moe": moe,
    }
    for key, field in (("olmo_z_loss_weight", "z_loss_weight"), ("olmo_init_cutoff", "init_cutoff")):
        if key in cfg:
            data[field] = cfg[key]
    return spec_from_dict(data, source=source)


def olmoe_block_tensors(tensors: Mapping[str, np.ndarray], spec: ModelSpec, layer: int) -> dict[str, np.ndarray]:
    """Layer ``layer``'s MoE tensors (our HF names) as ``OlmoeSparseMoeBlock.state_dict()``
    keys: ``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``."""
    moe = spec.moe
    if moe is None or not spec.is_moe_layer(layer):
        raise SpecError(f"olmoe_block_tensors: layer {layer} is not an MoE layer of spec '{spec.name}'")
    if moe.n_shared_experts:
        raise SpecError(
            f"olmoe_block_tensors: spec '{spec.name}' has {moe.n_shared_experts} shared expert(s), "
            "which OlmoeSparseMoeBlock cannot hold; use n_shared_experts=0"
        )
    p = f"model.layers.{layer}.mlp."

    def get(name: str) -> np.ndarray:
        if p + name not in tensors:
            raise SpecError(f"olmoe_block_tensors: tensor '{p + name}' is missing; pass every tensor of the layer")
        return np.asarray(tensors[p + name])

    experts = range(moe.n_experts)
    gate_up = np.stack(
        [np.concatenate([get(f"experts.{e}.gate_proj.weight"), get(f"experts.{e}.up_proj.weight")]) for e in experts]
    )
    down = np.stack([get(f"experts.{e}.down_proj.weight") for e in experts])
    return {"gate.weight": get("gate.weight"), "experts.gate_up_proj": gate_up, "experts.down_proj": down}


def block_tensors_from_olmoe(block: Mapping[str, np.ndarray], spec: ModelSpec, layer: int) -> dict[str, np.ndarray]:
    """The inverse of ``olmoe_block_tensors``: OLMoE block tensors -> our HF names."""
    moe = spec.moe
    if moe is None:
        raise SpecError(f"block_tensors_from_olmoe: spec '{spec.name}' has no moe section")
    hidden, d = moe.expert_hidden, spec.d_model
    expected = {
        "gate.weight": (moe.n_experts, d),
        "experts.gate_up_proj": (moe.n_experts, 2 * hidden, d),
        "experts.down_proj": (moe.n_experts, d, hidden),
    }
    for name, shape in expected.items():
        got = tuple(np.shape(block[name])) if name in block else None
        if got != shape:
            raise SpecError(
                f"block_tensors_from_olmoe: '{name}' has shape {got}, spec '{spec.name}' needs {shape}; "
                "build the spec with spec_from_olmoe_config from the checkpoint's config"
            )
    p = f"model.layers.{layer}.mlp."
    out = {p + "gate.weight": np.asarray(block["gate.weight"])}
    gate_up, down = np.asarray(block["experts.gate_up_proj"]), np.asarray(block["experts.down_proj"])
    for e in range(moe.n_experts):
        out[p + f"experts.{e}.gate_proj.weight"] = gate_up[e, :hidden]
        out[p + f"experts.{e}.up_proj.weight"] = gate_up[e, hidden:]
        out[p + f"experts.{e}.down_proj.weight"] = down[e]
    return out


# Per-layer tensors whose names differ between our layout and OLMoE's (the sublayer norms).
_NORMS_TO_OLMOE = {
    "post_attention_layernorm.weight": "input_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_attention_layernorm.weight",
}


def _rename_norm(name: str, table: Mapping[str, str]) -> str:
    """model.layers.L.<suffix> -> model.layers.L.<table[suffix]> for the norm suffixes in table."""
    parts = name.split(".")
    suffix = ".".join(parts[3:])
    if name.startswith("model.layers.") and suffix in table:
        return ".".join(parts[:3]) + "." + table[suffix]
    return name


def olmoe_state_dict(tensors: Mapping[str, np.ndarray], spec: ModelSpec) -> dict[str, np.ndarray]:
    """A whole model's tensors (our HF names, as ``to_hf`` writes them) -> an
    ``OlmoeForCausalLM.state_dict()`` of transformers 5 (fused experts, OLMoE norm names)."""
    _check_expressible(spec)
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if ".mlp." in name:
            continue  # each layer's MoE block below
        out[_rename_norm(name, _NORMS_TO_OLMOE)] = np.asarray(value)
    for layer in range(spec.n_layers):
        for key, value in olmoe_block_tensors(tensors, spec, layer).items():
            out[f"model.layers.{layer}.mlp.{key}"] = value
    return out


def tensors_from_olmoe(state: Mapping[str, np.ndarray], spec: ModelSpec) -> dict[str, np.ndarray]:
    """The inverse of ``olmoe_state_dict``: an OlmoeForCausalLM state dict -> our HF names
    (then ``load_hf`` / ``model_from_hf`` in either trainer, which check every shape)."""
    _check_expressible(spec)
    back = {v: k for k, v in _NORMS_TO_OLMOE.items()}
    out: dict[str, np.ndarray] = {}
    blocks: dict[int, dict[str, np.ndarray]] = {}
    for name, value in state.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[3] == "mlp":
            blocks.setdefault(int(parts[2]), {})[".".join(parts[4:])] = np.asarray(value)
            continue
        out[_rename_norm(name, back)] = np.asarray(value)
    for layer in range(spec.n_layers):
        if layer not in blocks:
            raise SpecError(
                f"tensors_from_olmoe: layer {layer} has no mlp tensors; the spec has {spec.n_layers} layers"
            )
        out.update(block_tensors_from_olmoe(blocks[layer], spec, layer))
    return out

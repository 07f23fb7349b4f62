"""hf: folders of transformers' ``OlmoeForCausalLM`` (an MoE spec OLMoE can express: pre-norm, no
shared expert, no restored weight scale; ``olmo_model.hf_moe.olmoe_config`` says which field when
not): config.json from ``olmoe_config``, tensors in the layout of the OLMoE checkpoints on the hub,
which transformers 5 fuses on load (its ``qwen2_moe`` conversion) and vLLM reads as is.

That layout is our interchange names with the experts one by one (``mlp.experts.{e}.{gate,up,down}
_proj.weight``, ``mlp.gate.weight``); only the two sublayer norms are named after their OLMoE
position (as ``olmo_model.hf_moe.olmoe_state_dict`` renames them): our ``post_attention_layernorm``
(the attention sublayer's norm, before it in a pre-norm block) is OLMoE's ``input_layernorm``, our
``post_feedforward_layernorm`` (the MLP's) is OLMoE's ``post_attention_layernorm``.
"""

from __future__ import annotations

import re
from typing import Any

from .checkpoint import CheckpointError

_NORMS_TO_FILE = {
    "post_attention_layernorm.weight": "input_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_attention_layernorm.weight",
}
_NORMS_FROM_FILE = {v: k for k, v in _NORMS_TO_FILE.items()}
_LAYER_KEY = re.compile(r"(model\.layers\.\d+\.)(.+)")
# transformers' in-memory fused experts, which a file of the hub layout never holds.
_FUSED = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")


def is_olmoe(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "olmoe"


def _rename(name: str, table: dict[str, str]) -> str:
    m = _LAYER_KEY.fullmatch(name)
    return m.group(1) + table[m.group(2)] if m and m.group(2) in table else name


def olmoe_file_name(name: str) -> str:
    """The name an interchange tensor has in an OLMoE safetensors file."""
    return _rename(name, _NORMS_TO_FILE)


def name_from_olmoe_file(name: str, origin: str) -> str:
    """The interchange name of a tensor of an OLMoE safetensors file (``origin`` names the file)."""
    if _FUSED.fullmatch(name):
        raise CheckpointError(
            f"{origin}: tensor '{name}' is transformers' fused expert layout; save the folder with "
            "transformers' save_pretrained (it writes the experts one by one) or split it with "
            "olmo_model.hf_moe.tensors_from_olmoe"
        )
    return _rename(name, _NORMS_FROM_FILE)

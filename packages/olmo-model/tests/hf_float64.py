"""Run transformers' Olmo 3 / OLMoE code in true float64 for the reference comparisons.

transformers keeps three computations in float32 even after ``model.double()``: RMSNorm
upcasts to float32, the RoPE tables are built from float32 frequencies, and the OLMoE
router softmax asks for dtype=float. Left alone they cap agreement at ~1e-7, so the
fixtures here swap those three for the same formulas without the float32 casts; every
other line (block order, QK-norm placement, masks, GQA, expert dispatch) is transformers'.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def rms_norm_float64(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def olmo3_rope_float64(self, x, position_ids, layer_type):
    inv_freq = getattr(self, f"{layer_type}_inv_freq").to(torch.float64)
    scale = getattr(self, f"{layer_type}_attention_scaling")
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def olmoe_router_float64(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dim=-1)
    top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, top_index


def to_torch(params: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.asarray(value, dtype=np.float64)) for name, value in params.items()}

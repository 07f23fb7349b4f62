"""Fixtures that run transformers' Olmo 3 / OLMoE code in true float64 for the reference
comparisons.

transformers keeps three computations in float32 even after ``model.double()``: RMSNorm
upcasts to float32, the RoPE tables are built from float32 frequencies, and the OLMoE
router softmax asks for dtype=float. Left alone they cap agreement at ~1e-7, so the
fixtures here swap those three for the same formulas without the float32 casts; every
other line (block order, QK-norm placement, masks, GQA, expert dispatch) is transformers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.olmo3 import modeling_olmo3
from transformers.models.olmoe import modeling_olmoe


def _rms_norm_float64(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _olmo3_rope_float64(self, x, position_ids, layer_type):
    inv_freq = getattr(self, f"{layer_type}_inv_freq").to(torch.float64)
    scale = getattr(self, f"{layer_type}_attention_scaling")
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def _olmoe_router_float64(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dim=-1)
    top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, top_index


@pytest.fixture
def olmo3_float64(monkeypatch):
    monkeypatch.setattr(modeling_olmo3.Olmo3RMSNorm, "forward", _rms_norm_float64)
    monkeypatch.setattr(modeling_olmo3.Olmo3RotaryEmbedding, "forward", _olmo3_rope_float64)


@pytest.fixture
def olmoe_float64(monkeypatch):
    monkeypatch.setattr(modeling_olmoe.OlmoeTopKRouter, "forward", _olmoe_router_float64)

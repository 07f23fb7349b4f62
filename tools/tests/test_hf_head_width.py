"""An HF export of a spec whose head width is not d_model / n_heads (OLMoE3-dev-s001 and larger:
24 heads x 128 at d_model 2560) writes `head_dim` into config.json, so transformers' own
Olmo3ForCausalLM builds the same shapes and computes our torch model's logits; the config
reads back into the same spec. The reference is transformers' forward, independent of ours.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from transformers import Olmo3ForCausalLM

from olmo_model import get_preset, hf_config, spec_from_hf_config
from olmo_train_torch import initial_model, to_hf


def test_a_wider_head_than_d_model_over_heads_exports_to_transformers(tmp_path):
    # 4 heads x 24 = 96 query width at d_model 64: neither 64 / 4 nor a divisor relation.
    spec = get_preset("tiny-gqa").replace(head_dim=24)
    assert spec.q_width == 96 and spec.kv_width == 48
    model = initial_model(spec, seed=3).eval()
    cfg = hf_config(spec)
    assert cfg["head_dim"] == 24
    back = spec_from_hf_config(cfg)
    assert (back.head_dim, back.q_width, back.kv_width) == (24, 96, 48)

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in to_hf(model, spec).items()}, str(tmp_path / "model.safetensors"))
    hf = Olmo3ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens).logits.float()
        theirs = hf(tokens).logits.float()
    # fp32, the same products summed in a different order by two implementations: ~1e-6 of O(1)
    # logits over 4 layers; a wrong head width fails at load or moves logits by O(1).
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()

"""An MoE spec that transformers' OLMoE can express (pre-norm, no shared expert, no restored weight
scale, heads of d_model / n_heads) exports to hf: as an ``OlmoeForCausalLM`` folder, the OLMoE hub
layout (olmo_tools.hf_olmoe): transformers' own model (the independent reference) loads it with no
missing or unexpected tensor and computes our torch model's logits; the folder reads back, to
torch:, bitwise. OLMo-core 3's MoE (tiny-olmoe3) is still refused, with olmoe_config's reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from olmo_model import get_preset, hf_param_shapes
from olmo_tools.checkpoint import Checkpoint, spec_disagreement
from olmo_tools.convert import main
from olmo_tools.dcp import DCPDir
from olmo_tools.formats import HFCheckpoint
from olmo_tools.native import write_jax
from olmo_train_torch import initial_model, model_from_hf, to_hf

SEQ = 40
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # DCP notes on every call that it runs without a process group, which is intended here.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def _olmoe_spec():
    """tiny-moe (4 layers, 8 experts, top 4) as OLMoE has it: pre-norm, global attention, no shared
    expert, renormalised top-k; mlp_hidden is the expert width, as OLMoE's config reads back."""
    spec = get_preset("tiny-moe")
    moe = spec.moe.model_copy(update=dict(n_shared_experts=0, normalize_top_k=True))
    return spec.replace(
        name="tiny-olmoe", sliding_window=None, norm_placement="pre", mlp_hidden=moe.expert_hidden, moe=moe.model_dump()
    )


class _Tensors(Checkpoint):
    def __init__(self, spec, tensors):
        self.origin, self.spec, self._t = "memory", spec, tensors
        self.stored = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}

    def tensor(self, name):
        return self._t[name]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A jax: checkpoint (torch: MoE folders are written, not read) of initial_model's weights, its
    norms set to U(0.5, 1.5), -> hf:."""
    spec = _olmoe_spec()
    tensors = {k: v.detach().contiguous() for k, v in to_hf(initial_model(spec, seed=5), spec).items()}
    # Norm weights off their initial 1 (as after training), so a misplaced norm changes the logits.
    gen = torch.Generator().manual_seed(6)
    for name in [n for n in tensors if "norm" in n]:
        tensors[name] = 0.5 + torch.rand(tensors[name].shape, generator=gen)
    model = model_from_hf(spec, tensors, torch.float32).eval()
    root = tmp_path_factory.mktemp("olmoe")
    write_jax(root / "jax", _Tensors(spec, tensors), "float32")
    assert main([f"jax:{root / 'jax'}", f"hf:{root / 'hf'}"]) == 0
    return spec, model, tensors, root


def test_transformers_olmoe_loads_the_export_and_computes_our_logits(exported):
    from transformers import OlmoeForCausalLM

    spec, model, _, root = exported
    assert json.loads((root / "hf" / "config.json").read_text())["architectures"] == ["OlmoeForCausalLM"]
    hf, info = OlmoeForCausalLM.from_pretrained(root / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    ids = torch.from_numpy(np.random.default_rng(9).integers(0, spec.vocab_size, (2, SEQ)))
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf.eval()(input_ids=ids).logits
    # fp32, the same weights; the two implementations sum the same products in another order (and
    # transformers adds the experts' outputs in another order): ~1e-7 relative per op over 4 layers
    # of O(1) activations gives ~1e-6 on O(1) logits (measured: 3.0e-7 at max |logit| 0.78). A swapped norm moves them by far more
    # (test_the_norm_names_matter).
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-5, err
    assert ours.abs().max().item() > 0.1  # the logits are not trivially small


def test_the_export_reads_back_to_the_same_tensors_and_torch_state(exported, tmp_path):
    spec, model, tensors, root = exported
    with HFCheckpoint(root / "hf") as ckpt:
        assert spec_disagreement(ckpt.spec, spec) == []
        assert sorted(ckpt.stored) == sorted(hf_param_shapes(spec))
        for name, want in tensors.items():
            assert torch.equal(ckpt.tensor(name), want), name
    assert main([f"hf:{root / 'hf'}", f"torch:{tmp_path / 'torch'}"]) == 0
    state = DCPDir(tmp_path / "torch")
    want_state = model.state_dict()
    assert sorted(state.tensors) == sorted(want_state)
    for key, want in want_state.items():
        assert torch.equal(state.load(key), want), key


def test_the_norm_names_matter(exported, tmp_path):
    """The discriminating check: the same folder with OLMoE's two norm names swapped loads into
    transformers without complaint but computes other logits."""
    from safetensors.torch import load_file, save_file
    from transformers import OlmoeForCausalLM

    spec, model, _, root = exported
    state = load_file(root / "hf" / "model.safetensors")
    swap = {"input_layernorm": "post_attention_layernorm", "post_attention_layernorm": "input_layernorm"}
    swapped = {}
    for name, t in state.items():
        parts = name.split(".")
        if len(parts) == 5 and parts[3] in swap:
            parts[3] = swap[parts[3]]
        swapped[".".join(parts)] = t
    (tmp_path / "config.json").write_text((root / "hf" / "config.json").read_text())
    save_file(swapped, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = OlmoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.random.default_rng(9).integers(0, spec.vocab_size, (2, SEQ)))
    with torch.no_grad():
        assert (model(ids).logits - hf(input_ids=ids).logits).abs().max().item() > 1e-2


def test_an_olmo_core_3_moe_spec_is_still_refused_in_one_line(tmp_path, capsys):
    spec = get_preset("tiny-olmoe3")
    model = initial_model(spec, seed=1)
    tensors = {k: v.detach().contiguous() for k, v in to_hf(model, spec).items()}
    write_jax(tmp_path / "jax", _Tensors(spec, tensors), "float32")
    assert main([f"jax:{tmp_path / 'jax'}", f"hf:{tmp_path / 'hf'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "spec 'tiny-olmoe3' is MoE and hf: holds the dense Olmo3 layout (olmoe_config:" in err
    assert "cannot be expressed by OlmoeForCausalLM" in err and "convert to olmo-core:, torch: or jax:" in err
    assert not (tmp_path / "hf").exists()

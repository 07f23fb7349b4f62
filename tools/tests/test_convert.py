"""olmo-convert: every format round-trips to the same logits, and bad input fails cleanly.

References are independent of olmo_tools: our torch model (olmo_train_torch) run directly,
transformers' Olmo3ForCausalLM loading our files, and an OLMo-core key layout written out
in this file by hand (ai2-olmo-core is not installed). Tiny specs, sequences longer than
the sliding window so both attention kinds run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from olmo_model import get_preset, hf_config, hf_param_shapes
from olmo_tools.checkpoint import CheckpointError
from olmo_tools.convert import convert, main
from olmo_tools.formats import HFCheckpoint
from olmo_tools.parity import load_side
from olmo_train_torch import initial_model, model_from_hf, to_hf

SEQ = 80  # > window 32 of the tiny presets: sliding and global layers both matter
# DCP notes on every call that it runs without a process group, which is intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# OLMo-core olmo3 names, written out independently of olmo_tools.formats (from
# OLMo-core's olmo_core/nn/transformer/block.py ReorderedNormTransformerBlock and
# olmo_core/nn/hf/convert.py).
OLMO_CORE_TOP = {
    "model.embed_tokens.weight": "embeddings.weight",
    "model.norm.weight": "lm_head.norm.weight",
    "lm_head.weight": "lm_head.w_out.weight",
}
OLMO_CORE_LAYER = {
    "self_attn.q_proj.weight": "attention.w_q.weight",
    "self_attn.k_proj.weight": "attention.w_k.weight",
    "self_attn.v_proj.weight": "attention.w_v.weight",
    "self_attn.o_proj.weight": "attention.w_out.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "attention_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "post_feedforward_layernorm.weight": "feed_forward_norm.weight",
}


def olmo_core_key(hf_name: str) -> str:
    if hf_name in OLMO_CORE_TOP:
        return OLMO_CORE_TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blocks.{layer}.{OLMO_CORE_LAYER[rest]}"


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def transformers_logits(path: Path, ids: np.ndarray, dtype=torch.float32) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def write_torch_dir(path: Path, model) -> None:
    """Our torch format as the trainer would write it: the state dict in DCP + spec.json."""
    path.mkdir(parents=True)
    dcp.save(model.state_dict(), checkpoint_id=str(path), no_dist=True)
    (path / "spec.json").write_text(model.spec.model_dump_json())


def write_hf_dir(path: Path, spec, tensors: dict[str, torch.Tensor]) -> None:
    """An HF folder written with safetensors' own writer (not olmo_tools')."""
    path.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "config.json").write_text(json.dumps(hf_config(spec)))


@pytest.fixture(scope="module")
def tiny():
    spec = get_preset("tiny-gqa")
    model = initial_model(spec, seed=3)
    ids = np.random.default_rng(0).integers(0, spec.vocab_size, (2, SEQ))
    return spec, model, ids, torch_logits(model, ids)


@pytest.fixture(scope="module")
def hf_dir(tiny, tmp_path_factory) -> Path:
    spec, model, _, _ = tiny
    path = tmp_path_factory.mktemp("src") / "hf"
    write_hf_dir(path, spec, to_hf(model, spec))
    return path


def test_torch_to_hf_to_jax_and_back(tiny, tmp_path):
    spec, model, ids, expected = tiny
    write_torch_dir(tmp_path / "torch", model)
    convert(f"torch:{tmp_path / 'torch'}", f"hf:{tmp_path / 'hf'}")
    # transformers loads the folder we wrote and computes the same logits.
    np.testing.assert_allclose(transformers_logits(tmp_path / "hf", ids), expected, atol=1e-4, rtol=0)
    convert(f"hf:{tmp_path / 'hf'}", f"jax:{tmp_path / 'jax'}")
    jax_side = load_side(f"jax:{tmp_path / 'jax'}", None, "float32")
    assert jax_side.impl == "jax"
    np.testing.assert_allclose(jax_side.logits(ids), expected, atol=1e-4, rtol=0)

    # And back: jax -> hf -> torch gives the original parameters bit for bit.
    convert(f"jax:{tmp_path / 'jax'}", f"hf:{tmp_path / 'hf2'}")
    convert(f"hf:{tmp_path / 'hf2'}", f"torch:{tmp_path / 'torch2'}")
    state = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "torch2"), no_dist=True)
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name
    back = model_from_hf(spec, to_hf(state, spec))
    np.testing.assert_allclose(torch_logits(back, ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["pt", "dcp"])
def test_olmo_core_layout_converts_in_and_out(tiny, hf_dir, tmp_path, layout):
    spec, model, ids, expected = tiny
    state = {olmo_core_key(name): t.clone() for name, t in to_hf(model, spec).items()}
    src = tmp_path / ("model.pt" if layout == "pt" else "dcp")
    if layout == "pt":
        torch.save(state, src)
    else:
        # OLMo-core's trainer checkpoint: model and optimizer state in one DCP.
        dcp.save({"model": state, "optim": {"step": torch.tensor(7.0)}}, checkpoint_id=str(src), no_dist=True)
    with pytest.raises(CheckpointError, match="carries no config; pass --spec"):
        convert(f"olmo-core:{src}", f"hf:{tmp_path / 'nospec'}")
    assert not (tmp_path / "nospec").exists()
    convert(f"olmo-core:{src}", f"hf:{tmp_path / 'hf'}", spec="tiny-gqa")
    np.testing.assert_allclose(transformers_logits(tmp_path / "hf", ids), expected, atol=1e-4, rtol=0)

    convert(f"hf:{hf_dir}", f"olmo-core:{tmp_path / 'out.pt'}")
    written = torch.load(tmp_path / "out.pt", weights_only=True)
    assert set(written) == set(state)
    for key, value in state.items():
        assert torch.equal(written[key], value), key


def test_bf16_halves_the_file_and_rounds_each_weight_once(tiny, hf_dir, tmp_path):
    spec, model, ids, expected = tiny
    convert(f"hf:{hf_dir}", f"hf:{tmp_path / 'bf16'}", dtype=torch.bfloat16)
    n_params = sum(int(np.prod(s)) for s in hf_param_shapes(spec).values())
    assert _data_bytes(hf_dir / "model.safetensors") == 4 * n_params
    assert _data_bytes(tmp_path / "bf16" / "model.safetensors") == 2 * n_params

    # Each stored tensor is torch's round-to-nearest-even cast of the fp32 weight, bit for bit ...
    stored = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    original = to_hf(model, spec)
    for name, value in original.items():
        assert stored[name].dtype == torch.bfloat16
        assert torch.equal(stored[name], value.to(torch.bfloat16)), name
    # ... so loading it in fp32 reproduces a model built from those rounded weights exactly.
    rounded = model_from_hf(spec, {k: v.to(torch.bfloat16).float() for k, v in original.items()})
    got = transformers_logits(tmp_path / "bf16", ids)
    np.testing.assert_allclose(got, torch_logits(rounded, ids), atol=1e-4, rtol=0)
    # bf16 keeps 8 significant bits: each weight moves by <= 2^-9 relative. Through 4 blocks
    # (7 matmuls each) and the head the relative errors add up to at most ~29 x 2^-9 = 5.7%
    # of the logit scale; random-init weights largely cancel, so this bound is loose.
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 29 * 2**-9 * scale


def test_sharded_hf_output_loads_in_transformers(tiny, hf_dir, tmp_path):
    spec, _, ids, expected = tiny
    assert main([f"hf:{hf_dir}", f"hf:{tmp_path / 'sharded'}", "--max-shard-gb", str(0.5 / 1024)]) == 0
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(hf_param_shapes(spec))
    np.testing.assert_allclose(transformers_logits(tmp_path / "sharded", ids), expected, atol=1e-4, rtol=0)
    # and it reads back in, shard by shard
    with HFCheckpoint(tmp_path / "sharded") as ckpt:
        assert set(ckpt.stored) == set(hf_param_shapes(spec))


def _data_bytes(path: Path) -> int:
    """File size less safetensors' header (an 8-byte length, then that much JSON)."""
    raw = path.read_bytes()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def _bad_hf(tmp_path: Path, tiny, edit) -> Path:
    spec, model, _, _ = tiny
    tensors = {k: v.clone() for k, v in to_hf(model, spec).items()}
    edit(tensors)
    path = tmp_path / "bad"
    write_hf_dir(path, spec, tensors)
    return path


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, shape):
    return lambda t: t.__setitem__(name, torch.zeros(shape))


def _vocab(rows):
    def edit(t):
        t["model.embed_tokens.weight"] = torch.zeros(rows, 64)
        t["lm_head.weight"] = torch.zeros(rows, 64)

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _set("model.layers.1.mlp.up_proj.weight", (100, 64)),
            r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has shape \(100, 64\)",
        ),
        (
            _drop("model.layers.2.self_attn.k_norm.weight"),
            r"missing tensor 'model\.layers\.2\.self_attn\.k_norm\.weight'",
        ),
        (
            _set("model.layers.4.mlp.up_proj.weight", (192, 64)),
            r"unexpected tensor 'model\.layers\.4\.mlp\.up_proj\.weight'",
        ),
        (
            _vocab(5000),
            r"vocab mismatch in 'model\.embed_tokens\.weight': checkpoint has 5000 rows, spec padded_vocab_size is 4096",
        ),
    ],
    ids=["wrong-shape", "missing", "unexpected", "vocab"],
)
@pytest.mark.parametrize("dst_kind", ["hf", "torch"])
def test_bad_tensor_is_named_and_dst_not_created(tiny, tmp_path, capsys, edit, message, dst_kind):
    src = _bad_hf(tmp_path, tiny, edit)
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match=message):
        convert(f"hf:{src}", f"{dst_kind}:{dst}")
    assert not dst.exists()
    assert main([f"hf:{src}", f"{dst_kind}:{dst}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("olmo-convert: error: hf:") and err.count("\n") == 1 and str(src) in err
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]  # no temporary left behind


def test_spec_config_disagreement_is_an_error(hf_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json disagrees with --spec \(n_kv_heads: 2 vs None"):
        convert(f"hf:{hf_dir}", f"hf:{tmp_path / 'out'}", spec="tiny")
    assert not (tmp_path / "out").exists()
    convert(f"hf:{hf_dir}", f"hf:{tmp_path / 'out'}", spec="tiny-gqa")  # agreeing --spec is fine


def test_existing_destination_needs_overwrite_and_failed_write_keeps_it(hf_dir, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    with pytest.raises(CheckpointError, match="destination exists; pass --overwrite"):
        convert(f"hf:{hf_dir}", f"hf:{dst}")

    # A read failure midway through writing leaves the old destination as it was.
    calls = {"n": 0}
    real = HFCheckpoint.tensor

    def failing(self, name):
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError("disk read error")
        return real(self, name)

    monkeypatch.setattr(HFCheckpoint, "tensor", failing)
    with pytest.raises(OSError, match="disk read error"):
        convert(f"hf:{hf_dir}", f"hf:{dst}", overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.undo()

    convert(f"hf:{hf_dir}", f"hf:{dst}", overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]


def test_truncated_safetensors_is_refused(hf_dir, tmp_path):
    src = tmp_path / "cut"
    src.mkdir()
    (src / "config.json").write_text((hf_dir / "config.json").read_text())
    raw = (hf_dir / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CheckpointError, match=r"tensor '.+' has a byte range that does not fit its shape or the file"):
        convert(f"hf:{src}", f"hf:{tmp_path / 'out'}")
    assert not (tmp_path / "out").exists()


def test_jax_dir_whose_spec_json_does_not_fit_its_weights(hf_dir, tmp_path):
    convert(f"hf:{hf_dir}", f"jax:{tmp_path / 'jax'}")
    spec_file = tmp_path / "jax" / "spec.json"
    spec = json.loads(spec_file.read_text())
    spec_file.write_text(json.dumps({**spec, "mlp_hidden": 128}))
    with pytest.raises(
        CheckpointError, match=r"parameter 'layers\.down_proj' has shape \(4, 192, 64\), spec .* expects \(4, 128, 64\)"
    ):
        convert(f"jax:{tmp_path / 'jax'}", f"hf:{tmp_path / 'out'}")
    assert not (tmp_path / "out").exists()

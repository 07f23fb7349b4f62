"""OLMo-core 3's MoE model converts in and out: its saved checkpoint, through olmo-convert into torch:
and jax:, gives OLMo-core's own recorded fp32 logits, and our weights written as olmo-core: are
OLMo-core's tensors bit for bit.

The reference is independent of this project: tools/tests/data/olmo_core_moe was written by
OLMo-core 3.0.0 itself (tools/bench/olmo_core/make_moe_fixture.py in an isolated env): its
OLMoDDP model (the moe_fused_v2 block of the OLMoE3-dev scripts) for spec.json (GQA, per-head
QK-norm, window 32 on layers 0-1, a shared-expert-only first block, top-2 of 8 experts renormalised
and scaled back by k, one shared expert, vocab 256), saved by its save_model_and_optim_state, plus
the logits its forward computed on 2 x 96 tokens (its three CUDA-only pieces replaced by CPU
equivalents and checked against a per-token re-computation there). Weights are O(1), so a swapped
or transposed tensor moves the logits by orders of magnitude more than the bound.

The bound, 1e-5 on fp32 logits of magnitude up to 5: measured 1.3e-6 (torch) and 7.2e-6 (JAX) on
an Intel AVX-512 host; JAX's error is spread over every position (median 2.1e-6), about 15 fp32
ulps at |logit| 5 after three layers, rounding rather than a wrong term (a wrong routing weight
or window moves them by more than 0.1, as the last test shows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from olmo_model import load_spec
from olmo_tools.checkpoint import parse_location
from olmo_tools.convert import convert, main
from olmo_tools.dcp import DCPDir, load_torch_file
from olmo_tools.formats import open_checkpoint
from olmo_tools.parity import load_side
from olmo_tools.parity import main as parity_main
from olmo_train_torch import OlmoModel, model_from_hf

FIXTURE = Path(__file__).parent / "data" / "olmo_core_moe"
CKPT = FIXTURE / "model_and_optim"
SPEC = FIXTURE / "spec.json"
BOUND = 1e-5  # see the module docstring
# DCP notes on every call that it runs without a process group, which is intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def reference():
    ref = np.load(FIXTURE / "reference.npz")
    return ref["tokens"], ref["logits"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("olmo-core-moe")
    # The command line itself, as a user would run it on an OLMo-core step directory.
    for kind in ("torch", "jax"):
        assert main([f"olmo-core:{CKPT}", f"{kind}:{root / kind}", "--spec", str(SPEC)]) == 0
    return root


def test_torch_model_from_olmo_core_gives_olmo_core_logits(converted, reference):
    tokens, expected = reference
    assert tokens.shape == (2, 96) and expected.shape == (2, 96, 256)
    spec = load_spec(converted / "torch" / "spec.json")
    stored = DCPDir(converted / "torch")
    model = OlmoModel(spec)
    model.load_state_dict({key: stored.load(key) for key in stored.tensors}, strict=True)
    with torch.no_grad():
        got = model.eval()(torch.from_numpy(tokens)).logits.float().numpy()
    np.testing.assert_allclose(got, expected, atol=BOUND, rtol=0)


def test_jax_model_from_olmo_core_gives_olmo_core_logits(converted, reference):
    tokens, expected = reference
    side = load_side(f"jax:{converted / 'jax'}", None, "float32")
    assert side.impl == "jax"
    np.testing.assert_allclose(side.logits(tokens), expected, atol=BOUND, rtol=0)


def test_olmo_parity_reads_an_olmo_core_moe_checkpoint(converted, reference, tmp_path, capsys):
    """olmo-parity logits takes olmo-core: MoE sides (our torch model on OLMo-core's tensors)."""
    tokens, _ = reference
    np.save(tmp_path / "tokens.npy", tokens)
    args = [f"olmo-core:{CKPT}", f"jax:{converted / 'jax'}", "--spec", str(SPEC), "--tokens"]
    args += [str(tmp_path / "tokens.npy"), "--seq-len", "96", "--json", "--min-top1", "1.0"]
    assert parity_main(["logits", *args]) == 0
    assert '"passed": true' in capsys.readouterr().out


def _olmo_core_tensors(path: Path) -> dict[str, torch.Tensor]:
    """An OLMo-core state dict as stored: a .pt file, or a DCP directory's keys under ``model.``."""
    if path.is_file():
        return dict(load_torch_file(path))
    stored = DCPDir(path)
    return {key.removeprefix("model."): stored.load(key) for key in stored.tensors if key.startswith("model.")}


def test_olmo_core_to_ours_and_back_is_olmo_cores_own_tensors(converted):
    """OLMo-core -> jax: -> olmo-core: reproduces every tensor OLMo-core saved, bit for bit (and
    names no other): the fused w_qkv, the flat router, [E, 2H, d] up-then-gate, the shared expert's
    [d, 2H_s] and the dense first block as a shared-expert-only block."""
    back = converted / "back.pt"
    convert(f"jax:{converted / 'jax'}", f"olmo-core:{back}")
    original, again = _olmo_core_tensors(CKPT), _olmo_core_tensors(back)
    assert sorted(again) == sorted(original)
    assert "blocks.0.shared_experts.w_up_gate" in original and "blocks.0.routed_experts.w_down" not in original
    for key, tensor in original.items():
        assert torch.equal(again[key], tensor), key


def test_ours_to_olmo_core_and_back_is_bitwise(converted, tmp_path):
    """jax: -> olmo-core: (DCP) -> torch: and jax: again: every interchange tensor unchanged."""
    convert(f"jax:{converted / 'jax'}", f"olmo-core:{tmp_path / 'oc'}")
    convert(f"olmo-core:{tmp_path / 'oc'}", f"jax:{tmp_path / 'jax'}", spec=str(SPEC))
    with open_checkpoint(parse_location(f"jax:{converted / 'jax'}")) as a:
        first = dict(a.tensors())
    with open_checkpoint(parse_location(f"jax:{tmp_path / 'jax'}")) as b:
        second = dict(b.tensors())
    assert sorted(first) == sorted(second) and len(first) > 30
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name


def _write_pt(path: Path, state: dict[str, torch.Tensor]) -> str:
    torch.save(state, path)
    return f"olmo-core:{path}"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("drop", "missing tensor 'blocks.1.routed_experts.w_down' (shape (8, 16, 64))"),
        (
            "shape",
            "tensor 'blocks.2.routed_experts_router.weight' has shape (448,), spec 'olmoe3-fixture' needs (512,)",
        ),
        ("extra", "unexpected tensor 'blocks.0.routed_experts_router.weight'"),
    ],
)
def test_a_bad_olmo_core_moe_checkpoint_is_one_line_naming_the_tensor(tmp_path, capsys, change, named):
    state = _olmo_core_tensors(CKPT)
    if change == "drop":
        del state["blocks.1.routed_experts.w_down"]
    elif change == "shape":
        state["blocks.2.routed_experts_router.weight"] = state["blocks.2.routed_experts_router.weight"][:448]
    else:
        state["blocks.0.routed_experts_router.weight"] = torch.zeros(512)
    src = _write_pt(tmp_path / "bad.pt", state)
    assert main([src, f"jax:{tmp_path / 'out'}", "--spec", str(SPEC)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and named in err, err
    assert not (tmp_path / "out").exists()


def test_hf_export_of_an_olmo_core_moe_spec_is_refused_with_the_reason(tmp_path, capsys):
    assert main([f"olmo-core:{CKPT}", f"hf:{tmp_path / 'hf'}", "--spec", str(SPEC)]) == 2
    err = capsys.readouterr().err.strip()
    # The reason is olmoe_config's first refusal (norm placement, shared expert, dense layers, ...).
    assert "\n" not in err and "spec 'olmoe3-fixture' is MoE and hf: holds the dense Olmo3 layout (olmoe_config:" in err
    assert "cannot be expressed by OlmoeForCausalLM" in err and "convert to olmo-core:, torch: or jax:" in err
    assert not (tmp_path / "hf").exists()


def test_the_reference_depends_on_the_restored_weight_scale(reference):
    """The recorded logits discriminate: the same weights with the k routing weights summing to 1
    (no restore_weight_scale) miss them by far."""
    tokens, expected = reference
    spec = load_spec(SPEC)
    with open_checkpoint(parse_location(f"olmo-core:{CKPT}"), spec) as ckpt:
        tensors = dict(ckpt.tensors())
    assert spec.moe is not None
    unscaled = spec.replace(moe=spec.moe.model_copy(update={"restore_weight_scale": False}))
    with torch.no_grad():
        wrong = model_from_hf(unscaled, tensors)(torch.from_numpy(tokens)).logits.float().numpy()
    assert np.abs(wrong - expected).max() > 1e-1


def test_a_dense_spec_on_an_olmo_core_moe_checkpoint_says_so(tmp_path, capsys):
    assert main([f"olmo-core:{CKPT}", f"jax:{tmp_path / 'out'}", "--spec", "tiny-gqa"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "an OLMo-core MoE (OLMoDDP) checkpoint, but spec 'tiny-gqa' is dense" in err, err


def _interchange(src: str, spec=None) -> dict[str, torch.Tensor]:
    with open_checkpoint(parse_location(src), spec) as ckpt:
        return dict(ckpt.tensors())


def test_the_default_attentions_separate_projections_read_the_same(tmp_path):
    """OLMo-core's ``default`` attention stores w_q / w_k / w_v, ``fused_v2`` one w_qkv of the three
    stacked (FusedAttentionV2._prepare_qkv splits it q, k, v): both read to the same tensors."""
    spec = load_spec(SPEC)
    state = _olmo_core_tensors(CKPT)
    for i in range(spec.n_layers):
        q, k, v = state.pop(f"blocks.{i}.attention.w_qkv.weight").split([spec.q_width, spec.kv_width, spec.kv_width])
        state.update({f"blocks.{i}.attention.w_{n}.weight": t.clone() for n, t in zip("qkv", (q, k, v))})
    fused, separate = _interchange(f"olmo-core:{CKPT}", spec), _interchange(_write_pt(tmp_path / "a.pt", state), spec)
    assert sorted(fused) == sorted(separate)
    for name, tensor in fused.items():
        assert torch.equal(separate[name], tensor), name


def test_an_olmoddp_train_module_checkpoint_reads_its_flat_master_weights(tmp_path):
    """The OLMoDDP train module saves its optimizer's state (save_state_dict_direct): each parameter
    as NAME.main (fp32, flattened) next to NAME.exp_avg / exp_avg_sq / step, no model. keys; its
    own loader (_resolve_model_checkpoint_key) reads NAME.main. Read here to the same tensors."""
    from olmo_tools.dcp import save_dcp

    spec = load_spec(SPEC)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in _olmo_core_tensors(CKPT).items():
        state[f"{key}.main"] = tensor.reshape(-1).clone()
        state[f"{key}.exp_avg"] = torch.zeros(tensor.numel())
        state[f"{key}.exp_avg_sq"] = torch.zeros(tensor.numel())
    save_dcp(tmp_path / "step10", state)
    direct, flat = _interchange(f"olmo-core:{CKPT}", spec), _interchange(f"olmo-core:{tmp_path / 'step10'}", spec)
    assert sorted(direct) == sorted(flat)
    for name, tensor in direct.items():
        assert torch.equal(flat[name], tensor), name


def test_the_layout_of_the_olmoe3_presets_is_olmo_cores_own():
    """Every OLMo-core name and shape olmo-convert reads and writes for olmoe3-t001, -s001 (head_dim
    128 != d_model / n_heads) and -u001 (two dense leading blocks) is the one OLMo-core 3.0.0's
    OLMoDDP model has: olmo_core_shapes.json was written by make_moe_fixture.py --shapes, which
    builds each preset's model on the meta device as the OLMoE3-dev scripts configure it."""
    import json

    from olmo_tools.olmo_core_moe import olmoddp_layout

    recorded = json.loads((FIXTURE / "olmo_core_shapes.json").read_text())
    assert recorded["ai2-olmo-core"] == "3.0.0" and len(recorded["shapes"]) == 3
    for name, theirs in recorded["shapes"].items():
        sizes, _ = olmoddp_layout(load_spec(name))
        assert {key: list(shape) for key, shape in sizes.items()} == theirs, name


OLDER = Path(__file__).parent / "data" / "olmo_core_moe_reordered"


@pytest.mark.parametrize("impl", ["torch", "jax"])
def test_the_older_moe_reordered_norm_model_gives_olmo_cores_logits(impl):
    """OLMo-core's older MoE block (moe_reordered_norm: DroplessMoE experts w1 / w2 / w3 [E * H, d],
    router [E * d], default attention's w_q / w_k / w_v, a dense first block), written by OLMo-core
    3.0.0 (make_moe_reordered_fixture.py: its forward with the two Triton permutation kernels replaced
    by CPU equivalents, checked per token there), read by olmo-parity's olmo-core: side: within the
    same 1e-5 (measured torch 0, JAX 5.8e-6)."""
    ref = np.load(OLDER / "reference.npz")
    side = load_side(f"olmo-core:{OLDER / 'model_and_optim'}", impl, "float32", str(OLDER / "spec.json"))
    np.testing.assert_allclose(side.logits(ref["tokens"]), ref["logits"], atol=BOUND, rtol=0)


def test_the_older_model_with_a_restored_weight_scale_spec_is_one_line(tmp_path, capsys):
    spec = load_spec(OLDER / "spec.json")
    assert spec.moe is not None
    scaled = spec.replace(moe=spec.moe.model_copy(update={"restore_weight_scale": True}))
    (tmp_path / "spec.json").write_text(scaled.model_dump_json())
    args = [f"olmo-core:{OLDER / 'model_and_optim'}", f"jax:{tmp_path / 'out'}", "--spec", str(tmp_path / "spec.json")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "an OLMo-core moe_reordered_norm checkpoint, which has no restored weight scale" in err

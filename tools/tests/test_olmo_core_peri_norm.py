"""OLMo-core 3's peri-norm blocks and embedding norm (the OLMoE3-dev scripts' ``use_peri_norm=True``,
``embed_scale=sqrt(d_model)``, ``embedding_norm``): OLMo-core's own forward against ours.

tools/tests/data/olmo_core_peri_norm was written by OLMo-core 3.0.0 itself
(tools/bench/olmo_core/make_moe_fixture.py in the isolated env, on this folder's spec.json: the MoE
fixture's spec with norm_placement peri, embedding_scale 8 = sqrt(d_model), embedding_norm true): the
MoE fixture's model (GQA, per-head QK-norm, a shared-expert-only first block, top-2 of 8
restored-scale routing, one shared expert) with ``use_peri_norm`` on every block and the scaled,
normalised embedding, each block checked there against a per-token re-computation with the input
norms written out (2.3e-6). Its weights are O(1) and its norm weights 1 +- 0.3, so an input norm
taken for an output norm, or the embedding norm left out, moves the logits by far more than the
bound. olmo-convert reads its checkpoint (OLMo-core's keys attention_input_norm,
feed_forward_input_norm, embedding_norm) into torch: and jax:, and both give OLMo-core's logits; the
float64 numpy reference on the same tensors too.

The bound, 1e-5 on fp32 logits of magnitude up to 5, is the MoE fixture's
(tools/tests/test_olmo_core_moe.py: fp32 rounding through three layers, a few ulps at |logit| 5);
measured on an Intel Xeon host: torch 1.2e-6, JAX 3.3e-6, numpy (float64 on the fp32 tensors)
3.5e-6, OLMo-core's own fp32 rounding being the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo_model import load_spec, reference
from olmo_tools.checkpoint import parse_location
from olmo_tools.convert import main
from olmo_tools.dcp import DCPDir
from olmo_tools.formats import open_checkpoint
from olmo_tools.parity import load_side
from olmo_train_torch import OlmoModel

FIXTURE = Path(__file__).parent / "data" / "olmo_core_peri_norm"
CKPT = FIXTURE / "model_and_optim"
SPEC = FIXTURE / "spec.json"
BOUND = 1e-5  # see the module docstring
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def fixture_logits():
    ref = np.load(FIXTURE / "reference.npz")
    return ref["tokens"], ref["logits"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("olmo-core-peri")
    for kind in ("torch", "jax"):
        assert main([f"olmo-core:{CKPT}", f"{kind}:{root / kind}", "--spec", str(SPEC)]) == 0
    return root


def test_the_fixture_is_olmo_cores_peri_norm_model():
    spec = load_spec(SPEC)
    assert spec.norm_placement == "peri" and spec.embedding_norm and spec.embedding_scale == 8.0
    keys = {key.removeprefix("model.") for key in DCPDir(CKPT).tensors}
    assert "embedding_norm.weight" in keys
    for i in range(spec.n_layers):
        assert {f"blocks.{i}.attention_input_norm.weight", f"blocks.{i}.feed_forward_input_norm.weight"} <= keys
    assert json.loads((FIXTURE / "provenance.json").read_text())["ai2-olmo-core"] == "3.0.0"


def test_torch_model_gives_olmo_core_logits(converted, fixture_logits):
    tokens, expected = fixture_logits
    spec = load_spec(converted / "torch" / "spec.json")
    stored = DCPDir(converted / "torch")
    model = OlmoModel(spec)
    model.load_state_dict({key: stored.load(key) for key in stored.tensors}, strict=True)
    with torch.no_grad():
        got = model.eval()(torch.from_numpy(tokens)).logits.float().numpy()
    np.testing.assert_allclose(got, expected, atol=BOUND, rtol=0)


def test_jax_model_gives_olmo_core_logits(converted, fixture_logits):
    tokens, expected = fixture_logits
    side = load_side(f"jax:{converted / 'jax'}", None, "float32")
    np.testing.assert_allclose(side.logits(tokens), expected, atol=BOUND, rtol=0)


def test_numpy_reference_gives_olmo_core_logits_and_the_options_matter(fixture_logits):
    """The float64 reference on OLMo-core's tensors agrees; without peri-norm or without the
    embedding norm (the same tensors, the option off) it is far off."""
    tokens, expected = fixture_logits
    spec = load_spec(SPEC)
    with open_checkpoint(parse_location(f"olmo-core:{CKPT}"), spec) as ckpt:
        params = {name: t.double().numpy() for name, t in ckpt.tensors()}
    np.testing.assert_allclose(reference.forward(spec, params, tokens), expected, atol=BOUND, rtol=0)
    reordered = {k: v for k, v in params.items() if "input_layernorm" not in k and "pre_feedforward" not in k}
    off = reference.forward(spec.replace(norm_placement="reordered"), reordered, tokens)
    assert np.abs(off - expected).max() > 0.1
    plain = {k: v for k, v in params.items() if k != "model.embed_norm.weight"}
    off = reference.forward(spec.replace(embedding_norm=False, embedding_scale=None), plain, tokens)
    assert np.abs(off - expected).max() > 0.1

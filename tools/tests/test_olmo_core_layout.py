"""OLMo-core's real olmo3 model converts in: its saved checkpoint, through olmo-convert into
hf:, torch: and jax:, gives OLMo-core's own recorded fp32 logits.

The reference is independent of this project: tools/tests/data/olmo_core_olmo3 was written
by OLMo-core 3.0.0 itself (tools/bench/olmo_core/make_layout_fixture.py, run in an isolated
env because ai2-olmo-core pins torch 2.13): its olmo3 transformer for the spec in spec.json
(tiny-gqa, vocab 256: 4 layers, window 32 on layers 0-2, layer 3 global, 2 kv heads),
saved by its ``save_model_and_optim_state`` (a DCP written by torch 2.13), plus the logits
OLMo-core's forward computed on the fixed tokens (sequence 96 > window). Weights are
redrawn at O(1) scale, norm weights included, so a swapped or misplaced tensor moves the
logits by orders of magnitude more than the 1e-4 bound.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from olmo_model import load_spec, spec_from_dict
from olmo_tools.checkpoint import parse_location
from olmo_tools.convert import convert, main
from olmo_tools.formats import open_checkpoint
from olmo_tools.parity import load_side
from olmo_train_torch import model_from_hf

FIXTURE = Path(__file__).parent / "data" / "olmo_core_olmo3"
SPEC = FIXTURE / "spec.json"
# DCP notes on every call that it runs without a process group, which is intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def reference():
    ref = np.load(FIXTURE / "reference.npz")
    return ref["tokens"], ref["logits"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("olmo-core")
    # The command line itself, as a user would run it on an OLMo-core step directory.
    assert main([f"olmo-core:{FIXTURE / 'model_and_optim'}", f"hf:{root / 'hf'}", "--spec", str(SPEC)]) == 0
    convert(f"hf:{root / 'hf'}", f"torch:{root / 'torch'}")
    convert(f"hf:{root / 'hf'}", f"jax:{root / 'jax'}")
    return root


@pytest.mark.parametrize("kind", ["hf", "torch", "jax"])
def test_olmo_core_checkpoint_gives_olmo_core_logits(converted, reference, kind):
    tokens, expected = reference
    assert tokens.shape == (2, 96) and expected.shape == (2, 96, 256)
    side = load_side(f"{kind}:{converted / kind}", None, "float32")
    assert side.impl == ("jax" if kind == "jax" else "torch")
    got = side.logits(tokens)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_transformers_on_the_converted_folder_gives_olmo_core_logits(converted, reference):
    tokens, expected = reference
    side = load_side(f"hf-ref:{converted / 'hf'}", None, "float32")
    np.testing.assert_allclose(side.logits(tokens), expected, atol=1e-4, rtol=0)


def test_the_reference_depends_on_the_window(reference):
    """The recorded logits discriminate: the same weights with every layer global miss them by far."""
    tokens, expected = reference
    spec = load_spec(SPEC)
    with open_checkpoint(parse_location(f"olmo-core:{FIXTURE / 'model_and_optim'}"), spec) as ckpt:
        tensors = dict(ckpt.tensors())
    all_global = spec_from_dict({**spec.model_dump(), "layer_types": ["full_attention"] * spec.n_layers}, source="test")
    with torch.no_grad():
        wrong = model_from_hf(all_global, tensors)(torch.from_numpy(tokens)).logits.float().numpy()
        right = model_from_hf(spec, tensors)(torch.from_numpy(tokens)).logits.float().numpy()
    np.testing.assert_allclose(right, expected, atol=1e-4, rtol=0)
    # Positions within the window see the same keys either way; beyond it the global model differs.
    assert np.abs(wrong[:, :32] - expected[:, :32]).max() < 1e-4
    assert np.abs(wrong[:, 32:] - expected[:, 32:]).max() > 1e-1

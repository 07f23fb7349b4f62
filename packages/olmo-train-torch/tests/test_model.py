"""OlmoModel against independent references: transformers' Olmo3ForCausalLM (same weights
through to_hf) and olmo_model.reference (float64 numpy); plus windowing, document masking,
init statistics, the output type and the HF adapter's checks. CPU, float32, 4-layer tiny
specs, seq > window."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import Olmo3Config, Olmo3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from olmo_data.order import IGNORE_INDEX
from olmo_model import get_preset, hf_config, reference
from olmo_model.output import ModelOutput
from olmo_model.rope import rope_inv_freq
from olmo_train_torch import CheckpointMismatchError, initial_model, load_hf, model_from_hf, to_hf

transformers.logging.set_verbosity_error()  # tiny-yarn's factor != max_pos/original warns; intended


def hf_model(spec, model) -> Olmo3ForCausalLM:
    cfg = Olmo3Config(**hf_config(spec))
    cfg._attn_implementation = "eager"
    hf = Olmo3ForCausalLM(cfg).eval()
    hf.load_state_dict(to_hf(model, spec), strict=True)
    return hf


def random_ids(spec, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    ours, ref = ours.double(), ref.double()
    assert (ours - ref).abs().max().item() <= tol
    p_ref = torch.log_softmax(ref, -1)
    kl = (p_ref.exp() * (p_ref - torch.log_softmax(ours, -1))).sum(-1)
    assert kl.max().item() <= 1e-9
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    ("preset", "seq"),
    # seq 33 = window + 1: only the last query of a sliding layer loses a key (key 0).
    [("tiny", 96), ("tiny", 33), ("tiny-gqa", 96), ("tiny-yarn", 128)],
)
def test_matches_transformers(preset, seq):
    spec = get_preset(preset)
    assert seq > spec.sliding_window and "full_attention" in spec.layer_types
    model = initial_model(spec, seed=0)
    ids = random_ids(spec, 2, seq)
    with torch.no_grad():
        ours = model(ids).logits
        ref = hf_model(spec, model)(ids).logits
    assert ours.shape == (2, seq, spec.padded_vocab_size) and ours.dtype == torch.float32
    assert_logits_match(ours, ref)


@pytest.mark.parametrize(
    ("preset", "changes", "seq"),
    [
        ("tiny", {}, 96),
        ("tiny-gqa", {}, 96),
        ("tiny-yarn", {}, 128),
        ("tiny-gqa", {"qk_norm": "per_head"}, 80),
        ("tiny", {"qk_norm": "none"}, 80),
    ],
    ids=["tiny", "tiny-gqa", "tiny-yarn", "per-head-qk-norm", "no-qk-norm"],
)
def test_matches_numpy_reference(preset, changes, seq):
    spec = get_preset(preset).replace(**changes)
    params = reference.init_params(spec, seed=3)
    model = model_from_hf(spec, params)
    ids = random_ids(spec, 2, seq, seed=4)
    with torch.no_grad():
        ours = model(ids).logits
    ref = torch.from_numpy(reference.forward(spec, params, ids.numpy()))
    assert_logits_match(ours, ref)


def test_bfloat16_forward_tracks_reference():
    spec = get_preset("tiny")
    params = reference.init_params(spec, seed=5)
    model = model_from_hf(spec, params, dtype=torch.bfloat16)
    ids = random_ids(spec, 1, 64)
    with torch.no_grad():
        ours = model(ids).logits
    assert ours.dtype == torch.bfloat16
    ref = reference.forward(spec, params, ids.numpy())
    # bf16 keeps 8 mantissa bits: logits of magnitude ~1 carry errors of a few 1e-3.
    assert np.abs(ours.double().numpy() - ref).max() <= 3e-2


@pytest.mark.parametrize(
    "spec",
    [
        get_preset("tiny-yarn"),
        get_preset("olmo3-7b").replace(yarn={}),  # Olmo 3 stage 3: factor 8 over 8192, betas 32/1
        get_preset("olmo3-7b").replace(yarn={"factor": 4.0, "attention_factor": 1.5}),
    ],
)
def test_rope_tables_match_transformers(spec):
    cfg = Olmo3Config(**hf_config(spec))
    for kind in ("sliding_attention", "full_attention"):
        layer = spec.layer_types.index(kind)
        ours, ours_scale = rope_inv_freq(spec, spec.rope_yarn_of(layer))
        rope_type = cfg.rope_parameters[kind]["rope_type"]
        if rope_type == "default":
            exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim
            theirs = 1.0 / (spec.rope_theta**exponents)
            theirs_scale = 1.0
        else:
            theirs, theirs_scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, layer_type=kind)
        assert rope_type == ("yarn" if kind == "full_attention" else "default")
        assert torch.equal(torch.from_numpy(ours), theirs)  # bitwise: the same float32 arithmetic
        assert ours_scale == pytest.approx(theirs_scale, rel=1e-12)


def test_sliding_layers_really_window():
    spec = get_preset("tiny")
    window = spec.sliding_window
    windowed = initial_model(spec, seed=0)
    full = initial_model(spec.replace(sliding_window=None), seed=0)
    assert set(full.spec.layer_types) == {"full_attention"}
    full.load_state_dict(windowed.state_dict())
    ids = random_ids(spec, 2, 96)
    with torch.no_grad():
        a, b = windowed(ids).logits, full(ids).logits
    # Queries before the window's end see the same keys either way; later ones do not.
    assert (a[:, :window] - b[:, :window]).abs().max().item() <= 1e-6
    assert (a[:, window:] - b[:, window:]).abs().amax(dim=(0, 2)).min().item() > 1e-3


def _doc_masks(doc_ids: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    """Additive [B,1,S,S] masks for transformers, written out from the definition."""
    b, s = doc_ids.shape
    neg = torch.finfo(torch.float32).min
    q = torch.arange(s)[:, None]
    k = torch.arange(s)[None, :]
    same_doc = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
    masks = {}
    for kind, w in (("full_attention", s), ("sliding_attention", window)):
        visible = (k <= q) & (q - k < w) & same_doc
        masks[kind] = torch.where(visible, 0.0, neg)
    return masks


def test_doc_ids_mask_documents():
    """Chosen semantics: documents cannot attend to each other, RoPE positions keep
    counting across a boundary (Olmo-core style; no position reset)."""
    spec = get_preset("tiny")
    model = initial_model(spec, seed=0)
    seq = 96
    ids = random_ids(spec, 2, seq)
    doc_ids = torch.zeros(2, seq, dtype=torch.long)
    doc_ids[0, 40:] = 1  # row 0: second document of 56 tokens, longer than the window
    doc_ids[1, 10:] = 7
    doc_ids[1, 70:] = 8
    with torch.no_grad():
        ours = model(ids, doc_ids=doc_ids).logits
        # transformers with explicit masks; its default positions 0..S-1 continue across documents.
        ref = hf_model(spec, model)(ids, attention_mask=_doc_masks(doc_ids, spec.sliding_window)).logits
        # RoPE scores depend only on q - k, so a document run alone (positions from 0)
        # gives the same logits as inside the packed row.
        alone = model(ids[:1, 40:]).logits
        plain = model(ids).logits
    assert_logits_match(ours, ref)
    assert (ours[:1, 40:] - alone).abs().max().item() <= 1e-5
    assert (ours[:1, :40] - plain[:1, :40]).abs().max().item() <= 1e-6
    assert (ours[:1, 40:] - plain[:1, 40:]).abs().max().item() > 1e-3


def test_doc_ids_shape_is_checked():
    model = initial_model(get_preset("tiny"))
    with pytest.raises(ValueError, match="doc_ids has shape"):
        model(torch.zeros(2, 8, dtype=torch.long), doc_ids=torch.zeros(2, 7, dtype=torch.long))


def test_init_statistics_and_determinism():
    spec = get_preset("small")
    model = initial_model(spec, seed=11)
    # Variance of N(0, 1) truncated at +-c: 1 - 2 c phi(c) / (2 Phi(c) - 1).
    c = spec.init_cutoff
    phi = math.exp(-c * c / 2) / math.sqrt(2 * math.pi)
    big_phi = 0.5 * (1 + math.erf(c / math.sqrt(2)))
    expected_std = spec.init_std * math.sqrt(1 - 2 * c * phi / (2 * big_phi - 1))
    assert expected_std == pytest.approx(0.02 * 0.9866, rel=1e-4)
    w = model.lm_head.weight  # 4096 x 128: the largest linear
    assert w.std().item() == pytest.approx(expected_std, rel=0.02)
    assert model.embed.weight.std().item() == pytest.approx(expected_std, rel=0.02)
    for name, p in model.named_parameters():
        if p.ndim == 2:
            assert p.abs().max().item() <= c * spec.init_std, name
        else:
            assert torch.equal(p, torch.ones_like(p)), name
    same = initial_model(spec, seed=11)
    other = initial_model(spec, seed=12)
    as_bf16 = initial_model(spec, seed=11, dtype=torch.bfloat16)
    for (name, p), q, r, h in zip(
        model.named_parameters(), same.parameters(), other.parameters(), as_bf16.parameters(), strict=True
    ):
        assert torch.equal(p, q), name
        assert torch.equal(h, p.to(torch.bfloat16)), name
        if p.ndim == 2:
            assert not torch.equal(p, r), name
    # Linears are not all the same draw: each parameter has a stream of its own (olmo_model.init).
    assert not torch.equal(model.blocks[0].attn.q_proj.weight, model.blocks[1].attn.q_proj.weight)


def test_inference_mode_call_leaves_caches_usable_for_training():
    model = initial_model(get_preset("tiny"))
    ids = random_ids(model.spec, 1, 48)
    with torch.inference_mode():
        evaluated = model(ids).logits
    trained = model(ids).logits
    trained.float().logsumexp(-1).mean().backward()
    assert torch.equal(evaluated, trained.detach())
    assert model.blocks[0].attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_forward_returns_one_output_type_with_and_without_labels(preset):
    """``forward`` returns a ``ModelOutput``: the logits without labels; with labels, no logits
    and the fused head's sums ``[ce + z_w * z, ce, z]`` over labels != IGNORE_INDEX (written
    here in float64 from the unfused logits); the MoE layers' stats, the same either way (the
    head does not touch them), or None for a dense spec."""
    spec = get_preset(preset)
    model = initial_model(spec, seed=0)
    ids, labels = random_ids(spec, 2, 40), random_ids(spec, 2, 40, seed=2)
    labels[0, :5] = IGNORE_INDEX
    with torch.no_grad():
        plain, fused = model(ids), model(ids, labels=labels)
    assert isinstance(plain, ModelOutput) and isinstance(fused, ModelOutput)
    assert plain.loss_sums is None and fused.logits is None
    logits = plain.logits.double()
    flat = logits.reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    z = (torch.logsumexp(logits, -1)[labels != IGNORE_INDEX] ** 2).sum()
    assert fused.loss_sums.dtype == torch.float32 and fused.loss_sums.shape == (3,)
    # float32 sums of 75 terms (CE ~8, z ~70 each) against float64: float32 rounding, ~1e-6 relative.
    want = torch.stack([ce + spec.z_loss_weight * z, ce, z])
    torch.testing.assert_close(fused.loss_sums.double(), want, rtol=1e-5, atol=0)
    if spec.moe is None:
        assert plain.moe is None and fused.moe is None
        return
    assert len(plain.moe) == len(fused.moe) == sum(spec.is_moe_layer(i) for i in range(spec.n_layers))
    for a, b in zip(plain.moe, fused.moe, strict=True):
        for name in ("tokens_per_expert", "prob_sum", "z_sum"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.n_tokens == ids.numel()


# ---- HF adapter --------------------------------------------------------------------------


def test_round_trip_through_hf_names():
    spec = get_preset("tiny-gqa")
    model = initial_model(spec, seed=2)
    tensors = {k: v.numpy() for k, v in to_hf(model, spec).items()}
    again = model_from_hf(spec, tensors)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _put(name, shape):
    return lambda tensors: tensors.update({name: np.zeros(shape, dtype=np.float32)})


@pytest.mark.parametrize(
    ("corrupt", "needle"),
    [
        (
            _drop("model.layers.2.self_attn.k_norm.weight"),
            "model.safetensors: missing tensor 'model.layers.2.self_attn.k_norm.weight' (expected shape (64,))",
        ),
        (
            _put("model.layers.4.mlp.up_proj.weight", (192, 64)),
            "model.safetensors: unexpected tensor 'model.layers.4.mlp.up_proj.weight'",
        ),
        (
            _put("model.layers.1.mlp.down_proj.weight", (192, 64)),
            "model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' has shape (192, 64), expected (64, 192)",
        ),
        (
            _put("lm_head.weight", (4224, 64)),
            "model.safetensors: vocab mismatch in 'lm_head.weight': checkpoint has 4224 rows, "
            "spec padded_vocab_size is 4096",
        ),
    ],
    ids=["missing", "unexpected", "shape", "vocab"],
)
def test_bad_checkpoint_is_refused_before_copy(corrupt, needle):
    spec = get_preset("tiny")
    model = initial_model(spec, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = {k: np.full(v.shape, 0.5, dtype=np.float32) for k, v in to_hf(model, spec).items()}
    corrupt(tensors)
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf(model, tensors, source="model.safetensors")
    assert needle in str(err.value)
    assert "\n" not in str(err.value)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_non_strict_load_skips_missing_and_ignores_extra():
    spec = get_preset("tiny")
    model = initial_model(spec, seed=0)
    tensors = {k: torch.full(v.shape, 0.5) for k, v in to_hf(model, spec).items()}
    del tensors["model.norm.weight"]
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(3)
    load_hf(model, tensors, strict=False)
    assert torch.equal(model.final_norm.weight, torch.ones(spec.d_model))
    assert torch.equal(model.blocks[3].mlp.up_proj.weight, torch.full((spec.mlp_hidden, spec.d_model), 0.5))

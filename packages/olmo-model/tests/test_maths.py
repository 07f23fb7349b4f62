"""Parameter counts, FLOPs per token and MFU against values written out by hand."""

from __future__ import annotations

import pytest

from olmo_model import (
    FULL,
    PEAKS,
    SLIDING,
    ModelSpec,
    UnknownDeviceError,
    flops_per_token,
    fp32_mean_tolerance,
    get_preset,
    layout_loss_tolerance,
    mean_keys_per_query,
    mfu,
    param_counts,
    resolve_device_kind,
)

# docs/design.md's table (OLMo-core 3.0.0's own counts, embedding and output head included).
DESIGN_PARAMS = {
    "olmo3-14m": 26_740_864,
    "olmo3-30m": 54_792_448,
    "olmo3-60m": 95_957_376,
    "olmo3-190m": 267_424_512,
    "olmo3-1b": 1_484_916_736,
    "olmo3-7b": 7_298_617_344,
    "olmo3-32b": 32_234_279_936,
}
# (d_model, layers, heads, kv heads, MLP hidden), also from docs/design.md.
DESIGN_SHAPES = {
    "olmo3-14m": (128, 4, 8, 8, 512),
    "olmo3-30m": (256, 4, 8, 8, 768),
    "olmo3-60m": (384, 8, 8, 8, 1536),
    "olmo3-190m": (768, 12, 12, 12, 3072),
    "olmo3-1b": (2048, 16, 16, 16, 8192),
    "olmo3-7b": (4096, 32, 32, 32, 11008),
    "olmo3-32b": (5120, 64, 40, 8, 27648),
}


def _olmo3_formula(d, n_layers, heads, kv_heads, ff, vocab=100_352):
    head_dim = d // heads
    kv = kv_heads * head_dim
    attention = d * d + 2 * d * kv + d * d  # q, k, v, o (GQA narrows k and v)
    qk_norm = d + kv  # full-width q_norm and k_norm
    mlp = 3 * d * ff  # SwiGLU gate, up, down
    norms = 2 * d  # post-attention and post-feedforward
    return 2 * vocab * d + n_layers * (attention + qk_norm + mlp + norms) + d  # + final norm


@pytest.mark.parametrize("preset", list(DESIGN_PARAMS))
def test_param_counts_match_formula_and_design_table(preset):
    counts = param_counts(get_preset(preset))
    assert counts.total == _olmo3_formula(*DESIGN_SHAPES[preset]) == DESIGN_PARAMS[preset]
    assert counts.active == counts.total  # dense
    assert counts.embedding == 2 * 100_352 * DESIGN_SHAPES[preset][0]
    assert counts.non_embedding == counts.total - counts.embedding


def test_7b_h16_equals_7b():
    a, b = get_preset("olmo3-7b"), get_preset("olmo3-7b-h16")
    assert b.head_dim == 256 and a.head_dim == 128
    assert param_counts(a) == param_counts(b)
    for seq_len in (4096, 8192, 65536):
        assert flops_per_token(a, seq_len) == flops_per_token(b, seq_len)


def test_moe_counts_by_hand():
    spec = get_preset("tiny-moe")  # d 64, 4 layers, 8 experts top-4 of hidden 64, one shared
    d, v = 64, 4096
    attention = 4 * d * d + 2 * d
    norms = 2 * d
    router = 8 * d
    expert = 3 * d * 64
    per_layer_stored = attention + norms + router + 8 * expert + expert
    per_layer_active = attention + norms + router + 4 * expert + expert
    counts = param_counts(spec)
    assert counts.total == 2 * v * d + 4 * per_layer_stored + d == 1_035_328
    assert counts.active == 2 * v * d + 4 * per_layer_active + d == 838_720


def _hand_spec(**changes) -> ModelSpec:
    base = dict(
        d_model=16,
        n_layers=2,
        n_heads=2,
        mlp_hidden=32,
        vocab_size=100,
        padded_vocab_size=128,
        eos_token_id=0,
        pad_token_id=1,
        sliding_window=4,
        layer_types=(SLIDING, FULL),
        max_position_embeddings=64,
    )
    return ModelSpec(**{**base, **changes})


def test_flops_per_token_by_hand():
    spec = _hand_spec()
    # Weights a token multiplies through: per layer q, k, v, o 4 * 16 * 16 = 1024 and the
    # MLP 3 * 16 * 32 = 1536, so 2 * 2560 = 5120; the head 128 * 16 = 2048. Sum 7168,
    # times 6 (forward 2 + backward 4 per multiply-add) = 43008.
    # Attention at seq 8: 12 * n_heads * head_dim = 12 * 2 * 8 = 192 FLOPs per key seen.
    # The global layer sees 1..8 keys, mean 36 / 8 = 4.5; the window-4 layer sees
    # 1, 2, 3, 4, 4, 4, 4, 4, mean 26 / 8 = 3.25. 192 * (4.5 + 3.25) = 1488.
    assert flops_per_token(spec, 8) == 43008 + 1488 == 44496
    assert mean_keys_per_query(8, None) == 4.5
    assert mean_keys_per_query(8, 4) == 3.25
    assert mean_keys_per_query(8, 8) == 4.5  # a window as long as the sequence is global


def test_sliding_layers_save_exactly_the_missing_keys():
    spec = get_preset("olmo3-7b")
    all_global = spec.replace(layer_types=(FULL,) * 32)
    seq_len = 8192
    # Global: (8192 + 1) / 2 = 4096.5 keys. Window 4096: 4096 * 4097 / 2 keys over the
    # first 4096 positions plus 4096 * 4096 over the rest, / 8192 = 3072.25.
    mean_full, mean_window = 4096.5, 3072.25
    n_sliding = 24  # layers with i % 4 != 3
    expected = 12 * 32 * 128 * (mean_full - mean_window) * n_sliding
    assert flops_per_token(all_global, seq_len) - flops_per_token(spec, seq_len) == expected
    # Shorter than the window, both specs are the same model.
    assert flops_per_token(all_global, 4096) == flops_per_token(spec, 4096)


def test_mfu_by_hand():
    spec = _hand_spec()
    # 44496 FLOPs/token (test_flops_per_token_by_hand) at 1e9 tokens/s on one H100 (989e12).
    assert mfu(spec, 8, 1e9, "h100") == pytest.approx(44496e9 / 989e12, rel=1e-15)
    assert mfu(spec, 8, 1e9, peak_flops_per_device=44496e9) == pytest.approx(1.0, rel=1e-15)
    # tpu7x: 2307e12 per chip, shown by JAX as two devices.
    assert mfu(spec, 8, 1e9, "TPU7x") == pytest.approx(44496e9 / (2307e12 / 2), rel=1e-15)


@pytest.mark.parametrize(
    ("name", "key", "per_device"),
    [
        ("NVIDIA H100 80GB HBM3", "h100", 989e12),
        ("NVIDIA H200", "h200", 989e12),
        ("NVIDIA B200", "b200", 2250e12),
        ("NVIDIA B300 SXM6 AC", "b300", 2250e12),  # torch's name for an HGX B300's GPU
        ("NVIDIA A100-SXM4-80GB", "a100", 312e12),
        ("TPU v5p", "v5p", 459e12),
        ("TPU v5", "v5p", 459e12),  # what JAX's device_kind says on a v5p
        ("TPU v6 lite", "v6e", 918e12),
        ("TPU7x", "tpu7x", 2307e12 / 2),
        ("h100", "h100", 989e12),
    ],
)
def test_device_aliases(name, key, per_device):
    peak = resolve_device_kind(name)
    assert peak.kind == key
    assert peak.bf16_flops_per_device == per_device


@pytest.mark.parametrize("name", ["TPU v5 lite", "Tesla V100-SXM2-16GB", "NVIDIA GB200", "NVIDIA GB300"])
def test_devices_without_a_peak_are_errors(name):
    with pytest.raises(UnknownDeviceError, match="no bf16 peak"):
        resolve_device_kind(name)


def test_blackwell_peaks_and_hbm_from_the_datasheets():
    """HGX B200 / B300 datasheets: 36 PFLOPS FP16/BF16 with sparsity per 8 GPUs, so 36e15 / 2 / 8
    dense per GPU (OLMo-core 3's B300 MFU denominator, 2250 TFLOP/s); HBM as nvidia-smi totals it:
    183359 MiB (B200, ~179 GiB: the datasheet's "180 GB") and 275040 MiB (B300, 288.4e9 bytes)."""
    for kind in ("b200", "b300"):
        assert PEAKS[kind].bf16_flops_per_device == 36e15 / 2 / 8
    assert PEAKS["b200"].hbm_bytes / 2**30 == pytest.approx(179.06, abs=0.01)
    assert PEAKS["b300"].hbm_bytes == pytest.approx(288.4e9, rel=1e-4)


def test_unknown_device_is_an_error():
    with pytest.raises(UnknownDeviceError) as err:
        mfu(get_preset("tiny"), 64, 1e6, "Banana GPU 9000")
    msg = str(err.value)
    assert "\n" not in msg
    assert "unknown device kind 'Banana GPU 9000'" in msg and "h100" in msg and "explicit" in msg
    assert "b200" in msg and "b300" in msg


@pytest.mark.parametrize("count, mean", [(512, 3.0), (1024, 8.3), (4096, 8.3)])
def test_fp32_mean_tolerance_bounds_a_sequential_fp32_sum(count, mean):
    """Against the thing it models: numpy's float32 cumsum adds one term after the other (the
    order the bound assumes), float64 gives the exact mean of the same float32 terms."""
    import numpy as np

    rng = np.random.default_rng(0)
    terms = rng.uniform(mean - 0.5, mean + 0.5, size=(4000, count)).astype(np.float32)
    fp32 = np.cumsum(terms, axis=1, dtype=np.float32)[:, -1].astype(np.float64) / count
    err = fp32 - terms.astype(np.float64).sum(1) / count
    std = fp32_mean_tolerance(mean, count, both_fp32=False) / 6
    # The derivation over-estimates the spread (uniform over +-u, not over half an ulp), so the
    # measured one sits below it but not far below; 4000 draws pin a standard deviation to about 1%.
    assert 0.6 * std < err.std() < std
    assert np.abs(err).max() < 6 * std
    # Two fp32 runs: sqrt(2) wider; the documented Olmo-sized example.
    assert fp32_mean_tolerance(mean, count) == pytest.approx(2**0.5 * 6 * std)
    assert fp32_mean_tolerance(8.3, 1024) == pytest.approx(4.47e-5, rel=1e-2)


def _toy_fp32_training(layout: str, bug: str | None = None, steps: int = 20) -> list[float]:
    """Per-step losses of a bigram softmax model (vocab 512, width 32) trained by fp32 AdamW (lr
    1e-3, betas 0.9 / 0.95, weight decay 0.1: the trainers' defaults) on 512 tokens a step, written
    here in numpy, independently of both trainers. ``layout`` "whole" takes every sum over all
    tokens at once (one device); "shards" over 4 shards of 128 tokens, then adds the shards one
    after the other (4 ranks): the same maths, another fp32 rounding. ``bug`` (on "shards"):
    "lost_shard" leaves shard 3 out of the gradient sum (an all-reduce missing a rank: the forward
    is right, so step 1's loss is too); "shifted_labels" gives shard 3 another shard's labels (a
    batch placed on the wrong rank)."""
    import numpy as np

    f32, vocab, width, tokens, shards = np.float32, 512, 32, 512, 4
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((vocab, width)).astype(f32)
    head = (0.1 * rng.standard_normal((width, vocab))).astype(f32)
    moments = [np.zeros_like(emb), np.zeros_like(emb), np.zeros_like(head), np.zeros_like(head)]
    identity = np.eye(vocab, dtype=f32)

    def forward_backward(x, y):
        """Token losses and the two weights' gradient sums (not yet divided by the token count)."""
        h = emb[x]
        logits = h @ head
        shifted = logits - logits.max(1, keepdims=True)
        probs = np.exp(shifted)
        total = probs.sum(1, keepdims=True)
        token_loss = np.log(total[:, 0]) - shifted[np.arange(len(x)), y]
        dlogits = probs / total
        dlogits[np.arange(len(x)), y] -= 1
        return token_loss, identity[x].T @ (dlogits @ head.T), h.T @ dlogits

    losses = []
    for step in range(1, steps + 1):
        data = np.random.default_rng(step)
        x = data.integers(0, vocab, tokens)
        y = (3 * x + 1 + (data.random(tokens) < 0.2) * data.integers(0, vocab, tokens)) % vocab  # learnable
        if layout == "whole":
            token_loss, g_emb, g_head = forward_backward(x, y)
            loss = np.sum(token_loss, dtype=f32)
        else:
            loss, g_emb, g_head = f32(0), np.zeros_like(emb), np.zeros_like(head)
            for i, part in enumerate(np.split(np.arange(tokens), shards)):
                labels = y[part - len(part)] if (bug == "shifted_labels" and i == shards - 1) else y[part]
                token_loss, ge, gh = forward_backward(x[part], labels)
                loss = loss + np.cumsum(token_loss, dtype=f32)[-1]  # one token after the other
                if not (bug == "lost_shard" and i == shards - 1):
                    g_emb, g_head = g_emb + ge, g_head + gh
        losses.append(float(loss / f32(tokens)))
        for k, (weight, grad) in enumerate(((emb, g_emb / f32(tokens)), (head, g_head / f32(tokens)))):
            m, v = moments[2 * k], moments[2 * k + 1]
            m[:] = f32(0.9) * m + f32(0.1) * grad
            v[:] = f32(0.95) * v + f32(0.05) * grad * grad
            update = (m / f32(1 - 0.9**step)) / (np.sqrt(v / f32(1 - 0.95**step)) + f32(1e-8))
            weight -= f32(1e-3) * (update + f32(0.1) * weight)
    return losses


def test_layout_loss_tolerance_is_the_reordered_sum_bound_then_adds_the_drift_envelope():
    # Step 1, written out: 6 sigmas of sqrt(2) x u |mean| sqrt(n) / 3 (fp32_mean_tolerance's derivation).
    u = 2.0**-24
    step1 = 6 * 2**0.5 * u * 8.3 * 1024**0.5 / 3
    assert layout_loss_tolerance(8.3, 1024, 1) == pytest.approx(step1, rel=1e-12) == pytest.approx(4.47e-5, rel=1e-2)
    assert layout_loss_tolerance(8.3, 1024, 1, both_fp32=False) == pytest.approx(step1 / 2**0.5, rel=1e-12)
    # Later steps: the same plus the measured envelope, 2.5e-4 (5x the largest gap on record, 4.4e-5).
    for step in (2, 7, 20):
        assert layout_loss_tolerance(8.3, 1024, step) == pytest.approx(step1 + 2.5e-4, rel=1e-12)
    with pytest.raises(ValueError, match="step=0"):
        layout_loss_tolerance(8.3, 1024, 0)


def test_layout_loss_tolerance_holds_for_a_reordered_fp32_training_and_a_layout_bug_crosses_it():
    """An fp32 AdamW training written here (``_toy_fp32_training``) on one device and on 4 shards:
    every step within the bound (measured: at most 1.9e-6, against 2.4e-5 at step 1 and 2.7e-4
    later). Two layout bugs on the same shards cross it at every step they can show at: a lost
    shard gradient from step 2 on (6.6x the bound at step 2, 84x at step 20), a misplaced shard's
    labels from step 1 on (810x at step 1, 1.6x at its smallest, step 2)."""
    whole, shards = _toy_fp32_training("whole"), _toy_fp32_training("shards")
    assert whole[0] - whole[-1] > 0.1  # it learns, so the weights move
    gaps = [abs(a - b) for a, b in zip(whole, shards)]
    assert max(gaps) > 0  # the two layouts do round differently
    for step, (loss, gap) in enumerate(zip(whole, gaps), start=1):
        assert gap <= layout_loss_tolerance(loss, 512, step), (step, gap)
    for bug, first in (("lost_shard", 2), ("shifted_labels", 1)):
        wrong = _toy_fp32_training("shards", bug)
        for step in range(first, len(whole) + 1):
            gap = abs(wrong[step - 1] - whole[step - 1])
            assert gap > layout_loss_tolerance(whole[step - 1], 512, step), (bug, step, gap)

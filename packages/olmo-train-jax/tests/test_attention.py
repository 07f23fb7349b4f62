"""The static-kind attention paths of the JAX model (blocked causal for global and short
sliding layers, blocked local window, each with and without document masking) against a float64 numpy attention written
from the definition, and the scan period of the layer pattern; plus a model whose scan walks
more than one repeat of its pattern against transformers and the numpy reference.

Run: cd /work/main && uv run --frozen pytest packages/olmo-train-jax/tests/test_attention.py -n 0 -q
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Olmo3Config, Olmo3ForCausalLM

from olmo_model import FULL, SLIDING, get_preset, hf_config, reference
from olmo_train_jax import model_from_hf
from olmo_train_jax.causal_attention import (
    _blocked_local_attention,
    _blocking_pays,
    attention,
    blocked_causal_attention,
    query_block,
)
from olmo_train_jax.layer_stacks import scan_period

jax.config.update("jax_enable_x64", False)


def _reference(q, k, v, window, doc_ids):
    """softmax(q k^T / sqrt(H)) v in float64 over keys j <= i with i - j < window (any j when
    window is None) and, with doc_ids, doc_ids[j] == doc_ids[i]; GQA: query head n reads kv
    head n // (N / K)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, S, N, H = q.shape
    group = N // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    allowed = (j <= i) & ((i - j < window) if window is not None else True)
    allowed = np.broadcast_to(allowed, (B, 1, S, S))
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknh->bqnh", probs, v)


def _qkv(seq, heads=4, kv_heads=2, head_dim=16, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, seq, kv_heads, head_dim)).astype(np.float32)
    return q, k, v


def _documents(seq, batch=2, seed=0):
    """Row 0: documents of random lengths (some shorter, some longer than the windows); row 1:
    a single document."""
    rng = np.random.default_rng(seed)
    doc_ids = np.zeros((batch, seq), np.int32)
    doc_ids[0] = np.cumsum(rng.random(seq) < 0.08)
    return doc_ids


WINDOW = 8


@pytest.mark.parametrize(
    "seq,kv_heads",
    [(13, 2), (5, 1), (WINDOW, 4), (3 * WINDOW + 5, 2), (64, 1)],
    ids=["not-multiple-gqa", "shorter-mqa", "equal-mha", "3W+5-gqa", "8W-mqa"],
)
@pytest.mark.parametrize("docs", [False, True], ids=["no-docs", "docs"])
def test_blocked_local_attention_matches_reference(seq, kv_heads, docs):
    q, k, v = _qkv(seq, kv_heads=kv_heads)
    doc_ids = _documents(seq) if docs else None
    ours = jax.jit(_blocked_local_attention, static_argnums=3)(q, k, v, WINDOW, doc_ids)
    assert ours.shape == q.shape
    assert np.abs(np.asarray(ours) - _reference(q, k, v, WINDOW, doc_ids)).max() <= 1e-6


@pytest.mark.parametrize(
    "seq,window,path",
    [
        (40, None, "causal"),
        (40, 40, "causal"),  # window covers the sequence: the same as global
        (40, 16, "short local"),  # S < 4W: the O(S W) path does not pay; blocked causal with a window
        (100, 16, "blocked"),
        (130, 25, "blocked"),  # S not a multiple of W
    ],
)
@pytest.mark.parametrize("docs", [False, True], ids=["no-docs", "docs"])
def test_attention_paths_match_reference(seq, window, path, docs):
    assert (window is not None and window < seq and _blocking_pays(seq, window)) == (path == "blocked")
    q, k, v = _qkv(seq, seed=seq)
    doc_ids = _documents(seq, seed=seq) if docs else None
    ours = jax.jit(attention, static_argnums=3)(q, k, v, window, doc_ids)
    assert np.abs(np.asarray(ours) - _reference(q, k, v, window, doc_ids)).max() <= 1e-6


def test_attention_gradients_match_dense():
    """The blocked path's backward (padding, concatenation, masking) equals the dense masked
    call's, which has no blocking at all."""
    seq, window = 80, 16
    q, k, v = _qkv(seq, seed=3)
    doc_ids = jnp.asarray(_documents(seq, seed=3))
    cot = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape).astype(np.float32))
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    band = jnp.asarray((j <= i) & (i - j < window))[None, None]

    def blocked(q, k, v):
        return jnp.sum(attention(q, k, v, window, doc_ids) * cot)

    def dense(q, k, v):
        mask = band & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=mask) * cot)

    assert _blocking_pays(seq, window)
    ours = jax.jit(jax.grad(blocked, argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(dense, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(ours, ref, strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * np.abs(np.asarray(b)).max()


@pytest.mark.parametrize(
    "seq,window,block,kv_heads",
    [
        (40, None, 8, 2),  # 5 query blocks, global
        (40, None, 40, 1),  # one block, MQA
        (48, 12, 16, 2),  # the window reaches back past one block boundary
        (48, 5, 16, 4),  # a window shorter than a block, MHA
    ],
    ids=["global-5-blocks", "global-1-block-mqa", "window-12-block-16", "window-5-block-16"],
)
@pytest.mark.parametrize("docs", [False, True], ids=["no-docs", "docs"])
def test_blocked_causal_attention_and_gradients(seq, window, block, kv_heads, docs):
    """causal_attention.blocked_causal_attention (query blocks skipping the keys above the
    diagonal/outside the window; its own backward from the saved logsumexp): forward against
    the float64 reference, gradients against jax.nn.dot_product_attention with a dense mask."""
    q, k, v = _qkv(seq, kv_heads=kv_heads, seed=seq + (window or 0))
    doc_ids = _documents(seq, seed=seq) if docs else None
    ours = jax.jit(blocked_causal_attention, static_argnums=(3, 5))(q, k, v, window, doc_ids, block)
    assert np.abs(np.asarray(ours) - _reference(q, k, v, window, doc_ids)).max() <= 1e-6

    cot = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape).astype(np.float32))
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = jnp.asarray((j <= i) & ((i - j < window) if window else True))[None, None]
    if docs:
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])

    def blocked(q, k, v):
        return jnp.sum(blocked_causal_attention(q, k, v, window, doc_ids, block) * cot)

    def dense(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=allowed) * cot)

    got = jax.jit(jax.grad(blocked, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(dense, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * np.abs(np.asarray(b)).max()


@pytest.mark.parametrize("batch_loop", [1, 2, 4], ids=["rows-1-at-a-time", "rows-2-at-a-time", "4-does-not-divide"])
def test_batch_loop_matches_the_batched_path(batch_loop):
    """blocked_causal_attention(batch_loop=D) (XLA:CPU's layout: the batch rows D at a time in a
    loop) is the same computation row by row, with document masking and a window: forward and
    gradients equal the all-rows-at-once path up to float32 rounding (XLA:CPU may pick another
    matmul kernel for another batch size: measured here up to 3.3e-7 of the scale; bitwise on the
    olmo3-30m shape) and the forward matches the float64 reference as tightly; D = 4 does not
    divide 6 rows and falls back to the very same program (bitwise)."""
    seq, window, block = 48, 12, 16
    rng = np.random.default_rng(7)
    q, k, v = _qkv(seq, kv_heads=2, batch=6, seed=3)
    doc_ids = np.stack([_documents(seq, batch=1, seed=s)[0] for s in range(6)])
    cot = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32))

    def run(loop):
        def f(q, k, v):
            return blocked_causal_attention(q, k, v, window, doc_ids, block, batch_loop=loop)

        out, vjp = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v))(q, k, v)
        return [np.asarray(out), *(np.asarray(g) for g in vjp(cot))]

    looped, batched = run(batch_loop), run(0)
    for a, b in zip(looped, batched, strict=True):
        if 6 % batch_loop:
            np.testing.assert_array_equal(a, b)
        else:
            # 1e-6 of the array's scale: the bound test_blocked_causal_attention_and_gradients
            # holds the batched path's forward to against float64.
            assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
    assert np.abs(looped[0] - _reference(q, k, v, window, doc_ids)).max() <= 1e-6
    # And the loop really is a different program when D divides: a while loop over B / D rows.
    hlo = (
        jax.jit(lambda q: blocked_causal_attention(q, k, v, window, doc_ids, block, batch_loop=batch_loop))
        .lower(q)
        .as_text()
    )
    assert ("while" in hlo) == (6 % batch_loop == 0)


def test_batch_loop_keeps_a_sharded_batch_on_its_devices():
    """With the batch split over 4 devices and batch_loop=4 (what the trainer sets on a
    4-device data mesh), every device loops over its own rows: the compiled forward + backward
    has no collective. Looping one row at a time over the sharded axis would gather it."""
    code = """
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from olmo_train_jax.causal_attention import blocked_causal_attention
mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
sh = NamedSharding(mesh, P("data"))
x = jax.device_put(jnp.ones((8, 64, 4, 16)), sh)
for loop in (4, 1):
    f = lambda q, k, v: blocked_causal_attention(q, k, v, None, None, 32, batch_loop=loop)
    g = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](q), in_shardings=(sh, sh, sh))
    txt = g.lower(x, x, x).compile().as_text()
    print(loop, sum(txt.count(c) for c in ("all-gather", "all-to-all", "all-reduce", "collective-permute")))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = dict(line.split() for line in done.stdout.strip().splitlines())
    assert counts["4"] == "0", done.stdout
    assert int(counts["1"]) > 0, done.stdout  # the check can see a gather


def test_query_block_choice():
    assert query_block(200) == 200  # short: one block
    assert query_block(512) == 256
    assert query_block(8192) == 512  # at most 16 unrolled blocks
    assert query_block(4099) == 4099  # a prime: no divisor, one block
    with pytest.raises(ValueError, match="block 7 does not divide the sequence length 40"):
        blocked_causal_attention(*_qkv(40), block=7)


def test_scan_period():
    for name in ("olmo3-30m", "olmo3-1b", "olmo3-7b", "olmo3-32b", "tiny", "tiny-yarn"):
        spec = get_preset(name)
        assert spec.layer_types[:4] == (SLIDING, SLIDING, SLIDING, FULL)
        assert scan_period(spec.layer_types) == 4, name
    assert scan_period((FULL,) * 6) == 1
    assert scan_period((SLIDING, FULL) * 3) == 2
    assert scan_period((FULL, SLIDING, SLIDING, FULL)) == 4  # non-periodic: every layer unrolled
    assert scan_period((SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING, FULL)) == 8


def test_model_with_several_pattern_repeats_matches_transformers_and_reference():
    """Pattern (sliding, full) over 6 layers: the scan walks 3 repeats of 2 unrolled layers, so
    the [6, ...] -> [3, 2, ...] regrouping must keep every layer's weights in its place.
    Sequence 150 > 4 x window 32: the sliding layers take the blocked path."""
    spec = get_preset("tiny-yarn").replace(
        n_layers=6, sliding_window=32, layer_types=(SLIDING, FULL) * 3, name="tiny-repeats"
    )
    seq = 150
    assert scan_period(spec.layer_types) == 2 and _blocking_pays(seq, spec.sliding_window)
    params = reference.init_params(spec, seed=3)
    rng = np.random.default_rng(3)
    params = {n: rng.uniform(0.5, 1.5, p.shape).astype(np.float32) if p.ndim == 1 else p for n, p in params.items()}
    ids = rng.integers(0, spec.vocab_size, (2, seq)).astype(np.int32)
    ours = np.asarray(nnx.jit(lambda m, x: m(x).logits)(model_from_hf(spec, params), jnp.asarray(ids)))

    config = Olmo3Config(**hf_config(spec))
    config._attn_implementation = "eager"
    hf = Olmo3ForCausalLM(config).eval()
    hf.load_state_dict({n: torch.from_numpy(p) for n, p in params.items()}, strict=True)
    with torch.no_grad():
        hf_logits = hf(torch.from_numpy(ids).long()).logits.numpy()
    for ref in (hf_logits, reference.forward(spec, params, ids)):
        assert np.abs(ours - ref).max() <= 1e-4
        assert (ours.argmax(-1) == ref.argmax(-1)).all()

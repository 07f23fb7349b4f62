"""Causal attention by query blocks, skipping the blocks above the diagonal, with its own
backward that recomputes the probabilities from the saved log-sum-exp (flash attention's
algorithm, written in jnp so that XLA compiles it for any backend).

``jax.nn.dot_product_attention(implementation=None)`` scores all S x S pairs and autodiff keeps
the S x S probabilities and their cotangents: on XLA:CPU its backward was 5x its forward (olmo3-30m
shape, seq 512: 297 ms per layer for the gradient against 58 ms for this forward). Here query block
i (positions [i b, (i+1) b)) scores only keys [start_i, (i+1) b), where start_i is 0 for global
layers and i b - (window - 1) for sliding layers; the diagonal block (and a window's edge) is
masked elementwise. Per block:

    forward:  s = q_i k^T / sqrt(H); e = exp(s - max s); o_i = (e v) / rowsum(e); lse = logsumexp(s)
    backward: p = exp(s - lse); dv += p^T do_i; dp = do_i v^T; ds = p (dp - rowsum(do_i o_i));
              dq_i = ds k / sqrt(H); dk += ds^T q_i / sqrt(H)

Residuals are q, k, v, o and lse ([B, N, S] float32), never an S x S array. The loop over
blocks is unrolled (block shapes differ), so the block is chosen to keep S / block small
(``query_block``). GQA: the G = N / K query heads of one key head share its keys.
Scores, softmax and lse in float32; (unnormalised) probabilities are cast to v's dtype for the
value matmuls (as XLA's dot_product_attention does).

``attention`` is the attention of one layer as the model calls it: it picks among cuDNN's fused
attention (GPU), the O(S W) blocked local path for windows much shorter than the sequence, and the
blocked kernel above (``jax.attention``). A context-parallel split runs ``context_parallel``'s
kernel instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .precision import matmul_precision

# Query positions per block: a few hundred keeps each block's matmuls efficient; at most
# MAX_BLOCKS unrolled blocks, so long sequences get longer blocks.
BLOCK = 256
MAX_BLOCKS = 16


def query_block(seq_len: int) -> int:
    """A divisor of seq_len near BLOCK with at most MAX_BLOCKS blocks (seq_len itself when it is
    short or has no suitable divisor)."""
    if seq_len <= BLOCK:
        return seq_len
    target = max(BLOCK, -(-seq_len // MAX_BLOCKS))
    for b in range(target, seq_len + 1):
        if seq_len % b == 0:
            return b
    return seq_len


def _key_range(i: int, block: int, window: int | None) -> tuple[int, int]:
    end = (i + 1) * block
    start = 0 if window is None else max(0, i * block - (window - 1))
    return start, end


def _block_mask(i: int, block: int, window: int | None, doc_ids: jax.Array | None) -> jax.Array | None:
    """[B or 1, 1, 1, b, keys] boolean mask of query block i, or None when nothing is masked."""
    start, end = _key_range(i, block, window)
    q_pos = np.arange(i * block, end)[:, None]
    k_pos = np.arange(start, end)[None, :]
    static = k_pos <= q_pos
    if window is not None:
        static &= q_pos - k_pos < window
    mask = None if static.all() else jnp.asarray(static)[None, None, None]
    if doc_ids is not None:
        same = doc_ids[:, i * block : end, None] == doc_ids[:, None, start:end]  # [B, b, keys]
        same = same[:, None, None]
        mask = same if mask is None else mask & same
    return mask


def masked_scores(q_i, k_r, scale, mask):
    # q_i [B, K, G, b, H], k_r [B, K, T, H] -> [B, K, G, b, T] float32
    s = (
        jnp.einsum(
            "bkgqh,bkth->bkgqt",
            q_i,
            k_r,
            preferred_element_type=jnp.float32,
            precision=matmul_precision(q_i.dtype),
        )
        * scale
    )
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _forward(q, k, v, doc_ids, window, block):
    """q [B, K, G, S, H], k/v [B, K, S, H] -> (o like q, lse [B, K, G, S] float32)."""
    S, H = q.shape[3], q.shape[4]
    scale = 1.0 / math.sqrt(H)
    prec = matmul_precision(q.dtype)
    outs, lses = [], []
    for i in range(S // block):
        start, end = _key_range(i, block, window)
        q_i = q[:, :, :, i * block : end]
        s = masked_scores(q_i, k[:, :, start:end], scale, _block_mask(i, block, window, doc_ids))
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        row_sum = jnp.sum(e, axis=-1, keepdims=True)
        # Normalised after the value matmul ([b, H] per query, not [b, keys]): one pass fewer.
        pv = jnp.einsum(
            "bkgqt,bkth->bkgqh",
            e.astype(v.dtype),
            v[:, :, start:end],
            preferred_element_type=jnp.float32,
            precision=prec,
        )
        outs.append(pv / row_sum)
        lses.append((m + jnp.log(row_sum))[..., 0])
    return jnp.concatenate(outs, axis=3).astype(q.dtype), jnp.concatenate(lses, axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q, k, v, doc_ids, window, block):
    return _forward(q, k, v, doc_ids, window, block)[0]


def _attend_fwd(q, k, v, doc_ids, window, block):
    o, lse = _forward(q, k, v, doc_ids, window, block)
    return o, (q, k, v, doc_ids, o, lse)


def _attend_bwd(window, block, residuals, do):
    q, k, v, doc_ids, o, lse = residuals
    S, H = q.shape[3], q.shape[4]
    scale = 1.0 / math.sqrt(H)
    prec = matmul_precision(q.dtype)
    # rowsum(do * o): the softmax backward's per-query term, float32.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    dqs = []
    # dk, dv accumulate transposed ([B, K, H, S]): the key axis stays the matmuls' output columns,
    # so XLA:CPU transposes the thin q / do blocks instead of the [b, keys] probabilities.
    dk = jnp.zeros(k.shape[:2] + k.shape[:1:-1], jnp.float32)
    dv = jnp.zeros(v.shape[:2] + v.shape[:1:-1], jnp.float32)
    for i in range(S // block):
        start, end = _key_range(i, block, window)
        rows = slice(i * block, end)
        q_i, do_i = q[:, :, :, rows], do[:, :, :, rows]
        k_r, v_r = k[:, :, start:end], v[:, :, start:end]
        s = masked_scores(q_i, k_r, scale, _block_mask(i, block, window, doc_ids))
        p = jnp.exp(s - lse[:, :, :, rows, None])
        dv = dv.at[:, :, :, start:end].add(
            jnp.einsum(
                "bkgqh,bkgqt->bkht", do_i, p.astype(do.dtype), preferred_element_type=jnp.float32, precision=prec
            )
        )
        dp = jnp.einsum("bkgqh,bkth->bkgqt", do_i, v_r, preferred_element_type=jnp.float32, precision=prec)
        ds = (p * (dp - delta[:, :, :, rows, None]) * scale).astype(q.dtype)
        dqs.append(jnp.einsum("bkgqt,bkth->bkgqh", ds, k_r, preferred_element_type=jnp.float32, precision=prec))
        dk = dk.at[:, :, :, start:end].add(
            jnp.einsum("bkgqh,bkgqt->bkht", q_i, ds, preferred_element_type=jnp.float32, precision=prec)
        )
    dq = jnp.concatenate(dqs, axis=3).astype(q.dtype)
    return dq, dk.swapaxes(2, 3).astype(k.dtype), dv.swapaxes(2, 3).astype(v.dtype), None


_attend.defvjp(_attend_fwd, _attend_bwd)


def blocked_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    window: int | None = None,
    doc_ids: jax.Array | None = None,
    block: int | None = None,
    batch_loop: int = 0,
) -> jax.Array:
    """Causal attention, q [B, S, N, H], k/v [B, S, K, H] (K divides N), ``window`` keys per
    query including itself (None: global), ``doc_ids`` [B, S] keeps queries in their document.
    Returns [B, S, N, H] like ``jax.nn.dot_product_attention(..., is_causal=True)``.

    ``batch_loop`` = D > 0 runs the batch rows D at a time in a loop (``lax.map``) instead of
    all at once; D is the number of devices the batch axis is split over, so every device
    takes one of its own rows per iteration and nothing moves between devices (looping over
    single rows of a sharded axis would gather it). For XLA:CPU: one row's [N, block, keys]
    scores stay in cache between the matmul, the softmax and the next matmul, where all rows'
    are written to memory and read back (``bench/bench_attention.py``, olmo3-30m shape, batch
    8, seq 512, D = 1: one layer's forward 58.9 -> 27.0 ms, forward + backward 122.6 -> 79.7
    ms, bitwise the same result there; other shapes may round differently, as XLA:CPU picks
    its matmul kernels by shape). Ignored when D does not divide B or leaves one iteration."""
    B, S, N, H = q.shape
    K = k.shape[2]
    if N % K:
        raise ValueError(f"{N} query heads are not a multiple of {K} key/value heads")
    block = query_block(S) if block is None else block
    if S % block:
        raise ValueError(f"attention block {block} does not divide the sequence length {S}")
    G = N // K
    qt = q.reshape(B, S, K, G, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, S, H]
    kt = k.transpose(0, 2, 1, 3)  # [B, K, S, H]
    vt = v.transpose(0, 2, 1, 3)
    if window is not None and window >= S:
        window = None
    if batch_loop > 0 and B % batch_loop == 0 and B > batch_loop:
        D = batch_loop

        def rows(x):  # [B, ...] -> [B / D, D, ...]: iteration i takes row i of every device's block
            return None if x is None else x.reshape(D, B // D, *x.shape[1:]).swapaxes(0, 1)

        o = jax.lax.map(lambda a: _attend(*a, window, block), (rows(qt), rows(kt), rows(vt), rows(doc_ids)))
        o = o.swapaxes(0, 1).reshape(qt.shape)
    else:
        o = _attend(qt, kt, vt, doc_ids, window, block)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, S, N, H)


# ---- the attention of one layer: which kernel runs it ---------------------------------------------


def _blocking_pays(seq_len: int, window: int) -> bool:
    """Blocked local attention scores 2W keys per query (over S padded to a multiple of W), the
    dense path S keys; blocking also costs padding and a 2x copy of k/v, so it is taken only
    where it at least halves the scores (roughly S >= 4W)."""
    padded = -(-seq_len // window) * window
    return 4 * padded * window <= seq_len * seq_len


def _same_document(doc_q: jax.Array, doc_k: jax.Array) -> jax.Array:
    """[..., Tq], [..., Tk] -> [..., 1, Tq, Tk]: a query may see a key of its own document."""
    return (doc_q[..., :, None] == doc_k[..., None, :])[..., None, :, :]


def _local_band(n_blocks: int, window: int) -> np.ndarray:
    """[n_blocks, 1, W, 2W] static mask of the blocked path: query block i (positions iW + a)
    against the keys of blocks i-1 and i (positions (i-1)W + b), allowed where the distance
    is in [0, W) and the key exists (block 0 has no previous block: its keys are padding)."""
    a = np.arange(window)[:, None]
    b = np.arange(2 * window)[None, :]
    distance = window + a - b
    band = (distance >= 0) & (distance < window)
    key_pos = (np.arange(n_blocks)[:, None, None] - 1) * window + b[None]
    return (band[None] & (key_pos >= 0))[:, None]


def _blocked_local_attention(q, k, v, window: int, doc_ids: jax.Array | None) -> jax.Array:
    """Sliding-window causal attention in O(S W): q [B, S, N, H], k/v [B, S, K, H]."""
    B, S, N, H = q.shape
    n_blocks = -(-S // window)
    pad = n_blocks * window - S

    def key_blocks(x: jax.Array, fill) -> jax.Array:
        # [B, S, ...] -> [B, n_blocks, 2W, ...]: each block's own keys behind the previous block's.
        widths = [(0, 0), (window, pad)] + [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, widths, constant_values=fill).reshape(B, n_blocks + 1, window, *x.shape[2:])
        return jnp.concatenate([x[:, :-1], x[:, 1:]], axis=2)

    def query_blocks(x: jax.Array) -> jax.Array:
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, widths).reshape(B, n_blocks, window, *x.shape[2:])

    qb = query_blocks(q).reshape(B * n_blocks, window, N, H)
    kb = key_blocks(k, 0).reshape(B * n_blocks, 2 * window, *k.shape[2:])
    vb = key_blocks(v, 0).reshape(B * n_blocks, 2 * window, *v.shape[2:])
    mask = jnp.asarray(_local_band(n_blocks, window))[None]  # [1, n_blocks, 1, W, 2W]
    if doc_ids is not None:
        mask = mask & _same_document(query_blocks(doc_ids), key_blocks(doc_ids, -1))
    mask = jnp.broadcast_to(mask, (B, n_blocks, 1, window, 2 * window)).reshape(B * n_blocks, 1, window, 2 * window)
    out = jax.nn.dot_product_attention(qb, kb, vb, mask=mask, implementation=None)
    return out.reshape(B, n_blocks * window, N, H)[:, :S]


ATTENTION_IMPLS = ("auto", "xla", "cudnn")


def _cudnn_attention_problem(q: jax.Array, doc_ids: jax.Array | None, platform: str) -> str | None:
    """Why cuDNN's fused attention cannot run this call (None: it can)."""
    if platform != "gpu":
        return f"the backend is {platform}, not gpu"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"activations are {q.dtype} (cuDNN's fused attention takes bf16/fp16: train.precision=bf16)"
    if doc_ids is not None:
        return "document masking is on (train.document_masking; cuDNN's path here has no segment mask)"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]} is not a multiple of 8 up to 256"
    return None


def attention(
    q,
    k,
    v,
    window: int | None,
    doc_ids: jax.Array | None = None,
    impl: str = "xla",
    batch_shards: int = 1,
    platform: str | None = None,
) -> jax.Array:
    """Causal attention of one layer, its kind static: q [B, S, N, H], k/v [B, S, K, H] (GQA
    when K < N), ``window`` the keys a query sees including itself (None: global), ``doc_ids``
    [B, S] restricts each query to its document. Returns [B, S, N, H].

    ``impl`` (the recipe's ``jax.attention``): ``cudnn`` runs cuDNN's fused flash attention
    (``jax.nn.dot_product_attention(implementation="cudnn")``, causal with a left window for
    sliding layers; GPU, bf16/fp16, no document mask); ``auto`` takes it where those hold and
    the XLA path otherwise; ``xla``: global layers and short-sequence sliding layers run
    ``blocked_causal_attention`` (query blocks that skip the keys above the diagonal / outside
    the window, a backward that recomputes the probabilities; never an S x S array); sliding
    layers with S >= ~4W the O(S W) blocked local path. Plain XLA compiles for any backend.
    On XLA:CPU the blocked path loops over the batch rows, ``batch_shards`` (the devices the
    batch axis is split over) at a time, which keeps one row's scores in cache
    (``blocked_causal_attention(batch_loop=...)``); other backends take all rows at once.
    ``platform``: the platform the step is compiled for (None: ``jax.default_backend()``)."""
    S = q.shape[1]
    platform = platform or jax.default_backend()
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"jax.attention='{impl}' is unknown; use one of: {', '.join(ATTENTION_IMPLS)}")
    if impl != "xla":
        problem = _cudnn_attention_problem(q, doc_ids, platform)
        if problem is not None and impl == "cudnn":
            raise ValueError(f"jax.attention=cudnn cannot run here: {problem}; set --jax.attention=auto or xla")
        if problem is None:
            local = None if window is None or window >= S else (window - 1, 0)
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=True, local_window_size=local, implementation="cudnn"
            )
    if window is not None and window < S and _blocking_pays(S, window):
        return _blocked_local_attention(q, k, v, window, doc_ids)
    loop = batch_shards if platform == "cpu" else 0
    return blocked_causal_attention(q, k, v, window, doc_ids, batch_loop=loop)

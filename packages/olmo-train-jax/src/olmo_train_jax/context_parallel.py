"""Causal attention over a context-parallel split of the sequence (the ``context`` mesh axis).

Each device holds two chunks of every row, ``olmo_model.context.ContextLayout``'s zigzag split,
and the model passes every column's true position. This module is the only place where the split
is visible: the model calls ``context_attention`` with the ``ContextParallel`` the trainer gave it
(``for_mesh``), and it runs one ``shard_map`` over the mesh with the collectives in it. Global
layers all-gather K/V over the context axis; sliding layers fetch only the ``window - 1`` keys
before each chunk from the ranks holding them (``lax.ppermute``). The per-block maths is
``causal_attention``'s (scores, softmax, a backward that recomputes the probabilities from the
saved log-sum-exp), over a ``lax.scan`` of query blocks masked by true positions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .causal_attention import BLOCK, masked_scores
from .precision import matmul_precision

# A key that does not exist (a halo slot before the sequence's start) gets this position: never
# at or before any query's.
_NO_KEY = 2**30
# One query block's float32 scores stay near this many bytes (per device).
CONTEXT_BLOCK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ContextParallel:
    """What ``context_attention`` needs of the mesh: the mesh, the axes that split the batch, the
    context axis and its size, and the axis that splits the heads (tensor parallelism) when the
    heads divide it."""

    mesh: Mesh
    batch_axes: tuple[str, ...]
    degree: int
    axis: str = "context"
    head_axis: str | None = None


def context_block(chunk: int, rows: int, heads: int, keys: int, budget: int = CONTEXT_BLOCK_BYTES) -> int:
    """Query positions per block of the context-parallel kernel: the largest divisor of ``chunk``
    of at most ``chunk / 2`` (so a chunk is always several blocks) and BLOCK whose float32 scores
    (rows x heads x block x keys) fit ``budget``; at least 1."""
    best = 1
    for b in range(1, max(chunk // 2, 1) + 1):
        if chunk % b == 0 and b <= BLOCK and rows * heads * b * keys * 4 <= budget:
            best = b
    return best


def _positional_mask(q_pos, k_pos, window, q_doc, k_doc):
    """[B', 1, 1, b, T] visibility from true positions (and documents): causal, within the window."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = kp <= qp
    if window is not None:
        mask &= qp - kp < window
    if q_doc is not None:
        mask &= q_doc[:, :, None] == k_doc[:, None, :]
    return mask[:, None, None]


def _block_inputs(i, q, q_pos, q_doc, k, v, k_pos, k_doc, window, block, key_len, stride):
    """Query block i's queries, the keys and values it scores, and its mask."""
    sl = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=i * block, slice_size=block)
    ks = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=i * stride, slice_size=key_len)
    q_i, qp, qd = sl(q, axis=3), sl(q_pos, axis=1), None if q_doc is None else sl(q_doc, axis=1)
    k_r, v_r, kp, kd = ks(k, axis=2), ks(v, axis=2), ks(k_pos, axis=1), None if k_doc is None else ks(k_doc, axis=1)
    return q_i, k_r, v_r, _positional_mask(qp, kp, window, qd, kd)


def _pos_forward(q, k, v, q_pos, k_pos, q_doc, k_doc, window, block, key_len, stride):
    """q [B, K, G, T, H], k/v [B, K, Tk, H], positions [B or 1, T] / [B or 1, Tk] -> (o, lse).
    Query block i (``block`` positions) scores keys [i stride, i stride + key_len) under the mask of
    their true positions; a ``lax.scan`` over the blocks keeps one block's scores at a time."""
    H = q.shape[-1]
    scale = 1.0 / math.sqrt(H)
    prec = matmul_precision(q.dtype)

    def body(_, i):
        q_i, k_r, v_r, mask = _block_inputs(i, q, q_pos, q_doc, k, v, k_pos, k_doc, window, block, key_len, stride)
        s = masked_scores(q_i, k_r, scale, mask)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        row_sum = jnp.sum(e, axis=-1, keepdims=True)
        pv = jnp.einsum("bkgqt,bkth->bkgqh", e.astype(v.dtype), v_r, preferred_element_type=jnp.float32, precision=prec)
        return None, ((pv / row_sum).astype(q.dtype), (m + jnp.log(row_sum))[..., 0])

    _, (o, lse) = jax.lax.scan(body, None, jnp.arange(q.shape[3] // block))
    # [n, B, K, G, b, ...] -> [B, K, G, n b, ...]
    o = jnp.moveaxis(o, 0, 3).reshape(q.shape)
    lse = jnp.moveaxis(lse, 0, 3).reshape(q.shape[:4])
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _pos_attend(q, k, v, q_pos, k_pos, q_doc, k_doc, window, block, key_len, stride):
    return _pos_forward(q, k, v, q_pos, k_pos, q_doc, k_doc, window, block, key_len, stride)[0]


def _pos_attend_fwd(q, k, v, q_pos, k_pos, q_doc, k_doc, window, block, key_len, stride):
    o, lse = _pos_forward(q, k, v, q_pos, k_pos, q_doc, k_doc, window, block, key_len, stride)
    return o, (q, k, v, q_pos, k_pos, q_doc, k_doc, o, lse)


def _pos_attend_bwd(window, block, key_len, stride, residuals, do):
    q, k, v, q_pos, k_pos, q_doc, k_doc, o, lse = residuals
    scale = 1.0 / math.sqrt(q.shape[-1])
    prec = matmul_precision(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)

    def body(carry, i):
        dk, dv = carry
        q_i, k_r, v_r, mask = _block_inputs(i, q, q_pos, q_doc, k, v, k_pos, k_doc, window, block, key_len, stride)
        rows = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=i * block, slice_size=block, axis=3)
        do_i, lse_i, delta_i = rows(do), rows(lse), rows(delta)
        s = masked_scores(q_i, k_r, scale, mask)
        p = jnp.exp(s - lse_i[..., None])
        dv_r = jnp.einsum(
            "bkgqt,bkgqh->bkth", p.astype(do.dtype), do_i, preferred_element_type=jnp.float32, precision=prec
        )
        dp = jnp.einsum("bkgqh,bkth->bkgqt", do_i, v_r, preferred_element_type=jnp.float32, precision=prec)
        ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
        dq_i = jnp.einsum("bkgqt,bkth->bkgqh", ds, k_r, preferred_element_type=jnp.float32, precision=prec)
        dk_r = jnp.einsum("bkgqt,bkgqh->bkth", ds, q_i, preferred_element_type=jnp.float32, precision=prec)

        def add(acc, part):
            cur = jax.lax.dynamic_slice_in_dim(acc, i * stride, key_len, axis=2)
            return jax.lax.dynamic_update_slice_in_dim(acc, cur + part, i * stride, axis=2)

        return (add(dk, dk_r), add(dv, dv_r)), dq_i

    # zeros_like: the accumulators vary over the mesh axes as k does (inside shard_map).
    zeros = jnp.zeros_like(k, dtype=jnp.float32)
    (dk, dv), dq = jax.lax.scan(body, (zeros, zeros), jnp.arange(q.shape[3] // block))
    dq = jnp.moveaxis(dq, 0, 3).reshape(q.shape).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_pos_attend.defvjp(_pos_attend_fwd, _pos_attend_bwd)


def positional_attention(q, k, v, q_pos, k_pos, q_doc=None, k_doc=None, *, window=None, block, key_len=None, stride=0):
    """Attention of queries at positions ``q_pos`` to keys at ``k_pos`` (any order: what is visible
    follows from the positions alone), q [B, K, G, T, H], k/v [B, K, Tk, H], positions [B or 1, T]
    and [B or 1, Tk] int32, documents [B, T] / [B, Tk] or None. Query block i scores keys
    [i stride, i stride + key_len) (default: all of them, stride 0): the caller picks the static
    range that holds every key a block may see. Every query must see at least one key (its own)."""
    key_len = k.shape[2] if key_len is None else key_len
    if q.shape[3] % block:
        raise ValueError(f"context attention block {block} does not divide the {q.shape[3]} queries")
    return _pos_attend(q, k, v, q_pos, k_pos, q_doc, k_doc, window, block, key_len, stride)


def halo_gathers(layout_degree: int, window: int, chunk: int) -> bool:
    """Whether a sliding layer exchanges only the window's keys (True) or falls back to the global
    layers' all-gather (False). Per device the halo path moves about 2 (window - 1) keys (the keys
    before each of its two chunks); the all-gather (degree - 1) / degree of the sequence, 2
    (degree - 1) chunks. The halo path is taken when it moves fewer: window - 1 < (degree - 1) x
    chunk; a window that reaches further (more than half the sequence at degree 2) gathers."""
    return window - 1 < (layout_degree - 1) * chunk


def _halo(x, seq_axis: int, window: int, chunk: int, degree: int, axis: str, rank, invalid):
    """The ``window - 1`` values before each of this device's two chunks, nearest last: a pair
    [halo of slot 0, halo of slot 1], each of length window - 1 along ``seq_axis``. ``x`` holds the
    device's two chunks along ``seq_axis``. Built from ``lax.ppermute`` of chunk tails only (for
    each chunk distance d the sources are static; module ``olmo_model.context``): the early chunk
    r's d-th predecessor is rank r - d's early chunk; the late chunk (2C - 1 - r)'s is rank r + d's
    late chunk while r + d < C, else rank 2C - 1 - r - d's early chunk. ``invalid`` replaces what
    lies before the sequence's start (a scalar fill)."""
    C, need = degree, window - 1
    halo_chunks = -(-need // chunk)
    slots = [jax.lax.slice_in_dim(x, s * chunk, (s + 1) * chunk, axis=seq_axis) for s in (0, 1)]
    early, late = [], []
    for d in range(halo_chunks, 0, -1):  # farthest first: the halo is in sequence order
        length = min(chunk, need - (d - 1) * chunk)

        def tail(s, length=length):
            return jax.lax.slice_in_dim(slots[s], chunk - length, chunk, axis=seq_axis)

        def permute(s, pairs, length=length):
            if not pairs:
                return jnp.zeros_like(tail(s, length))
            return jax.lax.ppermute(tail(s, length), axis, pairs)

        def table(values):
            return jnp.asarray(np.array(values))[rank]

        got = permute(0, [(src, src + d) for src in range(C - d)])
        early.append(jnp.where(table([r >= d for r in range(C)]), got, invalid))
        from_late = permute(1, [(r + d, r) for r in range(C) if r + d <= C - 1])
        from_early = permute(0, [(2 * C - 1 - r - d, r) for r in range(C) if r + d > C - 1 and 2 * C - 1 - r - d >= 0])
        use_late = table([r + d <= C - 1 for r in range(C)])
        exists = table([2 * C - 1 - r - d >= 0 for r in range(C)])
        late.append(jnp.where(exists, jnp.where(use_late, from_late, from_early), invalid))
    return jnp.concatenate(early, axis=seq_axis), jnp.concatenate(late, axis=seq_axis)


def _context_local(q, k, v, pos, doc, *, window, degree, axis, seq_len, heads_total):
    """One device's share: q [b, 2c, N', H], k/v [b, 2c, K', H] (its two chunks), pos [2c], doc
    [b, 2c] or None -> [b, 2c, N', H]."""
    b, T, N, H = q.shape
    Kh = k.shape[2]
    qt = q.reshape(b, T, Kh, N // Kh, H).transpose(0, 2, 3, 1, 4)  # [b, K, G, 2c, H]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [b, K, 2c, H]
    if window is not None and window >= seq_len:
        window = None
    if window is not None and halo_gathers(degree, window, T // 2):
        o = _sliding_local(qt, kt, vt, pos, doc, window, degree, axis, heads_total)
    else:
        o = _gathered_local(qt, kt, vt, pos, doc, window, degree, axis, heads_total)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, T, N, H)


def _sliding_local(qt, kt, vt, pos, doc, window, degree, axis, heads_total):
    """A sliding layer on one device: qt [b, K, G, 2c, H], kt/vt [b, K, 2c, H]; each chunk's
    queries against [halo (window - 1), own chunk] keys, both chunks as one batch of 2b."""
    b, c, C = qt.shape[0], qt.shape[3] // 2, degree
    rank = jax.lax.axis_index(axis)
    need = window - 1
    hk = _halo(kt, 2, window, c, C, axis, rank, 0.0)
    hv = _halo(vt, 2, window, c, C, axis, rank, 0.0)
    hp = _halo(pos, 0, window, c, C, axis, rank, _NO_KEY)
    hd = None if doc is None else _halo(doc, 1, window, c, C, axis, rank, -1)
    ext_k = jnp.concatenate([jnp.concatenate([hk[s], kt[:, :, s * c : (s + 1) * c]], axis=2) for s in (0, 1)])
    ext_v = jnp.concatenate([jnp.concatenate([hv[s], vt[:, :, s * c : (s + 1) * c]], axis=2) for s in (0, 1)])
    ext_p = jnp.stack([jnp.concatenate([hp[s], pos[s * c : (s + 1) * c]]) for s in (0, 1)])  # [2, need + c]
    q2 = jnp.concatenate([qt[:, :, :, :c], qt[:, :, :, c:]])  # [2b, K, G, c, H]
    q_pos = jnp.repeat(pos.reshape(2, c), b, axis=0)
    k_pos = jnp.repeat(ext_p, b, axis=0)
    q_doc = k_doc = None
    if doc is not None and hd is not None:
        q_doc = jnp.concatenate([doc[:, :c], doc[:, c:]])
        k_doc = jnp.concatenate([jnp.concatenate([hd[s], doc[:, s * c : (s + 1) * c]], axis=1) for s in (0, 1)])
    block = context_block(c, 2 * b, heads_total, need + c)
    o2 = positional_attention(
        q2, ext_k, ext_v, q_pos, k_pos, q_doc, k_doc, window=window, block=block, key_len=need + block, stride=block
    )
    return jnp.concatenate([o2[:b], o2[b:]], axis=3)


def _gathered_local(qt, kt, vt, pos, doc, window, degree, axis, heads_total):
    """A global layer (or a window reaching too far for the halo) on one device: every device
    gathers all K/V (and their positions and documents); its early chunk (chunk r < C) can only
    see the first half of the sequence, which is every rank's early chunk, its late chunk all of it."""
    b, c, C = qt.shape[0], qt.shape[3] // 2, degree
    kg = jax.lax.all_gather(kt, axis, axis=2, tiled=True)  # [b, K, S, H] in rank order
    vg = jax.lax.all_gather(vt, axis, axis=2, tiled=True)
    pg = jax.lax.all_gather(pos, axis, axis=0, tiled=True)
    dg = None if doc is None else jax.lax.all_gather(doc, axis, axis=1, tiled=True)

    def first_half(x, seq_axis):
        shape = x.shape[:seq_axis] + (C, 2, c) + x.shape[seq_axis + 1 :]
        return jax.lax.index_in_dim(x.reshape(shape), 0, seq_axis + 1, keepdims=False).reshape(
            x.shape[:seq_axis] + (C * c,) + x.shape[seq_axis + 1 :]
        )

    outs = []
    for s, keys in ((0, C * c), (1, C * 2 * c)):
        k_s, v_s, p_s = (first_half(kg, 2), first_half(vg, 2), first_half(pg, 0)) if s == 0 else (kg, vg, pg)
        d_s = None if dg is None else (first_half(dg, 1) if s == 0 else dg)
        block = context_block(c, b, heads_total, keys)
        outs.append(
            positional_attention(
                qt[:, :, :, s * c : (s + 1) * c],
                k_s,
                v_s,
                pos[None, s * c : (s + 1) * c],
                p_s[None],
                None if doc is None else doc[:, s * c : (s + 1) * c],
                d_s,
                window=window,
                block=block,
            )
        )
    return jnp.concatenate(outs, axis=3)


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    window: int | None,
    doc_ids: jax.Array | None,
    positions: jax.Array,
    setup: ContextParallel,
) -> jax.Array:
    """Causal attention of one layer whose sequence axis is split over ``setup``'s context axis in
    the zigzag layout: q [B, S, N, H], k/v [B, S, K, H] (global view, columns in the layout's
    order), ``positions`` [S] every column's true position, ``doc_ids`` [B, S] or None. Global
    layers all-gather K/V over the context axis; sliding layers fetch only the ``window - 1`` keys
    before each chunk from the ranks holding them (``lax.ppermute``), or all-gather when the window
    reaches further than that saves (``halo_gathers``). Returns [B, S, N, H] in the same order."""
    B, S, N, H = q.shape
    C = setup.degree
    if S % (2 * C):
        raise ValueError(f"sequence length {S} does not split into 2 x {C} chunks for context degree {C}")
    heads = setup.head_axis
    tok = P(setup.batch_axes, setup.axis, heads, None)
    seq = P(setup.axis)
    row = P(setup.batch_axes, setup.axis)
    tensor = setup.mesh.shape[heads] if heads is not None else 1
    batch_devices = math.prod(setup.mesh.shape[a] for a in setup.batch_axes)
    body = functools.partial(
        _context_local,
        window=window,
        degree=C,
        axis=setup.axis,
        seq_len=S,
        heads_total=N // tensor,
    )
    if B % batch_devices:
        raise ValueError(f"{B} rows cannot be split over the {batch_devices} data-parallel devices")
    if doc_ids is None:
        return jax.shard_map(
            lambda q, k, v, p: body(q, k, v, p, None), mesh=setup.mesh, in_specs=(tok, tok, tok, seq), out_specs=tok
        )(q, k, v, positions)
    return jax.shard_map(body, mesh=setup.mesh, in_specs=(tok, tok, tok, seq, row), out_specs=tok)(
        q, k, v, positions, doc_ids
    )

"""Output head + cross-entropy + z-loss in one pass over token chunks, with its own backward.

The plain path materialises the float32 logits of every token ([tokens, padded_vocab]: 1.6 GB
for 4096 tokens of the 100k Olmo 3 vocabulary), then autodiff makes the softmax and its
cotangent the same size again and XLA:CPU transposes that cotangent for the head's weight
gradient. Here the logits of one chunk of positions exist at a time:

- forward (what ``jax.grad`` runs): per chunk, logits = x_c @ head, logsumexp, the chunk's CE
  and z-loss sums, and at once d x_c and the chunk's share of d head from the gradient of
  ``ce + z_weight * z`` with respect to the logits, ``a e - onehot`` (e = exp(logits - max),
  a = (1 + 2 z_weight lse) / sum e per row). That gradient is never formed: ``a`` scales the
  thin sides of the two matmuls that read e, which saves one pass over the [rows, vocab]
  chunk (olmo3-30m, seq 512, batch 8: head + loss 3.32 -> 3.10 s, ``tools/bench/bench_step_pieces.py``);
  the onehot part, a gather of head columns (d x) and a scatter-add of x rows (d head), is
  taken once for the whole batch (per chunk, a data-parallel step all-reduced it per chunk
  too: twice the head-gradient traffic); the chunk's logits are then dropped;
- backward: the saved gradients times the incoming cotangent of the (scalar) objective.

So a training step does the usual three head matmuls (no recomputation: model FLOPs stay
honest) and holds one chunk of logits instead of all of them. Without ``jax.grad`` (evaluation)
only the forward sums run. Chunks split the sequence axis, never the batch axis, so a batch
sharded over data/fsdp devices stays where it is; a vocabulary-sharded head (tensor axis) is
reduced by XLA inside the chunk. Under context parallelism (the sequence axis split over
``seq_shards`` devices) a chunk takes ``chunk`` positions from every device's share of the
sequence, so the scan walks each device's own columns and none move.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from olmo_data.order import IGNORE_INDEX  # the loader's label for "no next token"
from olmo_model.maths import HEAD_CHUNK_BYTES

from .precision import matmul_precision

# One chunk's float32 logits stay near this many bytes (shared with olmo-plan's memory model).
CHUNK_BYTES = HEAD_CHUNK_BYTES


def head_chunk(batch: int, seq_len: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Largest divisor of ``seq_len`` whose chunk logits (batch x c x vocab float32) fit
    ``chunk_bytes``; at least 1."""
    best = 1
    for c in range(1, seq_len + 1):
        if seq_len % c == 0 and batch * c * vocab * 4 <= chunk_bytes:
            best = c
    return best


def _chunks(a: jax.Array, c: int, shards: int = 1) -> jax.Array:
    """[B, S, ...] -> [S // c, B, c, ...]; with ``shards`` > 1, [S // (shards c), B, shards, c,
    ...]: chunk i holds positions [i c, (i+1) c) of each of the ``shards`` contiguous shares of
    the sequence (one per device), the shares kept as their own axis, which stays split over the
    devices (merging it with c would not be a contiguous split, and XLA would gather the rows)."""
    B, S = a.shape[:2]
    if shards == 1:
        return jnp.swapaxes(a.reshape(B, S // c, c, *a.shape[2:]), 0, 1)
    x = a.reshape(B, shards, S // (shards * c), c, *a.shape[2:])
    return jnp.moveaxis(x, 2, 0)


def _unchunk(a: jax.Array, shards: int = 1) -> jax.Array:
    """The inverse of ``_chunks``: [n, B, c, ...] or [n, B, shards, c, ...] -> [B, S, ...]."""
    if shards == 1:
        a = jnp.swapaxes(a, 0, 1)
        return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])
    n, B, _, c = a.shape[:4]
    return jnp.moveaxis(a, 0, 2).reshape(B, shards * n * c, *a.shape[4:])


def _chunk_sums(x_c, head, labels_c):
    """Logits of one chunk and its (CE sum, z sum, lse, valid mask), float32."""
    logits = jnp.einsum(
        "...d,dv->...v", x_c, head, preferred_element_type=jnp.float32, precision=matmul_precision(x_c.dtype)
    )
    valid = labels_c != IGNORE_INDEX
    safe = jnp.where(valid, labels_c, 0)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(logits - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    lse = (jnp.log(s) + m)[..., 0]
    target = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    ce = jnp.sum(jnp.where(valid, lse - target, 0.0))
    z = jnp.sum(jnp.where(valid, lse * lse, 0.0))
    return logits, e, s, lse, valid, safe, ce, z


def _sums_only(x, head, labels, chunk, shards):
    def body(carry, xs):
        x_c, labels_c = xs
        *_, ce, z = _chunk_sums(x_c, head, labels_c)
        return (carry[0] + ce, carry[1] + z), None

    xs = (_chunks(x, chunk, shards), _chunks(labels, chunk, shards))
    (ce, z), _ = jax.lax.scan(body, (jnp.float32(0), jnp.float32(0)), xs)
    return ce, z


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _objective(x, head, labels, z_weight, chunk, shards):
    ce, z = _sums_only(x, head, labels, chunk, shards)
    return ce + z_weight * z, ce, z


def _objective_fwd(x, head, labels, z_weight, chunk, shards):
    # d(ce + w z)/d logits = a e - onehot(label) with a = (1 + 2 w lse) / s per row (zero where
    # ignored). Never materialised: per chunk, a scales the thin sides of the two matmuls,
    # which read e as it is (one [rows, vocab] pass fewer than forming the gradient); the
    # onehot part, a gather of head columns (d x) and a scatter-add of x rows (d head), is
    # taken once for the whole batch, so a data-parallel step reduces it once, not per chunk.
    precision = matmul_precision(x.dtype)

    def chunk_grads(x_c, labels_c):
        _, e, s, lse, valid, _, ce, z = _chunk_sums(x_c, head, labels_c)
        a = jnp.where(valid, 1.0 + 2.0 * z_weight * lse, 0.0)[..., None] / s
        e = e.astype(x_c.dtype)
        dx_c = a * jnp.einsum("...v,dv->...d", e, head, preferred_element_type=jnp.float32, precision=precision)
        ax = (a * x_c.astype(jnp.float32)).astype(x_c.dtype)
        dhead_c = jnp.einsum("...d,...v->dv", ax, e, preferred_element_type=jnp.float32, precision=precision)
        return ce, z, dhead_c, dx_c

    def body(carry, xs):
        ce_acc, z_acc, dhead = carry
        ce, z, dhead_c, dx_c = chunk_grads(*xs)
        return (ce_acc + ce, z_acc + z, dhead + dhead_c), dx_c

    # The first chunk starts the sums (no zero-filled [d, V] buffer and no add of it: at 100k
    # vocab both are whole passes over the head's size), the onehot part goes into it in
    # place, and the scan adds the other chunks.
    x_chunks, label_chunks = _chunks(x, chunk, shards), _chunks(labels, chunk, shards)
    ce, z, dhead, dx_first = chunk_grads(x_chunks[0], label_chunks[0])
    valid = labels != IGNORE_INDEX
    safe = jnp.where(valid, labels, 0)
    if shards == 1:
        rows = jnp.where(valid[..., None], x, 0).astype(jnp.float32).reshape(-1, x.shape[-1])
        dhead = dhead.at[:, safe.reshape(-1)].add(-rows.T)
    else:  # [B, S] indices as they are: flattening a sequence-split batch would gather it
        rows = jnp.where(valid[..., None], x, 0).astype(jnp.float32)
        dhead = dhead.at[:, safe].add(-jnp.moveaxis(rows, -1, 0))
    (ce, z, dhead), dx_rest = jax.lax.scan(body, (ce, z, dhead), (x_chunks[1:], label_chunks[1:]))
    dx = _unchunk(jnp.concatenate([dx_first[None], dx_rest]), shards)
    dx = dx - jnp.where(valid[..., None], jnp.take(head, safe, axis=1).transpose(1, 2, 0), 0.0)
    return (ce + z_weight * z, ce, z), (dx.astype(x.dtype), dhead.astype(head.dtype))


def _objective_bwd(z_weight, chunk, shards, residuals, cotangents):
    dx, dhead = residuals
    # Only the objective is differentiable: head_loss() stops the gradient of ce and z.
    g = cotangents[0]
    return (dx * g.astype(dx.dtype), dhead * g.astype(dhead.dtype), None)


_objective.defvjp(_objective_fwd, _objective_bwd)


def head_loss_sums(
    x: jax.Array,
    head: jax.Array,
    labels: jax.Array,
    z_weight: float,
    chunk: int | None = None,
    *,
    batch_shards: int = 1,
    seq_shards: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(ce + z_weight * z, ce, z, valid tokens) summed over labels != -100, float32.

    ``x`` [B, S, d] final-normed hidden states, ``head`` [d, V] in the compute dtype, ``labels``
    [B, S]. Only the first value is differentiable (its gradient is exact, computed chunk by
    chunk); ce and z are reported sums. ``chunk``: positions per chunk, a divisor of S
    (default: ``head_chunk`` for the B / ``batch_shards`` rows one device holds, since
    under jit ``x`` is the global batch and each device computes only its rows' logits).
    ``seq_shards``: the devices the sequence axis is split over (context parallelism); ``chunk``
    then counts positions of one device's S / seq_shards and must divide that."""
    B, S, _ = x.shape
    if S % seq_shards:
        raise ValueError(f"sequence length {S} does not split over {seq_shards} context shards")
    local = S // seq_shards
    if chunk is None:
        chunk = head_chunk(max(B // batch_shards, 1), local, head.shape[-1])
    if local % chunk:
        per_shard = f" per context shard ({seq_shards} shards)" if seq_shards > 1 else ""
        raise ValueError(f"head_loss chunk={chunk} does not divide the sequence length {local}{per_shard}")
    labels = labels.astype(jnp.int32)
    objective, ce, z = _objective(x, head, labels, float(z_weight), int(chunk), int(seq_shards))
    n = jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)
    return objective, jax.lax.stop_gradient(ce), jax.lax.stop_gradient(z), n

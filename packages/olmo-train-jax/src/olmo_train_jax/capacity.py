"""The capacity rule of ``olmo_model.moe`` (the recipe's ``moe.capacity_factor``) in the JAX MoE
block: which (token, slot) assignments are kept, and the routed experts run on static,
capacity-sized buffers.

Each (expert, sequence) cell of the B sequences at hand owns C rows of a dispatch buffer of
``E x B x C`` rows, expert-major (row ``(e x B + b) x C + position``, ``olmo_model.moe``'s
layout); a kept assignment goes to its row, empty rows stay zero, a dropped assignment goes
nowhere and gets a zero output. Every shape is a function of (B, S, k, E, C): locally the
buffer is E equal groups of B x C rows (``grouped_gemm.batched_swiglu``); under expert
parallelism (``expert_parallel``) device r's E/ep experts are the rows
``[r, r+1) x (E/ep) x B x C``, so one ``all_to_all`` of equal splits moves at most C rows per
(sequence, expert), about ``capacity_factor`` times the minimum, instead of room for every
assignment at every destination. Zero rows through a SwiGLU without bias give zero, so empty
slots need no count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmo_model.moe import dispatch_rows, expert_capacity

from .grouped_gemm import ExpertWeights, batched_swiglu


class CapacitySlots(NamedTuple):
    """Where the assignments of B sequences go in the dispatch buffer."""

    keep: jax.Array  # [B*S*k] bool, flat (sequence, token, slot) order: kept by the rule
    slot: jax.Array  # [B*S*k] int32: a kept assignment's buffer row; ``rows`` when dropped
    source: jax.Array  # [rows] int32: the assignment filling each buffer row; B*S*k when empty


def capacity_slots(experts: jax.Array, n_experts: int, capacity: int) -> CapacitySlots:
    """The rule on ``experts`` [B, S, k] (each sequence's routing) with C = ``capacity``: an
    assignment's position is its rank among its (expert, sequence) cell's assignments in token
    order (a stable sort by cell), kept when below C (``olmo_model.moe.capacity_keep``)."""
    b, s, k = experts.shape
    n = b * s * k
    cell = experts.reshape(-1).astype(jnp.int32) * b + jnp.repeat(jnp.arange(b, dtype=jnp.int32), s * k)
    order = jnp.argsort(cell, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(cell, length=n_experts * b).astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    position = rank - starts[cell]
    keep = position < capacity
    rows = dispatch_rows(b, n_experts, capacity)
    slot = jnp.where(keep, cell * capacity + position, rows)
    # Row (cell, p) holds the cell's p-th assignment in sorted order, if it has one.
    row = jnp.arange(rows, dtype=jnp.int32)
    row_cell, row_position = row // capacity, row % capacity
    filled = row_position < sizes[row_cell]
    source = jnp.where(filled, order[jnp.minimum(starts[row_cell] + row_position, n - 1)], n)
    return CapacitySlots(keep, slot, source)


def routed_with_capacity(
    x: jax.Array,
    experts: jax.Array,
    n_experts: int,
    sequence_length: int,
    capacity_factor: float,
    run_buffer: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """(expert output per flat (token, slot) [T*k, d], zero where dropped; kept count) for tokens
    ``x`` [T, d] in sequences of ``sequence_length`` with ``experts`` [T, k] (ids among
    ``n_experts``):
    the buffer [E x B x C, d] is filled, ``run_buffer`` computes it, each kept assignment
    reads its row back."""
    n_tokens, k = experts.shape
    if n_tokens % sequence_length:
        raise ValueError(
            f"moe.capacity_factor: {n_tokens} tokens are not whole sequences of {sequence_length}; "
            "each device must hold whole sequences (make the batch a multiple of the token-splitting devices)"
        )
    c = expert_capacity(capacity_factor, sequence_length, k, n_experts)
    slots = capacity_slots(experts.reshape(-1, sequence_length, k), n_experts, c)
    zero = jnp.zeros((1, x.shape[-1]), x.dtype)
    token = jnp.where(slots.source < n_tokens * k, slots.source // k, n_tokens)
    out = run_buffer(jnp.concatenate([x, zero])[token])
    ys = jnp.concatenate([out, zero.astype(out.dtype)])[slots.slot]
    return ys, jnp.sum(slots.keep, dtype=jnp.int32)


def local_buffer(w: ExpertWeights, mxfp8: bool) -> Callable[[jax.Array], jax.Array]:
    """``run_buffer`` with every expert here: E equal groups, one batched SwiGLU."""

    def run(buffer: jax.Array) -> jax.Array:
        d = buffer.shape[-1]
        return batched_swiglu(buffer.reshape(w.gate.shape[0], -1, d), w, mxfp8=mxfp8).reshape(-1, d)

    return run

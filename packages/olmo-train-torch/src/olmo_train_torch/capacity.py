"""The capacity rule of ``olmo_model.moe`` (the recipe's ``moe.capacity_factor``) in the torch MoE
block: which (token, slot) assignments are kept, and the routed experts run on static,
capacity-sized buffers.

Each (expert, sequence) cell of this rank's B sequences owns C rows of a dispatch buffer of
``E x B x C`` rows, expert-major (row ``(e x B + b) x C + position``, ``olmo_model.moe``'s
layout); a kept assignment goes to its row, empty rows stay zero, a dropped assignment goes
nowhere and gets a zero output. Every shape is a function of (B, S, k, E, C) alone: nothing is
read to the host and nothing depends on what another rank sends, so the path runs under a fake
process group (the dry run) and costs no host synchronisation. Locally the buffer is E equal
groups of B x C rows (``GroupedExperts.forward_batched``); under expert parallelism the
dispatcher exchanges it (``expert_parallel.ExpertParallelDispatcher.exchange``: rank r's E/ep
experts are rows ``[r, r+1) x (E/ep) x B x C``, so all-to-alls of equal splits). Zero rows
through a SwiGLU without bias give zero, so empty slots change nothing and need no count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from olmo_model.moe import dispatch_rows


class CapacitySlots(NamedTuple):
    """Where the assignments of B sequences go in the dispatch buffer."""

    keep: torch.Tensor  # [B*S*k] bool, flat (sequence, token, slot) order: kept by the rule
    slot: torch.Tensor  # [B*S*k] int64: a kept assignment's buffer row; ``rows`` when dropped
    source: torch.Tensor  # [rows] int64: the assignment filling each buffer row; B*S*k when empty
    tokens_per_expert: torch.Tensor  # [E] int64: assignments per expert before the rule
    rows: int  # E x B x C


def capacity_slots(experts: torch.Tensor, n_experts: int, capacity: int) -> CapacitySlots:
    """The rule on ``experts`` [B, S, k] (each sequence's routing) with C = ``capacity``: an
    assignment's position is its rank among its (expert, sequence) cell's assignments in token
    order (a stable sort by cell), kept when below C (``olmo_model.moe.capacity_keep``)."""
    b, s, k = experts.shape
    n = b * s * k
    flat = experts.reshape(-1)
    sequence = torch.arange(b, device=flat.device).repeat_interleave(s * k)
    cell = flat * b + sequence
    order = torch.argsort(cell, stable=True)
    sizes = torch.zeros(n_experts * b, dtype=torch.long, device=flat.device)
    sizes.scatter_add_(0, cell, torch.ones_like(cell))
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=flat.device))
    position = rank - starts[cell]
    keep = position < capacity
    rows = dispatch_rows(b, n_experts, capacity)
    slot = torch.where(keep, cell * capacity + position, rows)
    # Row (cell, p) holds the cell's p-th assignment in sorted order, if it has one: a gather
    # (each assignment read once), so the backward adds into distinct rows.
    row_cell = torch.arange(rows, device=flat.device) // capacity
    row_position = torch.arange(rows, device=flat.device) % capacity
    filled = row_position < sizes[row_cell]
    at = (starts[row_cell] + row_position).clamp_max(n - 1)
    source = torch.where(filled, order[at], n)
    return CapacitySlots(keep, slot, source, sizes.view(n_experts, b).sum(1), rows)


def routed_with_capacity(per_slot_in: torch.Tensor, slots: CapacitySlots, run_buffer) -> torch.Tensor:
    """The expert output of every assignment [B*S*k, d] (zero for a dropped one) from its input
    rows ``per_slot_in`` [B*S*k, d]: the buffer is filled by ``slots.source``, ``run_buffer``
    ([rows, d] -> [rows, d]) computes it, and each kept assignment reads its row back."""
    d = per_slot_in.shape[-1]
    zero = per_slot_in.new_zeros(1, d)
    buffer = torch.cat([per_slot_in, zero])[slots.source]
    out = run_buffer(buffer)
    return torch.cat([out, zero.to(out.dtype)])[slots.slot]

"""MoE maths both trainers share, written once: the routing modes, the aux-loss weighting,
the MoE keys of a train line with the per-rank load figure, the MXFP8 format constants and the
capacity rule (``capacity_keep``, the numpy reference both trainers' dispatch is tested against).
The trainers compute the per-step statistics on their own arrays and hand plain numbers here.

The capacity rule (the recipe's ``moe.capacity_factor``; null: dropless, every assignment
computed). Capacity is per (sequence, expert): each sequence of S tokens may send at most
``C = min(S, ceil(factor x S x k / E))`` of its (token, slot) assignments to one expert
(``expert_capacity``; the factor is read as the decimal it is written as, so 1.1 x 40 is 44).
Over capacity, an expert keeps a sequence's first C assignments in token order and drops the
rest (a tail drop, as OLMo-core's no-sync expert parallelism); a token sends at most one
assignment to an expert, so the order of its k slots does not matter. A dropped assignment
contributes nothing to the token's output (the residual carries the token), and counts in
``moe_dropped_tokens``.

Why per (sequence, expert) and not per expert-parallel rank (OLMo-core's rank capacity,
``ceil(factor x the rank's routed rows)``, pooled over source ranks): the kept set is then a
function of each sequence's routing alone, the same on one device or any data / expert-parallel
layout (so a one-process run, a resumed run on another rank count and the twin trainer drop the
same pairs), each rank decides it without exchanging counts, and every buffer is static: a rank
holding B sequences sends ``E x B x C`` rows (``dispatch_rows``; B x C to each expert, E/ep
experts' worth to each expert-parallel rank) with all-to-alls of equal splits, about
``factor`` times the minimum (B x S x k), where pooling over sources would need room for the
whole rank capacity from every source (ep times that) or host-synchronised split sizes."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from .spec import MoESpec

RoutingMode = Literal["learned", "random", "uniform"]
# learned: the router is trained; random / uniform: router scores replaced by random numbers /
# a fixed equal split, systems benchmarks whose router gets no gradient and no aux loss.
ROUTING_MODES: tuple[str, ...] = ("learned", "random", "uniform")

# The MoE keys of a train line, after metrics.TRAIN_KEYS, in this order.
MOE_KEYS = (
    "moe_tokens_per_expert",  # assignments per routed expert, summed over MoE layers
    "moe_rank_load_max_over_mean",  # the busiest expert-parallel rank's assignments over the mean
    "moe_dropped_tokens",  # assignments not computed (0 for the dropless blocks)
    "moe_lb_loss",  # load-balancing loss, unweighted, mean over MoE layers
    "moe_router_z_loss",  # router z-loss, unweighted, mean over MoE layers
)

MX_BLOCK = 32  # elements sharing one e8m0 scale (OCP Microscaling spec v1.0)
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def check_routing(mode: str) -> None:
    if mode not in ROUTING_MODES:
        raise ValueError(f"routing='{mode}' is unknown; use one of: {', '.join(ROUTING_MODES)}")


def aux_loss(load_balancing: Any, router_z: Any, moe: MoESpec, routing: str = "learned") -> Any:
    """The aux term of the training loss from the two unweighted losses (arrays of any
    framework): lb_weight * lb + router_z_weight * z; zero (of the same kind) for random or
    uniform routing, whose router is not trained."""
    if routing != "learned":
        return 0.0 * load_balancing
    return moe.load_balancing_loss_weight * load_balancing + moe.router_z_loss_weight * router_z


def rank_load_max_over_mean(tokens_per_expert: Any, ep_size: int) -> float:
    """Per expert-parallel rank (contiguous blocks of E/ep experts): the assignments it
    computes over their mean; 1.0 is perfect balance, ep_size the worst case."""
    counts = np.asarray(tokens_per_expert, dtype=np.float64)
    if counts.shape[0] % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide n_experts={counts.shape[0]}; choose a divisor")
    per_rank = counts.reshape(ep_size, -1).sum(axis=1)
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


def moe_train_metrics(
    tokens_per_expert: Any, dropped: int, load_balancing: float, router_z: float, ep_size: int
) -> dict[str, float | int | list[int]]:
    """The MoE keys of a train line (``MOE_KEYS``) from one step's statistics."""
    counts = np.asarray(tokens_per_expert).astype(np.int64)
    values = (
        counts.tolist(),
        rank_load_max_over_mean(counts, ep_size),
        int(dropped),
        float(load_balancing),
        float(router_z),
    )
    return dict(zip(MOE_KEYS, values, strict=True))


def expert_capacity(capacity_factor: float, sequence_length: int, top_k: int, n_experts: int) -> int:
    """C: the assignments one expert takes from one sequence (module doc), at least 1 and at most
    the sequence length (an expert gets at most one assignment per token)."""
    if not capacity_factor > 0:
        raise ValueError(f"moe.capacity_factor={capacity_factor} must be > 0 (null: dropless)")
    # The factor as written (1.1, not the binary double just above it): 1.1 x 40 is 44, not 45.
    exact = Fraction(repr(float(capacity_factor))) * sequence_length * top_k / n_experts
    return max(1, min(sequence_length, math.ceil(exact)))


def dispatch_rows(n_sequences: int, n_experts: int, capacity: int) -> int:
    """Rows of the static dispatch buffer of ``n_sequences`` sequences: C rows per (expert,
    sequence), expert-major (row ``(e x B + b) x C + position``)."""
    return n_experts * n_sequences * capacity


def capacity_keep(experts: Any, n_experts: int, capacity: int) -> np.ndarray:
    """Which (token, slot) assignments the capacity rule keeps: ``experts`` [B, S, k] (integer
    expert ids, B sequences of S tokens) -> bool [B, S, k]. An assignment's position is the
    number of assignments to the same expert earlier in its sequence (flat (token, slot) order);
    it is kept when its position is below ``capacity``. The numpy reference of both trainers."""
    experts = np.asarray(experts)
    if experts.ndim != 3:
        raise ValueError(f"capacity_keep: experts must be [sequences, tokens, k], got shape {experts.shape}")
    b, s, k = experts.shape
    one_hot = experts.reshape(b, s * k, 1) == np.arange(n_experts)  # [B, S*k, E]
    earlier = np.cumsum(one_hot, axis=1) - one_hot  # assignments to each expert before this one
    position = np.take_along_axis(earlier, experts.reshape(b, s * k, 1), axis=2)[..., 0]
    return (position < capacity).reshape(b, s, k)


def kept_pairs(experts: Any, keep: Any, n_experts: int) -> np.ndarray:
    """The kept (token, expert) pairs as a mask [tokens, E] from ``experts`` [..., k] and ``keep``
    [..., k]: independent of the order of a token's k slots (which the trainers choose
    differently), so two trainers' drops compare as masks."""
    experts = np.asarray(experts).reshape(-1, np.shape(experts)[-1])
    keep = np.asarray(keep).reshape(experts.shape)
    mask = np.zeros((experts.shape[0], n_experts), dtype=bool)
    rows = np.repeat(np.arange(experts.shape[0]), experts.shape[1])
    mask[rows[keep.reshape(-1)], experts.reshape(-1)[keep.reshape(-1)]] = True
    return mask

"""MoE maths both trainers share, written once: the routing modes, the aux-loss weighting,
the MoE keys of a train line with the per-rank load figure, and the MXFP8 format constants.
The trainers compute the per-step statistics on their own arrays and hand plain numbers here."""

from __future__ import annotations

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

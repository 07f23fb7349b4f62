"""Which parameters AdamW decays, by parameter name, for both trainers.

Both models name a tensor the same way (``embed``, ``attn_norm``, ``mlp_norm``, ``final_norm``,
``q_norm`` / ``k_norm``, the routed experts under ``experts`` in torch and ``expert_*`` in
JAX's stacked layers). A name is a dotted path: torch's ``named_parameters()`` names, JAX's
state paths joined by dots. The groups travel in torch checkpoints, in this order.
"""

from __future__ import annotations

from .recipe import OptimSection

DECAY_GROUPS = ("matrices", "experts", "embedding", "norms")


def decay_group(name: str) -> str:
    """``embedding`` (the input embedding), ``norms`` (RMSNorm weights), ``experts`` (routed
    expert weights; shared experts are plain matrices) or ``matrices`` (everything else: the
    projections, the router, the output head)."""
    parts = name.split(".")
    if parts[-1] in ("weight", "value"):
        parts = parts[:-1]
    leaf = parts[-1]
    if parts[0] == "embed":
        return "embedding"
    if leaf.endswith("norm"):
        return "norms"
    if "experts" in parts or leaf.startswith("expert_"):
        return "experts"
    return "matrices"


def group_weight_decay(group: str, optim: OptimSection) -> float:
    """AdamW's decoupled decay of a group: every matrix decays (routed experts included); the
    input embedding only with ``decay_embeddings`` (Olmo 3: not); norms only with ``decay_norms``."""
    if group == "embedding":
        return optim.weight_decay if optim.decay_embeddings else 0.0
    if group == "norms":
        return optim.weight_decay if optim.decay_norms else 0.0
    if group not in DECAY_GROUPS:
        raise ValueError(f"unknown decay group {group!r}; one of {DECAY_GROUPS}")
    return optim.weight_decay

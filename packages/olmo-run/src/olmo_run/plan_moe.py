"""olmo-plan's per-layer terms: the routed experts' parameters and what a torch block keeps for its
backward, by layer kind (dense or mixture-of-experts), so that a spec whose layers differ (OLMo-core
3's dense leading blocks before its MoE blocks) is counted layer by layer.

The torch counts are values per token in bf16 units (2 bytes; an fp32 tensor counts twice), as
autograd saves them in the eager step (``saved_tensors_hooks`` on the blocks of olmoe3-t001, whose
d_model equals its expert width, and olmoe3-u001, whose do not, both within 1.1% of these):

- attention and norms, every layer: ``10 d + 6 q + 6 kv``: each RMSNorm keeps its input and its
  normalised value in fp32 (2 x 2 units of its width: the block's two norms 8 d, the QK-norms
  4 q + 4 kv), and the bf16 tensors the matmuls and the attention keep: the block input and the
  MLP input (2 d), q and the attention output (2 q), k and v (2 kv); peri-norm blocks (OLMo-core
  3's) have two input norms more, 8 d;
- a dense MLP: gate and up outputs, their SiLU and product: ``4 ff``;
- an MoE MLP, dropless (``moe.capacity_factor`` null): per routed (token, slot) row the sorted
  input and the expert outputs put back in slot order (2 d, plus the slot-ordered copy the
  weighting keeps: 3 d in all) and the gate and up outputs, SiLU and product (4 h): ``k (3 d + 4 h)``
  per token; with a capacity factor the experts run on the static E x B x C buffer
  (``olmo_train_torch.capacity``), rho = E C / (S k) rows per assignment (C =
  ``olmo_model.moe.expert_capacity``), keeping per buffer row its input and the 4 hidden-wide
  tensors and per assignment the slot-ordered output: ``rho k (d + 4 h) + k d``; then each shared
  expert's ``4 h_shared`` (its input is the MLP input above); the router's fp32 copy of its input
  (2 d) and its fp32 logits and probabilities (4 E);
- under expert parallelism with FSDP2 / HSDP in bf16, each MoE layer's matmuls also keep the bf16
  copy of this rank's experts for the backward (they stay fp32 outside FSDP2's mixed precision):
  2 bytes x 3 d h E / EP per MoE layer (one layer's with activation checkpointing), not per token.

The JAX counts are fitted to XLA's compiles (``olmo-train-jax --dry-run``), layer by layer as
well: no remat ``6 d + 3 q + 4 kv`` plus ``4 ff`` (dense) or, for an MoE layer, the routed rows'
``k (3 d + 4 h)`` as in torch and ``4 h_shared``; "save_dots" only the matmul outputs
(``q + 2 kv + 2 d + 2 ff``, ff = k h + h_shared for an MoE layer); "block" the block input (d)
plus the largest block recomputed.

Gathered weights (FSDP's bf16 copy of a block): torch under expert parallelism gathers a block's
dense weights only (its experts stay local, outside the wrapper); JAX splits a routed weight over
expert x fsdp and gathers it over fsdp, so a block's experts come in 1 / expert of them.
"""

from __future__ import annotations

from olmo_model.maths import param_counts
from olmo_model.moe import expert_capacity
from olmo_model.spec import ModelSpec

from .recipe import Recipe


def routed_expert_params(spec: ModelSpec) -> int:
    """The routed experts' parameters (every MoE layer's n_experts SwiGLU MLPs); 0 for a dense spec."""
    if spec.moe is None:
        return 0
    per_layer = spec.moe.n_experts * 3 * spec.d_model * spec.moe.expert_hidden
    return per_layer * sum(spec.is_moe_layer(i) for i in range(spec.n_layers))


def rows_per_assignment(spec: ModelSpec, recipe: Recipe, seq: int) -> float | None:
    """rho, the capacity buffer's rows per routed assignment (E C / (S k)); None when dropless."""
    factor = recipe.moe.capacity_factor
    if spec.moe is None or factor is None:
        return None
    m = spec.moe
    return m.n_experts * expert_capacity(factor, seq, m.top_k, m.n_experts) / (seq * m.top_k)


def torch_block_values(spec: ModelSpec, layer: int, rho: float | None = None) -> float:
    """bf16-sized values per token that layer ``layer`` of the torch model keeps for its backward
    (eager, no recompute; module docstring); ``rho``: the capacity buffer's rows per assignment,
    None when dropless."""
    d, q, kv = spec.d_model, spec.q_width, spec.kv_width
    attention = (18 if spec.norm_placement == "peri" else 10) * d + 6 * q + 6 * kv
    if spec.qk_norm == "none":
        attention -= 4 * q + 4 * kv
    moe = spec.moe
    if moe is None or not spec.is_moe_layer(layer):
        return attention + 4 * spec.mlp_hidden
    k, h = moe.top_k, moe.expert_hidden
    routed = k * (3 * d + 4 * h) if rho is None else rho * k * (d + 4 * h) + k * d
    shared = 4 * moe.n_shared_experts * moe.shared_hidden + 2 * d
    return attention + routed + shared + 4 * moe.n_experts


def torch_activation_bytes(recipe: Recipe, spec: ModelSpec, remat: str, tokens: int, seq: int) -> float:
    """Bytes of activations the torch step holds at the start of its backward for ``tokens`` tokens
    per device: every layer's saved tensors (``remat`` none), or with per-block activation
    checkpointing (``block``) each block's bf16 input plus the largest block recomputed; and the
    local experts' bf16 copies under expert parallelism with FSDP2 (module docstring)."""
    rho = rows_per_assignment(spec, recipe, seq)
    values = [torch_block_values(spec, i, rho) for i in range(spec.n_layers)]
    if remat == "block":
        acts = tokens * 2 * (spec.n_layers * spec.d_model + max(values))
    else:
        acts = tokens * 2 * sum(values)
    t = recipe.torch
    if (
        spec.moe is not None
        and t.expert_parallel > 1
        and t.parallel in ("fsdp", "hsdp")
        and recipe.train.precision == "bf16"
    ):
        copies = 1 if remat == "block" else sum(spec.is_moe_layer(i) for i in range(spec.n_layers))
        acts += copies * 2 * 3 * spec.d_model * spec.moe.expert_hidden * spec.moe.n_experts / t.expert_parallel
    return acts


def jax_block_values(spec: ModelSpec, layer: int, remat: str) -> float:
    """bf16-sized values per token that layer ``layer`` of the JAX step keeps for its backward
    under ``remat`` (none or save_dots; module docstring)."""
    d, q, kv = spec.d_model, spec.q_width, spec.kv_width
    moe = spec.moe if spec.moe is not None and spec.is_moe_layer(layer) else None
    shared = moe.n_shared_experts * moe.shared_hidden if moe is not None else 0
    ff = moe.top_k * moe.expert_hidden + shared if moe is not None else spec.mlp_hidden
    if remat == "save_dots":
        return q + 2 * kv + 2 * d + 2 * ff
    mlp = moe.top_k * (3 * d + 4 * moe.expert_hidden) + 4 * shared if moe is not None else 4 * ff
    return 6 * d + 3 * q + 4 * kv + mlp


def jax_activation_bytes(spec: ModelSpec, remat: str, tokens: int) -> float:
    """Bytes of the JAX step's saved activations for ``tokens`` tokens per device (module doc)."""
    if remat == "block":
        largest = max(jax_block_values(spec, i, "none") for i in range(spec.n_layers))
        return tokens * 2 * (spec.n_layers * spec.d_model + largest)
    return tokens * 2 * sum(jax_block_values(spec, i, remat) for i in range(spec.n_layers))


def gathered_block_params(recipe: Recipe, spec: ModelSpec, framework: str) -> float:
    """Parameters of the largest block an FSDP gather brings to a device (module docstring); the
    embedding never gathered with a block, the head spread over the blocks as before."""
    counts, routed = param_counts(spec), routed_expert_params(spec)
    if framework == "torch":
        routed_gathered = 0.0 if recipe.torch.expert_parallel > 1 else routed
    else:
        routed_gathered = routed / recipe.jax.mesh.get("expert", 1)
    return max((counts.total - counts.embedding - routed + routed_gathered) / spec.n_layers, 1.0)

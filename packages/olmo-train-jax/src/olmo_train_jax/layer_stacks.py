"""The decoder layers' stacked weights and the plan of the scans that walk them.

Weights. Every per-layer weight is STACKED along a leading layer axis: the attention weights and
both norms over all ``n_layers`` (``q_proj`` [n_layers, d_model, q_width]), the dense SwiGLU
(``gate_proj``, ``up_proj``, ``down_proj``) over the dense layers only and the MoE weights
(``router``, ``expert_*``, ``shared_*``) over the MoE layers only: row j of the dense (MoE)
stack is the j-th dense (MoE) layer in depth order (``mlp_row``). A model of one MLP kind,
dense or every layer MoE, has one MLP stack of n_layers rows.

Scans (``layer_runs``). The forward scans over repeats of the attention pattern's period P
(``scan_period``: 4 for Olmo 3's 3 sliding : 1 global, 1 when every layer is global), unrolling
the P layers of a repeat so that each layer's attention kind is static. A mixed dense / MoE
stack (OLMo-core 3's dense leading blocks, ``moe.layers``) adds one rule: consecutive repeats
whose P layers have the same MLP kinds, position by position, form a run, and each run is one
``jax.lax.scan`` over its own repeats, its weights the run's rows of each stack viewed as
[repeats, layers of that kind per repeat, ...]. So the layers traced are P per run, not per
layer: an MoE model with k dense leading blocks has two runs (the repeats holding the dense
layers, then the all-MoE rest) whatever its depth, and an MoE layer every other layer is one
run of a period holding both kinds. Why runs rather than one stack with a per-layer switch:
dense and MoE layers have different weights, so one stack would store both kinds for every
layer (or pad them), and a data-dependent branch in the scan body would trace both blocks
anyway; why repeats of the attention period rather than runs of layers: a run then always
holds whole repeats of the pattern, so a model whose dense prefix is not a multiple of P still
scans its MoE layers over P-layer repeats instead of unrolling a run whose pattern does not
divide it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from olmo_model import ModelSpec

# The weights of a dense layer's MLP and of an MoE layer's; every other per-layer weight
# (attention, QK-norm, the two block norms) exists for every layer.
DENSE_MLP_PARAMS = ("gate_proj", "up_proj", "down_proj")
MOE_PARAMS = (
    "router",
    "expert_gate_proj",
    "expert_up_proj",
    "expert_down_proj",
    "shared_gate_proj",
    "shared_up_proj",
    "shared_down_proj",
)


def scan_period(layer_types: tuple[str, ...]) -> int:
    """Smallest P dividing n_layers with layer_types[i] == layer_types[i % P] for every i: the
    scan walks n_layers / P repeats of P unrolled layers (Olmo 3: P = 4; a non-periodic
    pattern: P = n_layers, one repeat, every layer unrolled)."""
    n = len(layer_types)
    return next(
        p for p in range(1, n + 1) if n % p == 0 and all(layer_types[i] == layer_types[i % p] for i in range(n))
    )


def mlp_row(spec: ModelSpec, layer: int) -> int:
    """Row of layer ``layer``'s MLP weights in its kind's stack: how many layers of its kind
    (dense or MoE) come before it."""
    kind = spec.is_moe_layer(layer)
    return sum(spec.is_moe_layer(i) == kind for i in range(layer))


@dataclass(frozen=True)
class LayerRun:
    """Consecutive repeats of the attention pattern with the same MLP kinds: one lax.scan."""

    start: int  # its first layer
    period: int  # layers per repeat, unrolled in the scan body
    repeats: int
    moe: tuple[bool, ...]  # per position in the repeat: an MoE layer (else dense)
    dense_start: int  # row of its first dense layer in the dense stack
    moe_start: int  # row of its first MoE layer in the MoE stack

    def grouped(self, arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The run's rows of every stack as [repeats, layers of that kind per repeat, ...]
        (static slices; a reshape only when the run covers the whole stack)."""
        n_moe = sum(self.moe)
        rows = {True: (self.moe_start, n_moe), False: (self.dense_start, self.period - n_moe)}

        def view(name: str, w: jax.Array) -> jax.Array:
            first, per_repeat = (self.start, self.period) if _kind(name) is None else rows[_kind(name) == "moe"]
            return w[first : first + self.repeats * per_repeat].reshape(self.repeats, per_repeat, *w.shape[1:])

        return {
            name: view(name, w) for name, w in arrays.items() if _kind(name) is None or rows[_kind(name) == "moe"][1]
        }

    def layer_weights(self, repeat_weights: dict[str, jax.Array], p: int) -> dict[str, jax.Array]:
        """Position ``p``'s weights from one repeat's slice of ``grouped``: its attention
        weights and the MLP weights of its kind."""
        slot = self.moe[:p].count(self.moe[p])
        own = "moe" if self.moe[p] else "dense"
        return {
            name: w[p if _kind(name) is None else slot]
            for name, w in repeat_weights.items()
            if _kind(name) in (None, own)
        }


def _kind(name: str) -> str | None:
    """Which stack a per-layer weight lives in: "dense", "moe", or None (one row per layer)."""
    return "dense" if name in DENSE_MLP_PARAMS else "moe" if name in MOE_PARAMS else None


def layer_runs(spec: ModelSpec) -> tuple[LayerRun, ...]:
    """The scans of the forward, in depth order (module docstring)."""
    assert spec.layer_types is not None  # filled by ModelSpec._fill_layer_types
    period = scan_period(spec.layer_types)
    runs: list[LayerRun] = []
    dense = moe = 0
    for start in range(0, spec.n_layers, period):
        kinds = tuple(spec.is_moe_layer(start + p) for p in range(period))
        if runs and runs[-1].moe == kinds:
            last = runs[-1]
            runs[-1] = LayerRun(last.start, period, last.repeats + 1, kinds, last.dense_start, last.moe_start)
        else:
            runs.append(LayerRun(start, period, 1, kinds, dense, moe))
        moe += sum(kinds)
        dense += period - sum(kinds)
    return tuple(runs)

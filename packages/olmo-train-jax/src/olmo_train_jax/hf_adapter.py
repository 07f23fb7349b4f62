"""The one place that maps transformers' Olmo3 parameter names to this package's NNX state.

HF stores one tensor per layer with torch.nn.Linear's (out, in) layout; ``OlmoModel`` stacks
layers on a leading axis and keeps (in, out) kernels. ``to_hf`` unstacks and transposes,
``load_hf`` checks every name, shape and dtype (``olmo_model.validate_hf_tensors``) before it
changes anything, then stacks and transposes back.

MoE layers use the per-expert names of ``hf_param_shapes`` (``mlp.gate.weight`` the router,
``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_experts.{s}...``): routed expert
e is slice e of the stacked expert axis; the shared experts are stored concatenated along
their hidden axis, so shared expert s is hidden columns [s*h, (s+1)*h) (rows for down_proj).
In a stack that mixes dense and MoE layers, layer i's MLP weights are row ``mlp_row(spec, i)``
of its kind's stack (``layer_stacks``); its attention weights and norms are row i.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo_model import HFLayoutError, ModelSpec, hf_param_shapes, validate_hf_tensors
from olmo_model.init import init_values

from .layer_stacks import DENSE_MLP_PARAMS, mlp_row
from .model import OlmoModel

# HF name -> (attribute of OlmoModel, whether the HF tensor is a transposed (out, in) linear).
_TOP: dict[str, tuple[str, bool]] = {
    "model.embed_tokens.weight": ("embed", False),
    "model.embed_norm.weight": ("embed_norm", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
# Per-layer HF suffix -> (attribute of StackedLayers, transposed).
_LAYER: dict[str, tuple[str, bool]] = {
    "self_attn.q_proj.weight": ("q_proj", True),
    "self_attn.k_proj.weight": ("k_proj", True),
    "self_attn.v_proj.weight": ("v_proj", True),
    "self_attn.o_proj.weight": ("o_proj", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "input_layernorm.weight": ("attn_in_norm", False),
    "post_attention_layernorm.weight": ("attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_in_norm", False),
    "mlp.gate_proj.weight": ("gate_proj", True),
    "mlp.up_proj.weight": ("up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
    "post_feedforward_layernorm.weight": ("mlp_norm", False),
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.(experts|shared_experts)\.(\d+)\.(gate|up|down)_proj\.weight")
# This package's name for olmo_model's error: one type, whichever side finds the mismatch.
CheckpointMismatchError = HFLayoutError


def _slot(spec: ModelSpec, name: str) -> tuple[str | None, str, int | None, tuple, bool]:
    """Where HF tensor ``name`` lives: (StackedLayers attribute or None for a top-level one,
    attribute name, row of the stack (the layer index; for an MLP weight its row in its kind's
    stack, ``layer_stacks.mlp_row``), index into that row's array, transposed)."""
    if name in _TOP:
        attr, transposed = _TOP[name]
        return None, attr, None, (), transposed
    match = _LAYER_NAME.fullmatch(name)
    assert match is not None, name  # hf_param_shapes only yields top-level and layer names
    layer, suffix = int(match[1]), match[2]
    if suffix in _LAYER:
        attr, transposed = _LAYER[suffix]
        return "layers", attr, mlp_row(spec, layer) if attr in DENSE_MLP_PARAMS else layer, (), transposed
    row = mlp_row(spec, layer)  # the MoE stack holds the MoE layers only
    if suffix == "mlp.gate.weight":
        return "layers", "router", row, (), True
    expert = _EXPERT_NAME.fullmatch(suffix)
    assert expert is not None and spec.moe is not None, name
    kind, e, proj = expert[1], int(expert[2]), expert[3]
    if kind == "experts":
        return "layers", f"expert_{proj}_proj", row, (e,), True
    h = spec.moe.shared_hidden
    cols = slice(e * h, (e + 1) * h)
    index = (cols, slice(None)) if proj == "down" else (slice(None), cols)
    return "layers", f"shared_{proj}_proj", row, index, True


def to_hf(model: OlmoModel, spec: ModelSpec) -> dict[str, np.ndarray]:
    """All weights under transformers' Olmo3ForCausalLM names (MoE layers: the per-expert names
    of ``hf_param_shapes``), linears as (out, in), in param dtype."""
    host: dict[str, np.ndarray] = {}
    out: dict[str, np.ndarray] = {}
    for name in hf_param_shapes(spec):
        owner, attr, layer, index, transposed = _slot(spec, name)
        if attr not in host:
            holder = model if owner is None else getattr(model, owner)
            host[attr] = np.asarray(jax.device_get(getattr(holder, attr)[...]))
        value = host[attr] if layer is None else host[attr][layer][index]
        out[name] = np.array(value.T if transposed else value, order="C")  # an owned, writable copy
    return out


def validate_hf(spec: ModelSpec, tensors: Mapping[str, np.ndarray], source: str = "checkpoint") -> None:
    """Raise CheckpointMismatchError on the first unexpected, missing, wrong-vocab, wrong-shape or
    non-floating tensor (``olmo_model.validate_hf_tensors``); the message starts with ``source``."""
    shapes = {name: np.shape(t) for name, t in tensors.items()}
    validate_hf_tensors(spec, shapes, source, dtypes={name: t.dtype for name, t in tensors.items()})


def load_hf(model: OlmoModel, tensors: Mapping[str, np.ndarray], *, source: str = "checkpoint") -> None:
    """Overwrite ``model``'s weights in place from HF-named tensors, after validating all of them;
    errors start with ``source`` (the file the tensors came from)."""
    spec = model.spec
    validate_hf(spec, tensors, source)
    dtype = model.param_dtype
    buffers: dict[tuple[str | None, str], np.ndarray] = {}
    for name in hf_param_shapes(spec):
        owner, attr, layer, index, transposed = _slot(spec, name)
        holder = model if owner is None else getattr(model, owner)
        if (owner, attr) not in buffers:
            param = getattr(holder, attr)
            buffers[(owner, attr)] = np.zeros(param.shape, np.dtype(dtype))
        value = np.asarray(tensors[name])
        value = value.T if transposed else value
        if layer is None:
            buffers[(owner, attr)][...] = value
        else:
            buffers[(owner, attr)][layer][index] = value
    for (owner, attr), value in buffers.items():
        holder = model if owner is None else getattr(model, owner)
        getattr(holder, attr).set_value(jnp.asarray(value, dtype))


def model_from_hf(
    spec: ModelSpec,
    tensors: Mapping[str, np.ndarray],
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    remat: str = "none",
    *,
    source: str = "checkpoint",
) -> OlmoModel:
    """A model holding the given HF weights; the random initialisation is only traced for shapes
    (nnx.eval_shape), never computed, so a large model costs one copy of its weights."""
    model = nnx.eval_shape(lambda: OlmoModel(spec, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype, remat=remat))
    load_hf(model, tensors, source=source)
    return model


def initial_params(spec: ModelSpec, seed: int, abstract_params: dict) -> dict:
    """Fresh parameters (``olmo_model.init`` for ``seed``: the torch trainer's, for any layout)
    as a pure dict placed as ``abstract_params`` (ShapeDtypeStructs with shardings) says. Each
    addressable device's block is computed from the HF-named elements it holds, so no process
    draws or holds a full copy of a sharded parameter."""
    sources: dict[tuple[str | None, str], list[tuple[str, int | None, tuple, bool]]] = {}
    for name in hf_param_shapes(spec):
        owner, attr, layer, index, transposed = _slot(spec, name)
        sources.setdefault((owner, attr), []).append((name, layer, index, transposed))

    def block(owner: str | None, attr: str, leaf: jax.ShapeDtypeStruct, request: tuple | None) -> np.ndarray:
        # None: the whole array (jax's Index type allows it).
        want = [s.indices(n)[:2] for s, n in zip(request or (slice(None),) * leaf.ndim, leaf.shape)]
        out = np.empty([hi - lo for lo, hi in want], leaf.dtype)
        for name, layer, index, transposed in sources[(owner, attr)]:
            # Where HF tensor `name` lies in the array (per axis), and which axes are its own.
            spans: list[tuple[int, int]] = [] if layer is None else [(layer, layer + 1)]
            own: list[int] = []
            for item in (*index, *[slice(None)] * (leaf.ndim - len(spans) - len(index))):
                if isinstance(item, int):
                    spans.append((item, item + 1))
                else:
                    own.append(len(spans))
                    spans.append(item.indices(leaf.shape[len(spans)])[:2])
            common = [(max(a, c), min(b, e)) for (a, b), (c, e) in zip(spans, want)]
            if any(lo >= hi for lo, hi in common):
                continue
            region = [slice(common[k][0] - spans[k][0], common[k][1] - spans[k][0]) for k in own]
            values = init_values(spec, seed, name, tuple(region[::-1] if transposed else region))
            place = tuple(slice(lo - w, hi - w) for (lo, hi), (w, _) in zip(common, want))
            out[place] = (values.T if transposed else values).reshape(out[place].shape)
        return out

    def place(owner: str | None, attr: str, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda idx: block(owner, attr, leaf, idx))

    return {
        key: (
            {attr: place(key, attr, leaf) for attr, leaf in value.items()}
            if isinstance(value, dict)
            else place(None, key, value)
        )
        for key, value in abstract_params.items()
    }

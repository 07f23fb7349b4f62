"""The one place that maps transformers' Olmo3 parameter names to this package's NNX state.

HF stores one tensor per layer with torch.nn.Linear's (out, in) layout; ``OlmoModel`` stacks
layers on a leading axis and keeps (in, out) kernels. ``to_hf`` unstacks and transposes,
``load_hf`` checks every name and shape against ``olmo_model.hf_param_shapes(spec)`` before
it changes anything, then stacks and transposes back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from olmo_model import ModelSpec, hf_param_shapes

from .model import OlmoModel

# HF name -> (attribute of OlmoModel, whether the HF tensor is a transposed (out, in) linear).
_TOP: dict[str, tuple[str, bool]] = {
    "model.embed_tokens.weight": ("embed", False),
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
    "post_attention_layernorm.weight": ("post_attention_norm", False),
    "mlp.gate_proj.weight": ("gate_proj", True),
    "mlp.up_proj.weight": ("up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
    "post_feedforward_layernorm.weight": ("post_feedforward_norm", False),
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


class CheckpointMismatchError(ValueError):
    """HF tensors that do not fit the spec; the message names the tensor and the fix."""


def _check_dense(spec: ModelSpec) -> None:
    if spec.moe is not None:
        raise NotImplementedError("hf_adapter: MoE checkpoints (OLMoE layout) are issue 8; use a dense spec")


def to_hf(model: OlmoModel, spec: ModelSpec) -> dict[str, np.ndarray]:
    """All weights under transformers' Olmo3ForCausalLM names, linears as (out, in), in param dtype."""
    _check_dense(spec)
    out: dict[str, np.ndarray] = {}
    for name in hf_param_shapes(spec):
        if name in _TOP:
            attr, transposed = _TOP[name]
            value = np.asarray(jax.device_get(getattr(model, attr)[...]))
        else:
            match = _LAYER_NAME.fullmatch(name)
            assert match is not None, name  # hf_param_shapes only yields top-level and layer names
            attr, transposed = _LAYER[match[2]]
            value = np.asarray(jax.device_get(getattr(model.layers, attr)[int(match[1])]))
        out[name] = np.array(value.T if transposed else value, order="C")  # an owned, writable copy
    return out


def validate_hf(spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None:
    """Raise CheckpointMismatchError on the first unexpected, missing, wrong-vocab or wrong-shape tensor."""
    _check_dense(spec)
    expected = hf_param_shapes(spec)
    unexpected = [name for name in tensors if name not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointMismatchError(
            f"unexpected tensor '{unexpected[0]}'{more}: the spec (n_layers={spec.n_layers}, "
            f"qk_norm={spec.qk_norm}) has no such parameter; build the spec from the checkpoint's "
            "config.json (olmo_model.spec_from_hf_config) or drop the tensor"
        )
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointMismatchError(
            f"missing tensor '{missing[0]}'{more}, expected shape {expected[missing[0]]}; "
            "the checkpoint is incomplete or was written for a different spec (check n_layers, qk_norm)"
        )
    for name in _VOCAB_TENSORS:
        rows = np.shape(tensors[name])[0] if np.ndim(tensors[name]) else None
        if rows != spec.padded_vocab_size:
            raise CheckpointMismatchError(
                f"vocab mismatch in '{name}': checkpoint has {rows} rows, spec padded_vocab_size="
                f"{spec.padded_vocab_size}; set padded_vocab_size (and vocab_size) to the checkpoint's, "
                "e.g. via olmo_model.spec_from_hf_config"
            )
    for name, shape in expected.items():
        got = tuple(np.shape(tensors[name]))
        if got != shape:
            raise CheckpointMismatchError(
                f"wrong shape for '{name}': expected {shape}, got {got}; the checkpoint's sizes differ "
                "from the spec (check d_model, n_heads, n_kv_heads, mlp_hidden)"
            )
        dtype = np.asarray(tensors[name]).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise CheckpointMismatchError(
                f"tensor '{name}' has dtype {dtype}, expected a floating-point type; re-export the weights"
            )


def load_hf(model: OlmoModel, tensors: Mapping[str, np.ndarray]) -> None:
    """Overwrite ``model``'s weights in place from HF-named tensors, after validating all of them."""
    spec = model.spec
    validate_hf(spec, tensors)
    dtype = model.param_dtype

    def as_param(value, transposed: bool) -> np.ndarray:
        value = np.asarray(value)
        return value.T if transposed else value

    for name, (attr, transposed) in _TOP.items():
        getattr(model, attr).set_value(jnp.asarray(as_param(tensors[name], transposed), dtype))
    for suffix, (attr, transposed) in _LAYER.items():
        if not hasattr(model.layers, attr):  # q_norm / k_norm are absent with qk_norm="none"
            continue
        stacked = np.stack(
            [as_param(tensors[f"model.layers.{i}.{suffix}"], transposed) for i in range(spec.n_layers)]
        )
        getattr(model.layers, attr).set_value(jnp.asarray(stacked, dtype))


def model_from_hf(
    spec: ModelSpec,
    tensors: Mapping[str, np.ndarray],
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    remat: str = "none",
) -> OlmoModel:
    """A model holding the given HF weights; the random initialisation is only traced for shapes
    (nnx.eval_shape), never computed, so a large model costs one copy of its weights."""
    model = nnx.eval_shape(
        lambda: OlmoModel(spec, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype, remat=remat)
    )
    load_hf(model, tensors)
    return model

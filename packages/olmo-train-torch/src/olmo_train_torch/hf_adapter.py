"""The one place mapping transformers' Olmo3 parameter names to ``OlmoModel``'s state dict.

HF names and shapes come from ``olmo_model.hf_param_shapes(spec)``. MoE layers keep
their routed experts stacked (``blocks.N.mlp.experts.gate_proj`` [E, hidden, d], the
grouped-GEMM layout), so HF's per-expert ``mlp.experts.{e}.gate_proj.weight`` is slice
``e`` of it; the router is ``blocks.N.mlp.router`` (HF's ``mlp.gate``) and the shared experts
keep their HF names. Every tensor is
checked (``olmo_model.validate_hf_tensors``: present, expected, right shape, right vocab)
before anything is copied, so a bad checkpoint leaves the model untouched and raises one
``CheckpointMismatchError`` line naming the tensor, what was expected, what was found and
the fix.

Sharded start-up (``fill_local_shards``): each parameter of a parallelized model holds only this
rank's block of the full tensor (a DTensor shard, or the whole tensor); the block is filled from a
``BlockReader`` that returns HF-named blocks: ``olmo_model.init`` values for a fresh start,
``SafetensorsBlocks`` (only the bytes of the block are read) for an HF ``init.checkpoint``.
``initial_model`` is the unsharded model holding the fresh start's values.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from olmo_model import HFLayoutError, ModelSpec, hf_param_shapes, validate_hf_tensors
from olmo_model.init import Region, init_values

from .model import OlmoModel

# HF name piece -> our module path piece, inside "model.layers.N." / "blocks.N.".
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "input_layernorm.weight": "attn_in_norm.weight",
    "post_attention_layernorm.weight": "attn_norm.weight",
    "pre_feedforward_layernorm.weight": "mlp_in_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "post_feedforward_layernorm.weight": "mlp_norm.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.embed_norm.weight": "embed_norm.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# This package's name for olmo_model's error: one type, whichever side finds the mismatch.
CheckpointMismatchError = HFLayoutError


def _local_name(hf_name: str) -> tuple[str, int | None]:
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name], None
    _, _, layer, rest = hf_name.split(".", 3)  # "model.layers.N.rest"
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        return f"blocks.{layer}.mlp.experts.{expert.group(2)}", int(expert.group(1))
    # Shared experts keep their HF names inside the block.
    return f"blocks.{layer}.{_LAYER_NAMES.get(rest, rest)}", None


def hf_to_local_names(spec: ModelSpec) -> dict[str, tuple[str, int | None]]:
    """HF name -> (OlmoModel state-dict name, expert index into its stacked tensor or None),
    for every parameter of ``spec``, in HF order."""
    return {name: _local_name(name) for name in hf_param_shapes(spec)}


def to_hf(model_or_state_dict: OlmoModel | Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The model's parameters under HF names (detached, same dtype/device, not copied)."""
    state = model_or_state_dict
    if isinstance(state, OlmoModel):
        state = state.state_dict()
    out = {}
    for hf_name, (local, expert) in hf_to_local_names(spec).items():
        if local not in state:
            raise CheckpointMismatchError(
                f"to_hf: state dict has no '{local}' (HF '{hf_name}'); "
                "pass the state dict of an OlmoModel built from this spec"
            )
        if expert is not None and expert >= state[local].shape[0]:
            raise CheckpointMismatchError(
                f"to_hf: '{local}' holds {state[local].shape[0]} experts, HF '{hf_name}' needs expert {expert}; "
                "export an unsharded model (expert-parallel ranks hold only their own experts)"
            )
        tensor = state[local].detach()
        out[hf_name] = tensor if expert is None else tensor[expert]
    return out


@torch.no_grad()
def load_hf(
    model: OlmoModel,
    tensors: Mapping[str, np.ndarray | torch.Tensor],
    *,
    strict: bool = True,
    source: str = "checkpoint",
) -> None:
    """Copy HF-named tensors into ``model`` (cast to each parameter's dtype and device).

    All names, shapes and dtypes are validated first; errors start with ``source`` (the file
    the tensors came from). ``strict=False`` skips missing tensors and ignores unexpected
    ones; a wrong shape or a non-floating dtype is always an error."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    dtypes = {name: t.dtype for name, t in tensors.items()}
    validate_hf_tensors(model.spec, shapes, source, strict=strict, dtypes=dtypes)
    params = model.state_dict()
    for hf_name, (local, expert) in hf_to_local_names(model.spec).items():
        if hf_name in tensors:
            value = tensors[hf_name]
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(np.ascontiguousarray(value))
            target = params[local] if expert is None else params[local][expert]
            target.copy_(value)


def model_from_hf(
    spec: ModelSpec,
    tensors: Mapping[str, np.ndarray | torch.Tensor],
    dtype: torch.dtype = torch.float32,
    *,
    source: str = "checkpoint",
) -> OlmoModel:
    """A CPU model holding exactly the given HF weights (no random init is spent on it)."""
    with torch.device("meta"):
        model = OlmoModel(spec)
    model.to_empty(device="cpu").to(dtype)
    load_hf(model, tensors, strict=True, source=source)
    return model


def initial_model(
    spec: ModelSpec, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> OlmoModel:
    """An initialised, unsharded model: structure on the meta device, storage on ``device``,
    then the values of ``olmo_model.init`` for ``seed`` (the weights every layout of the trainer,
    and the JAX trainer through ``olmo_train_jax.hf_adapter.initial_params``, starts from), cast
    to ``dtype``."""
    with torch.device("meta"):
        model = OlmoModel(spec)
    model.to_empty(device=device)
    fill_local_shards(model, init_reader(spec, seed))
    return model.to(dtype)


# ---- sharded start-up ------------------------------------------------------------------------

# HF name and block (one slice per axis of the HF tensor) -> the block's values.
BlockReader = Callable[[str, Region], np.ndarray | torch.Tensor]


def init_reader(spec: ModelSpec, seed: int) -> BlockReader:
    """Blocks of the framework-neutral initial weights (``olmo_model.init``) for ``seed``."""
    return lambda name, region: init_values(spec, seed, name, region)


def local_block(param: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """This rank's part of ``param`` (a view: writing it writes the parameter) and where it lies
    in the full tensor."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return param, tuple(slice(0, n) for n in param.shape)


def _local_to_hf(spec: ModelSpec) -> dict[str, list[str]]:
    """OlmoModel parameter name -> its HF names (stacked experts: one per expert, in order)."""
    out: dict[str, list[str]] = {}
    for hf_name, (local, expert) in hf_to_local_names(spec).items():
        out.setdefault(local, []).append(hf_name)
        assert expert is None or expert == len(out[local]) - 1, hf_name  # hf_param_shapes lists experts in order
    return out


@torch.no_grad()
def fill_local_shards(model: nn.Module, read: BlockReader) -> None:
    """Write every parameter's local block of an ``OlmoModel`` (parallelized or not, storage
    allocated, e.g. by ``to_empty``) from ``read``; no rank reads or computes another's block."""
    spec = model.spec
    assert isinstance(spec, ModelSpec)  # an OlmoModel, possibly class-swapped by fully_shard
    hf_names = _local_to_hf(spec)
    for name, param in model.named_parameters():
        local, region = local_block(param)
        sources = hf_names[name.replace(_CHECKPOINT_PREFIX, "")]
        if len(sources) == 1 and param.ndim == len(hf_param_shapes(spec)[sources[0]]):
            value = torch.as_tensor(read(sources[0], region))
        else:  # stacked experts [E, ...]: expert e is HF tensor e; this rank holds experts region[0]
            first, stop, _ = region[0].indices(param.shape[0])
            value = torch.stack([torch.as_tensor(read(sources[e], region[1:])) for e in range(first, stop)])
        local.copy_(value.reshape(local.shape))


_SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


class SafetensorsBlocks:
    """The HF tensors of a model's ``*.safetensors`` files as a ``BlockReader``: a block read
    reads only its bytes (safetensors slices), so a rank never loads the full model. A context
    manager: the files are open inside it."""

    def __init__(self, files: list[Path]):
        self._files = files
        self._open = contextlib.ExitStack()
        self._slices: dict[str, Any] = {}

    def __enter__(self) -> SafetensorsBlocks:
        from safetensors import safe_open

        for path in self._files:
            f = self._open.enter_context(safe_open(str(path), framework="pt"))
            self._slices.update({name: f.get_slice(name) for name in f.keys()})
        return self

    def __exit__(self, *exc: object) -> None:
        self._slices = {}
        self._open.close()

    def validate(self, spec: ModelSpec, source: str) -> None:
        """``validate_hf_tensors`` on the files' headers, before any block is read."""
        shapes = {name: tuple(s.get_shape()) for name, s in self._slices.items()}
        dtypes = {name: _SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype()) for name, s in self._slices.items()}
        validate_hf_tensors(spec, shapes, source, dtypes=dtypes)

    def __call__(self, name: str, region: Region) -> torch.Tensor:
        return self._slices[name][region]

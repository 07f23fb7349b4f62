"""Our two trainers' model checkpoints as ``olmo_tools.formats.Checkpoint`` readers and writers.

- ``torch:DIR``: ``spec.json`` (the ModelSpec as JSON; a trainer checkpoint folder has it in
  ``meta.json`` instead) and the ``OlmoModel`` state dict
  (olmo_train_torch's own parameter names), either as a torch.distributed.checkpoint in
  DIR (keys as they are, or under ``model.`` as a trainer checkpoint with its optimizer
  stores them) or as ``DIR/model.pt``. Read one tensor at a time; the name mapping is
  olmo_train_torch's own (``hf_adapter.hf_to_local_names``).
- ``jax:DIR``: ``spec.json`` and an Orbax checkpoint in ``DIR/state`` holding the NNX
  model's parameters as a pure dict (``nnx.to_pure_dict``; layers stacked, kernels
  (in, out)). Read and written through olmo_train_jax's ``model_from_hf``/``to_hf``, so a
  jax: side holds the whole model in memory once.

Both write ``spec.json`` next to the weights, so they carry their config.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from olmo_model import ModelSpec, hf_param_shapes
from olmo_model.presets import SpecError, spec_from_dict

from .formats import (
    DCP_METADATA,
    Checkpoint,
    CheckpointError,
    DCPDir,
    checked_tensor,
    load_torch_file,
    resolve_spec,
    save_dcp,
    verified_trainer_meta,
)

SPEC_FILE = "spec.json"
META_FILE = "meta.json"  # written last into each trainer checkpoint (olmo_model.runlog)
TORCH_FILE = "model.pt"
JAX_STATE = "state"
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_spec_file(path: Path) -> ModelSpec:
    """The ModelSpec of a torch:/jax: folder: its spec.json or, for one checkpoint folder of a
    training run (``runs/NAME/checkpoints/step-N``), the spec recorded in its meta.json, once
    the folder's files match the checksums recorded there too."""
    file = path / SPEC_FILE
    try:
        if not file.is_file() and (path / META_FILE).is_file():
            return spec_from_dict(verified_trainer_meta(path)["spec"], source=str(path / META_FILE))
        if not file.is_file():
            raise CheckpointError(
                f"{path / SPEC_FILE}: not found; torch:/jax: directories carry their ModelSpec as spec.json "
                f"(a trainer checkpoint folder carries it in {META_FILE})"
            )
        return spec_from_dict(json.loads(file.read_text()), source=str(file))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: not valid JSON ({err}); rewrite it from ModelSpec.model_dump_json()") from None
    except SpecError as err:
        raise CheckpointError(str(err)) from None


def write_spec_file(path: Path, spec: ModelSpec) -> None:
    (path / SPEC_FILE).write_text(spec.model_dump_json(indent=2) + "\n")


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor; bfloat16 becomes ml_dtypes' bfloat16 (what JAX uses)."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


# ---- torch: --------------------------------------------------------------------------------
def _local_names(spec: ModelSpec) -> dict[str, str]:
    """Interchange name -> OlmoModel state-dict name, from olmo_train_torch's own adapter."""
    from olmo_train_torch.hf_adapter import hf_to_local_names

    if spec.moe is not None:
        raise CheckpointError(f"spec '{spec.name}' is MoE; olmo-convert handles the dense Olmo3 layout only")
    # The adapter pairs each name with an expert index, which dense parameters do not have.
    return {hf: local for hf, (local, _) in hf_to_local_names(spec).items()}


class TorchCheckpoint(Checkpoint):
    def __init__(self, path: Path, spec: str | ModelSpec | None = None):
        self.origin = f"torch:{path}"
        self.spec = resolve_spec(read_spec_file(path), spec, self.origin, SPEC_FILE)
        hf_of = {local: hf for hf, local in _local_names(self.spec).items()}
        self._dcp: DCPDir | None = None
        self._state = None
        if (path / DCP_METADATA).is_file():
            self._dcp = DCPDir(path)
            stored = self._dcp.tensors
        elif (path / TORCH_FILE).is_file():
            self._state = load_torch_file(path / TORCH_FILE)
            stored = {k: (tuple(v.shape), v.dtype) for k, v in self._state.items() if isinstance(v, torch.Tensor)}
        else:
            raise CheckpointError(f"{path}: neither a DCP checkpoint ({DCP_METADATA}) nor {TORCH_FILE}")
        # A trainer checkpoint keeps the model under "model." next to its optimizer state.
        prefixed = any(k.startswith("model.") and k.removeprefix("model.") in hf_of for k in stored)
        self._key: dict[str, str] = {}
        self.stored = {}
        for key, meta in stored.items():
            if prefixed and not key.startswith("model."):
                continue
            local = key.removeprefix("model.") if prefixed else key
            name = hf_of.get(local, local)  # unknown names surface as unexpected tensors
            self._key[name] = key
            self.stored[name] = meta

    def tensor(self, name: str) -> torch.Tensor:
        key = self._key[name]
        if self._dcp is not None:
            return checked_tensor(self, name, self._dcp.load(key))
        assert self._state is not None  # __init__ sets _dcp or _state
        return checked_tensor(self, name, self._state[key])


def write_torch(dst: Path, ckpt: Checkpoint, dtype_of) -> None:
    """DCP checkpoint of the OlmoModel state dict + spec.json (DCP writes one dict: whole model in memory)."""
    local_of = _local_names(ckpt.spec)
    state = {local_of[name]: ckpt.tensor(name).to(dtype_of(name)).contiguous() for name in hf_param_shapes(ckpt.spec)}
    save_dcp(dst, state)
    write_spec_file(dst, ckpt.spec)


# ---- jax: ------------------------------------------------------------------------------------
class JaxCheckpoint(Checkpoint):
    def __init__(self, path: Path, spec: str | ModelSpec | None = None):
        import orbax.checkpoint as ocp
        from flax import nnx

        from olmo_train_jax import OlmoModel, to_hf

        self.origin = f"jax:{path}"
        self.spec = resolve_spec(read_spec_file(path), spec, self.origin, SPEC_FILE)
        state_dir = (path / JAX_STATE).absolute()
        if not state_dir.is_dir():
            raise CheckpointError(
                f"{state_dir}: not found; a jax: directory holds spec.json and an Orbax checkpoint in state/"
            )
        pure = ocp.StandardCheckpointer().restore(state_dir)
        param_dtype = np.asarray(pure["embed"]).dtype if "embed" in pure else np.float32
        model = nnx.eval_shape(lambda: OlmoModel(self.spec, rngs=nnx.Rngs(0), param_dtype=param_dtype))
        state = nnx.state(model, nnx.Param)
        _check_jax_tree(state_dir, self.spec, nnx.to_pure_dict(state), pure)
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(model, state)
        self._tensors = to_hf(model, self.spec)
        self.stored = {k: (v.shape, _TORCH_DTYPES[v.dtype.name]) for k, v in self._tensors.items()}

    def tensor(self, name: str) -> torch.Tensor:
        return checked_tensor(self, name, numpy_to_torch(self._tensors[name]))


def _flatten(tree, prefix: str = "") -> dict[str, tuple[int, ...]]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tuple(np.shape(tree))}


def _check_jax_tree(origin: Path, spec: ModelSpec, expected_tree, stored_tree) -> None:
    """The stored NNX parameters are exactly the ones the spec's model has, with its shapes."""
    expected, stored = _flatten(expected_tree), _flatten(stored_tree)
    for name, shape in expected.items():
        if name not in stored:
            raise CheckpointError(f"{origin}: missing parameter '{name}' (shape {shape}) for spec '{spec.name}'")
        if stored[name] != shape:
            raise CheckpointError(
                f"{origin}: parameter '{name}' has shape {stored[name]}, spec '{spec.name}' expects {shape}; "
                "spec.json does not describe these weights"
            )
    unexpected = [name for name in stored if name not in expected]
    if unexpected:
        raise CheckpointError(f"{origin}: unexpected parameter '{unexpected[0]}' not in spec '{spec.name}'")


def write_jax(dst: Path, ckpt: Checkpoint, param_dtype) -> None:
    """Orbax checkpoint of the NNX model's parameters (pure dict) + spec.json."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from olmo_train_jax import model_from_hf

    tensors = {name: torch_to_numpy(t) for name, t in ckpt.tensors()}
    model = model_from_hf(ckpt.spec, tensors, param_dtype=param_dtype)
    del tensors
    dst.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((dst / JAX_STATE).absolute(), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    checkpointer.wait_until_finished()
    write_spec_file(dst, ckpt.spec)

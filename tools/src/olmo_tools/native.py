"""Our two trainers' model checkpoints as ``olmo_tools.checkpoint.Checkpoint`` readers and writers.

- ``torch:DIR``: ``spec.json`` (the ModelSpec as JSON; a trainer checkpoint folder has it in
  ``meta.json`` instead) and the ``OlmoModel`` state dict
  (olmo_train_torch's own parameter names), either as a torch.distributed.checkpoint in
  DIR (keys as they are, or under ``model.`` as a trainer checkpoint with its optimizer
  stores them) or as ``DIR/model.pt``. Read one tensor at a time (an MoE layer's routed experts,
  stacked [E, ...] as the trainer holds them, once for all E); the name mapping is
  olmo_train_torch's own (``hf_adapter.hf_to_local_names``).
- ``jax:DIR``: ``spec.json`` and an Orbax checkpoint in ``DIR/state`` holding the NNX
  model's parameters as a pure dict (``nnx.to_pure_dict``; layers stacked, kernels
  (in, out)). Read and written through olmo_train_jax's ``model_from_hf``/``to_hf``, so a
  jax: side holds the whole model in memory once.

Both write ``spec.json`` next to the weights, so they carry their config. Both also read a
trainer's own checkpoints (``native.trainer_checkpoint``): a checkpoint folder
(``RUN/checkpoints/step_N``), ``RUN/checkpoints/latest`` or a run dir ``RUN`` (its latest complete
checkpoint), verified against the sizes and sha256 its meta.json records, the spec from there;
their ``mixture`` names the mixture the weights were trained on (for an hf: export's tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from olmo_model import ModelSpec
from olmo_model.presets import SpecError, spec_from_dict
from olmo_run.errors import CheckpointDamagedError, TrainingStateError
from olmo_run.init_source import LATEST, resolve_checkpoint

from .checkpoint import Checkpoint, CheckpointError, checked_tensor, require_jax, resolve_spec, verified_trainer_meta
from .dcp import DCP_METADATA, DCPDir, load_torch_file, save_dcp

SPEC_FILE = "spec.json"
META_FILE = "meta.json"  # written last into each trainer checkpoint (olmo_run.checkpoints)
RUN_CHECKPOINTS = "checkpoints"  # a run dir's checkpoint folders
TORCH_FILE = "model.pt"
JAX_STATE = "state"
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_spec_file(path: Path) -> ModelSpec:
    """The ModelSpec of a torch:/jax: folder that olmo-convert wrote: its spec.json."""
    file = path / SPEC_FILE
    try:
        return spec_from_dict(json.loads(file.read_text()), source=str(file))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: not valid JSON ({err}); rewrite it from ModelSpec.model_dump_json()") from None
    except SpecError as err:
        raise CheckpointError(str(err)) from None


def trainer_checkpoint(path: Path, kind: str) -> tuple[Path, dict] | None:
    """(checkpoint folder, its verified meta.json) when ``kind:path`` names a trainer checkpoint,
    ``RUN/checkpoints/latest`` or a run dir (its latest complete checkpoint); None for a folder
    olmo-convert wrote (spec.json beside the weights; a run dir has a spec.json too, and
    checkpoints/). A checkpoint of the other trainer is refused with the kind to name it by."""
    if (path / SPEC_FILE).is_file() and not (path / RUN_CHECKPOINTS).is_dir():
        return None
    if path.name != LATEST and not path.exists():
        raise CheckpointError(
            f"{path}: not found; {kind}:PATH is a folder olmo-convert wrote ({SPEC_FILE} beside the weights), "
            f"a {kind} trainer checkpoint (RUN/{RUN_CHECKPOINTS}/step_N), RUN/{RUN_CHECKPOINTS}/{LATEST} or a run dir"
        )
    looks_like_one = (path / META_FILE).is_file() or (path / RUN_CHECKPOINTS).is_dir() or path.name == LATEST
    if not looks_like_one and not path.name.startswith("step_"):
        # The folder inside a checkpoint (its state/ or a file of it) is the likely slip.
        inside = next((p for p in path.absolute().parents if (p / META_FILE).is_file()), None)
        fix = f"name the checkpoint folder itself: {kind}:{inside}" if inside else f"name one of those as {kind}:PATH"
        raise CheckpointError(
            f"{path}: has no {SPEC_FILE} (a {kind}: folder olmo-convert wrote), {META_FILE} (a trainer checkpoint) "
            f"or {RUN_CHECKPOINTS}/ (a run dir); {fix}"
        )
    try:
        _, found = resolve_checkpoint(path)
    except CheckpointDamagedError as err:
        raise CheckpointError(
            f"{err}; convert an intact checkpoint (an older step of that run) or restore it from a copy"
        ) from None
    except TrainingStateError as err:
        raise CheckpointError(str(err)) from None
    assert isinstance(found, Path)  # a local name resolves locally (olmo_tools.remote downloads URLs first)
    ckpt = found
    meta = verified_trainer_meta(ckpt)
    if meta["framework"] != kind:
        raise CheckpointError(
            f"{ckpt}: its {META_FILE} says this is a {meta['framework']} trainer checkpoint, not a {kind} one; "
            f"name it {meta['framework']}:{path}"
        )
    return ckpt, meta


def _trainer_spec(ckpt: Path, meta: dict) -> ModelSpec:
    try:
        return spec_from_dict(meta["spec"], source=str(ckpt / META_FILE))
    except SpecError as err:
        raise CheckpointError(str(err)) from None


def _trainer_mixture(meta: dict) -> str | None:
    """The mixture a trainer checkpoint's recipe trained on (a YAML path or "sample")."""
    data = meta["recipe"].get("data") if isinstance(meta["recipe"], dict) else None
    mixture = data.get("mixture") if isinstance(data, dict) else None
    return mixture if isinstance(mixture, str) else None


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
def _interchange_names(spec: ModelSpec) -> dict[str, tuple[list[str], bool]]:
    """OlmoModel state-dict name -> (the interchange names it holds, whether it stacks them), from
    olmo_train_torch's own adapter: a routed-expert tensor [E, ...] holds one per expert, in expert
    order; any other holds itself."""
    from olmo_train_torch.hf_adapter import hf_to_local_names

    held: dict[str, dict[int, str]] = {}
    stacked: set[str] = set()
    for hf, (local, expert) in hf_to_local_names(spec).items():
        held.setdefault(local, {})[0 if expert is None else expert] = hf
        if expert is not None:
            stacked.add(local)
    return {local: ([names[e] for e in sorted(names)], local in stacked) for local, names in held.items()}


class TorchCheckpoint(Checkpoint):
    def __init__(self, path: Path, spec: str | ModelSpec | None = None):
        found = trainer_checkpoint(path, "torch")
        if found is None:
            self.origin = f"torch:{path}"
            self.spec = resolve_spec(read_spec_file(path), spec, self.origin, SPEC_FILE)
        else:
            path, meta = found
            self.origin = f"torch:{path}"
            self.spec = resolve_spec(_trainer_spec(path, meta), spec, self.origin, META_FILE)
            self.mixture = _trainer_mixture(meta)
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
        self._index_stored(stored)

    def _index_stored(self, stored: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """``stored`` and the key (and expert slice) each interchange name is read from."""
        names_of = _interchange_names(self.spec)
        # A trainer checkpoint keeps the model under "model." next to its optimizer state.
        prefixed = any(k.startswith("model.") and k.removeprefix("model.") in names_of for k in stored)
        self._key: dict[str, tuple[str, int | None]] = {}
        self._stacked: tuple[str, torch.Tensor] | None = None  # the last stacked expert tensor read
        self.stored = {}
        for key, (shape, dtype) in stored.items():
            if prefixed and not key.startswith("model."):
                continue
            local = key.removeprefix("model.") if prefixed else key
            names, is_stacked = names_of.get(local, ([local], False))  # unknown: an unexpected tensor
            if not is_stacked:
                self._key[names[0]] = (key, None)
                self.stored[names[0]] = (shape, dtype)
                continue
            if shape[:1] != (len(names),):
                raise CheckpointError(
                    f"{self.origin}: '{key}' stacks {shape[0] if shape else 0} experts, spec '{self.spec.name}' "
                    f"has {len(names)}; spec.json does not describe these weights"
                )
            for e, name in enumerate(names):
                self._key[name] = (key, e)
                self.stored[name] = (shape[1:], dtype)

    def _read(self, key: str) -> torch.Tensor:
        if self._dcp is not None:
            return self._dcp.load(key)
        assert self._state is not None  # __init__ sets _dcp or _state
        return self._state[key]

    def tensor(self, name: str) -> torch.Tensor:
        key, expert = self._key[name]
        if expert is None:
            return checked_tensor(self, name, self._read(key))
        # Experts are asked for one after another: read their stacked tensor once.
        if self._stacked is None or self._stacked[0] != key:
            self._stacked = (key, self._read(key))
        return checked_tensor(self, name, self._stacked[1][expert])


def write_torch(dst: Path, ckpt: Checkpoint, dtype_of) -> None:
    """DCP checkpoint of the OlmoModel state dict + spec.json (DCP writes one dict: whole model in
    memory); routed experts stacked [E, ...] in the dtype of expert 0, as the trainer holds them."""
    state = {}
    for local, (names, is_stacked) in _interchange_names(ckpt.spec).items():
        if not is_stacked:
            state[local] = ckpt.tensor(names[0]).to(dtype_of(names[0])).contiguous()
        else:
            state[local] = torch.stack([ckpt.tensor(name).to(dtype_of(names[0])) for name in names])
    save_dcp(dst, state)
    write_spec_file(dst, ckpt.spec)


# ---- jax: ------------------------------------------------------------------------------------
class JaxCheckpoint(Checkpoint):
    def __init__(self, path: Path, spec: str | ModelSpec | None = None):
        require_jax(f"jax:{path}")
        found = trainer_checkpoint(path, "jax")
        if found is None:
            self.origin = f"jax:{path}"
            self.spec = resolve_spec(read_spec_file(path), spec, self.origin, SPEC_FILE)
            self._tensors = _read_jax_dir(path, self.spec)
        else:
            path, meta = found
            self.origin = f"jax:{path}"
            self.spec = resolve_spec(_trainer_spec(path, meta), spec, self.origin, META_FILE)
            self.mixture = _trainer_mixture(meta)
            self._tensors = _read_jax_trainer_weights(path, self.spec)
        self.stored = {k: (v.shape, _TORCH_DTYPES[v.dtype.name]) for k, v in self._tensors.items()}

    def tensor(self, name: str) -> torch.Tensor:
        return checked_tensor(self, name, numpy_to_torch(self._tensors[name]))


def _read_jax_dir(path: Path, spec: ModelSpec) -> dict[str, np.ndarray]:
    """The interchange tensors of a jax: folder olmo-convert wrote (spec.json + state/)."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from olmo_train_jax import OlmoModel, to_hf

    state_dir = (path / JAX_STATE).absolute()
    if not state_dir.is_dir():
        raise CheckpointError(
            f"{state_dir}: not found; a jax: directory holds spec.json and an Orbax checkpoint in state/"
        )
    pure = ocp.StandardCheckpointer().restore(state_dir)
    param_dtype = np.asarray(pure["embed"]).dtype if "embed" in pure else np.float32
    model = nnx.eval_shape(lambda: OlmoModel(spec, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    state = nnx.state(model, nnx.Param)
    _check_jax_tree(state_dir, spec, nnx.to_pure_dict(state), pure)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return to_hf(model, spec)


def _read_jax_trainer_weights(ckpt: Path, spec: ModelSpec) -> dict[str, np.ndarray]:
    """The interchange tensors of a JAX trainer checkpoint's parameters, restored by the trainer's
    own ``load_checkpoint`` (weights only: its ``state/`` also holds the AdamW state and the step)
    onto this process's first device."""
    import jax
    from flax import nnx

    from olmo_train_jax import build_model, to_hf
    from olmo_train_jax.checkpoint import abstract_like, load_checkpoint

    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(spec)))
    shapes = nnx.to_pure_dict(state)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    try:
        params, _, _ = load_checkpoint(ckpt, abstract_like(shapes, jax.tree.map(lambda _: device, shapes)), None)
    except TrainingStateError as err:
        raise CheckpointError(str(err)) from None
    nnx.replace_by_pure_dict(state, params)
    return to_hf(nnx.merge(graphdef, state), spec)


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

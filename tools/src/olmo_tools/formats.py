"""Weight formats olmo-convert and olmo-parity read and write, seen through one interface.

A ``Checkpoint`` knows its ``ModelSpec`` and what it stores (name -> shape, dtype) under
the interchange names (transformers' Olmo3 names, ``olmo_model.hf_param_shapes``), and
hands out one tensor at a time, so a conversion between streamable formats holds about
one tensor in memory:

- ``hf:DIR``: config.json + model.safetensors, or model-0000i-of-0000n.safetensors with
  model.safetensors.index.json; read tensor by tensor with positional reads, written by
  a streaming writer (the header is known from the spec before any tensor is read).
- ``olmo-core:PATH``: an OLMo-core olmo3 model state dict, either a torch ``.pt`` file
  (read with ``torch.load(mmap=True)``) or a torch.distributed.checkpoint directory whose
  model keys sit under ``model.`` (as OLMo-core's ``save_model_and_optim_state`` writes
  them; its ``optim.*`` entries are ignored). It carries no config: ``--spec`` is needed.

Our trainers' own checkpoints (``torch:DIR``, ``jax:DIR``) live in ``olmo_tools.native``.
Every check (missing/unexpected tensor, shape, vocab, spec/config agreement) runs before
anything is written, and writers fill a temporary sibling of the destination that is
renamed into place only when complete.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import struct
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from olmo_model import (
    HFLayoutError,
    ModelSpec,
    hf_config,
    hf_param_shapes,
    load_spec,
    spec_from_hf_config,
    validate_hf_tensors,
)
from olmo_model.presets import SpecError
from olmo_run.runlog import CheckpointDamagedError, pid_alive, read_verified_meta

KINDS = ("hf", "olmo-core", "torch", "jax")
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DCP_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes last
TOKENIZER_FILE = "tokenizer.json"  # a fast (tokenizers) tokenizer, as HF folders hold it

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DTYPE_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint or destination that cannot be used; the message names the file, the tensor and the fix."""


@dataclass(frozen=True)
class Location:
    kind: str
    path: Path

    def __str__(self) -> str:
        return f"{self.kind}:{self.path}"


def parse_location(text: str, kinds: tuple[str, ...] = KINDS) -> Location:
    """``KIND:PATH`` -> Location; an unknown kind is an error listing the known ones."""
    kind, sep, path = text.partition(":")
    if not sep or kind not in kinds or not path:
        raise CheckpointError(f"'{text}': expected KIND:PATH with KIND one of {', '.join(kinds)} (e.g. hf:out/model)")
    return Location(kind, Path(path))


# ---- OLMo-core names -------------------------------------------------------------------
# OLMo-core's olmo3 Transformer (ReorderedNormTransformerBlock) parameter names, as its HF
# converter (olmo_core/nn/hf/convert.py, OLMO_CORE_TO_HF_WEIGHT_MAPPINGS) pairs them with
# transformers' names. Its q_norm/k_norm span the full projected width, like Olmo3's.
_OLMO_CORE_TOP = {
    "embeddings.weight": "model.embed_tokens.weight",
    "lm_head.norm.weight": "model.norm.weight",
    "lm_head.w_out.weight": "lm_head.weight",
}
_OLMO_CORE_BLOCK = {
    "attention.w_q.weight": "self_attn.q_proj.weight",
    "attention.w_k.weight": "self_attn.k_proj.weight",
    "attention.w_v.weight": "self_attn.v_proj.weight",
    "attention.w_out.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward_norm.weight": "post_feedforward_layernorm.weight",
}
_HF_FROM_BLOCK = {v: k for k, v in _OLMO_CORE_BLOCK.items()}
_HF_FROM_TOP = {v: k for k, v in _OLMO_CORE_TOP.items()}
_OLMO_CORE_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name_from_olmo_core(key: str) -> str | None:
    """The interchange name of an OLMo-core parameter, or None when OLMo-core's olmo3 has no such name."""
    if key in _OLMO_CORE_TOP:
        return _OLMO_CORE_TOP[key]
    m = _OLMO_CORE_BLOCK_KEY.fullmatch(key)
    if m and m.group(2) in _OLMO_CORE_BLOCK:
        return f"model.layers.{m.group(1)}.{_OLMO_CORE_BLOCK[m.group(2)]}"
    return None


def olmo_core_name(hf_name: str) -> str:
    """The OLMo-core olmo3 parameter name of an interchange name."""
    if hf_name in _HF_FROM_TOP:
        return _HF_FROM_TOP[hf_name]
    m = _HF_LAYER_KEY.fullmatch(hf_name)
    if not m or m.group(2) not in _HF_FROM_BLOCK:
        raise CheckpointError(
            f"tensor '{hf_name}' has no OLMo-core olmo3 counterpart (MoE and per-head QK-norm are not mapped)"
        )
    return f"blocks.{m.group(1)}.{_HF_FROM_BLOCK[m.group(2)]}"


# ---- the reader interface ----------------------------------------------------------------
class Checkpoint:
    """A readable checkpoint: ``spec``, ``stored`` (interchange name -> (shape, dtype)) and ``tensor(name)``;
    where it knows its tokenizer, ``mixture`` (a trainer checkpoint: the mixture its recipe trained
    on) or ``tokenizer_dir`` (an HF folder holding a tokenizer.json)."""

    origin: str
    spec: ModelSpec
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]]
    mixture: str | None = None
    tokenizer_dir: Path | None = None

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter in spec order, one at a time."""
        for name in hf_param_shapes(self.spec):
            yield name, self.tensor(name)

    def close(self) -> None:
        """Release open files; the default reader holds none."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def spec_disagreement(stored: ModelSpec, given: ModelSpec) -> list[str]:
    """Fields on which two specs differ (the display ``name`` aside)."""
    a, b = stored.model_dump(exclude={"name"}), given.model_dump(exclude={"name"})
    return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k]]


def resolve_spec(stored: ModelSpec | None, given: str | ModelSpec | None, origin: str, stored_in: str) -> ModelSpec:
    """The checkpoint's own spec, checked against ``--spec`` when both exist."""
    given_spec = load_spec(given) if isinstance(given, (str, Path)) else given
    if stored is None:
        if given_spec is None:
            raise CheckpointError(f"{origin}: the checkpoint carries no config; pass --spec PRESET_OR_FILE")
        return given_spec
    if given_spec is not None:
        diff = spec_disagreement(stored, given_spec)
        if diff:
            raise CheckpointError(
                f"{origin}: {stored_in} disagrees with --spec ({'; '.join(diff[:3])}); "
                "drop --spec to use the checkpoint's own config, or fix the spec"
            )
    return stored


def require_jax(use: str) -> None:
    """A one-line CheckpointError unless the JAX trainer (jax, flax, orbax) can be imported: the
    olmo-tools[jax] extra, which conversions between torch/OLMo-core and hf do not need."""
    try:
        import olmo_train_jax  # noqa: F401 - imported for the check; its users import what they need
    except ImportError as err:
        raise CheckpointError(
            f"{use}: needs the JAX trainer, which is not installed ({err}); install olmo-tools[jax] "
            "(in this workspace: uv sync --package olmo-tools --extra jax, or uv sync --all-packages)"
        ) from None


def verified_trainer_meta(ckpt: Path) -> dict:
    """The meta.json of a trainer checkpoint folder, once its files match the sizes and sha256
    recorded in it (olmo_run.runlog.verify_checkpoint)."""
    try:
        return read_verified_meta(ckpt)
    except CheckpointDamagedError as err:
        raise CheckpointError(
            f"{err}; convert an intact checkpoint (an older step of that run) or restore it from a copy"
        ) from None


def validate(ckpt: Checkpoint) -> None:
    """Every expected tensor present with its shape, nothing unexpected, a float dtype
    (``olmo_model.validate_hf_tensors``, its error raised as a CheckpointError)."""
    try:
        validate_hf_tensors(
            ckpt.spec,
            {name: shape for name, (shape, _) in ckpt.stored.items()},
            ckpt.origin,
            dtypes={name: dtype for name, (_, dtype) in ckpt.stored.items()},
        )
    except HFLayoutError as err:
        raise CheckpointError(str(err)) from None


def checked_tensor(ckpt: Checkpoint, name: str, t: torch.Tensor) -> torch.Tensor:
    # A file can lie in its header only by corruption; still, never pass on a wrong tensor.
    if tuple(t.shape) != ckpt.stored[name][0]:
        raise CheckpointError(
            f"{ckpt.origin}: tensor '{name}' read with shape {tuple(t.shape)}, header says {ckpt.stored[name][0]}"
        )
    return t


# ---- HF safetensors --------------------------------------------------------------------
class HFCheckpoint(Checkpoint):
    """config.json + model.safetensors (single or sharded). Tensors are read with plain
    positional reads into fresh buffers rather than through a memory map, so the pages of
    tensors already converted do not count against this process's resident memory."""

    def __init__(self, path: Path, spec: str | ModelSpec | None = None):
        self.origin = f"hf:{path}"
        cfg_path = path / CONFIG_FILE
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: not found; an hf: directory holds config.json and model*.safetensors")
        try:
            own = spec_from_hf_config(json.loads(cfg_path.read_text()), source=str(cfg_path))
        except (SpecError, KeyError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{cfg_path}: not a usable Olmo3 config ({err})") from None
        self.spec = resolve_spec(own, spec, self.origin, CONFIG_FILE)
        if (path / TOKENIZER_FILE).is_file():
            self.tokenizer_dir = path
        if (path / INDEX_FILE).is_file():
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (path / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; write the weights as safetensors")
        self._files = {}
        self._where: dict[str, tuple[str, int, int]] = {}  # name -> (file, first byte, end byte)
        self.stored = {}
        for file in files:
            if not (path / file).is_file():
                raise CheckpointError(f"{path / file}: shard listed in {INDEX_FILE} is missing")
            f = open(path / file, "rb")  # noqa: SIM115 - kept open until close()
            self._files[file] = f
            for name, (shape, dtype, begin, end) in _read_safetensors_header(path / file, f).items():
                self.stored[name] = (shape, dtype)
                self._where[name] = (file, begin, end)

    def tensor(self, name: str) -> torch.Tensor:
        file, begin, end = self._where[name]
        shape, dtype = self.stored[name]
        out = torch.empty(shape, dtype=dtype)
        f = self._files[file]
        f.seek(begin)
        if f.readinto(_tensor_bytes(out)) != end - begin:
            raise CheckpointError(f"{self.origin}/{file}: tensor '{name}' is cut short; the file is truncated")
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _read_safetensors_header(path: Path, f) -> dict[str, tuple[tuple[int, ...], torch.dtype, int, int]]:
    """name -> (shape, dtype, absolute first byte, absolute end byte) from a safetensors file:
    an 8-byte little-endian header length, a JSON header, then the tensors' bytes."""
    size = path.stat().st_size
    raw = f.read(8)
    n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else size
    if n > size - 8:
        raise CheckpointError(f"{path}: not a safetensors file (header length {n} exceeds the file)")
    try:
        header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({err})") from None
    header.pop("__metadata__", None)
    out = {}
    for name, entry in header.items():
        if entry["dtype"] not in _DTYPE_FROM_SAFETENSORS:
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {entry['dtype']}; expected F32, BF16 or F16")
        shape, dtype = tuple(entry["shape"]), _DTYPE_FROM_SAFETENSORS[entry["dtype"]]
        begin, end = (8 + n + o for o in entry["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize or end > size:
            raise CheckpointError(f"{path}: tensor '{name}' has a byte range that does not fit its shape or the file")
        out[name] = (shape, dtype, begin, end)
    return out


def _fsync_write(path: Path, chunks: Iterator[memoryview | bytes]) -> None:
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # Reinterpret the (little-endian) storage as bytes without copying it.
    # ignore: numpy's stubs give ndarray __buffer__ only for Python >= 3.12.
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def write_safetensors(
    path: Path,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    fetch: Callable[[str], torch.Tensor],
) -> int:
    """Stream ``entries`` (name, shape, dtype) into one safetensors file, fetching one tensor
    at a time; returns the bytes of tensor data. The header is built from the declared
    shapes first, so the file never needs the whole state dict in memory."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}  # transformers requires format=pt
    offset = 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors itself does

    def chunks() -> Iterator[memoryview | bytes]:
        yield struct.pack("<Q", len(raw))
        yield raw
        for name, shape, dtype in entries:
            t = fetch(name).to(dtype)
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{path}: tensor '{name}' has shape {tuple(t.shape)}, header declares {shape}")
            yield _tensor_bytes(t)

    _fsync_write(path, chunks())
    return offset


def write_hf(
    dst: Path,
    spec: ModelSpec,
    fetch: Callable[[str], torch.Tensor],
    dtype_of: Callable[[str], torch.dtype],
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """An HF directory (config.json + safetensors, sharded above ``max_shard_bytes``) in ``dst``."""
    dst.mkdir(parents=True)
    shapes = hf_param_shapes(spec)
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    used = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * dtype_of(name).itemsize
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape, dtype_of(name)))
        used += size
    if len(shards) == 1:
        write_safetensors(dst / SINGLE_FILE, shards[0], fetch)
    else:
        weight_map, total = {}, 0
        for i, entries in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            total += write_safetensors(dst / file, entries, fetch)
            weight_map.update({name: file for name, _, _ in entries})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (dst / CONFIG_FILE).write_text(json.dumps(hf_config(spec), indent=2) + "\n")


# ---- torch.distributed.checkpoint, one key at a time ---------------------------------------
@contextmanager
def _single_process() -> Iterator[None]:
    # DCP warns on every call that it runs without a process group, which is the point here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_reader(path: Path):
    """torch's FileSystemReader, also for DCPs that OLMo-core wrote, without importing OLMo-core.

    OLMo-core's writer (olmo_core.distributed.checkpoint.filesystem) pickles its own copy of
    torch's per-item record ``_StorageInfo`` (relative_path, offset, length) into .metadata;
    the tensor bytes are torch.save blobs as torch writes them. Unpickling maps that class
    onto torch's, so torch's reader reads the rest unchanged."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if module == "olmo_core.distributed.checkpoint.filesystem" and name == "_StorageInfo":
                return _StorageInfo
            return super().find_class(module, name)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(path / DCP_METADATA, "rb") as f:
                metadata = Unpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))


class DCPDir:
    """A torch.distributed.checkpoint directory read one tensor per ``load`` (no process group)."""

    def __init__(self, path: Path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        meta = _dcp_reader(path).read_metadata()
        self.tensors = {
            key: (tuple(m.size), m.properties.dtype)
            for key, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }

    def load(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        shape, dtype = self.tensors[key]
        out = torch.empty(shape, dtype=dtype)
        with _single_process():
            dcp.load({key: out}, storage_reader=_dcp_reader(self.path), no_dist=True)
        return out


def save_dcp(dst: Path, state: Mapping[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    with _single_process():
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)


def load_torch_file(path: Path) -> Mapping[str, torch.Tensor]:
    """A torch.save'd state dict, memory-mapped so tensors are read only when touched."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, OSError, EOFError) as err:
        raise CheckpointError(f"{path}: not a readable torch state dict ({err})") from None
    if isinstance(state, dict) and set(state) == {"model"} and isinstance(state["model"], dict):
        state = state["model"]  # {"model": state_dict}, as OLMo-core's unsharder and many trainers save it
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, expected a state dict (name -> tensor)")
    return state


# ---- OLMo-core ----------------------------------------------------------------------------
class OlmoCoreCheckpoint(Checkpoint):
    """An OLMo-core olmo3 model state dict: a ``.pt`` file or a DCP directory (keys under ``model.``)."""

    def __init__(self, path: Path, spec: str | ModelSpec | None = None):
        self.origin = f"olmo-core:{path}"
        self.spec = resolve_spec(None, spec, self.origin, "")
        self._dcp: DCPDir | None = None
        self._state: Mapping[str, torch.Tensor] | None = None
        if path.is_dir():
            if not (path / DCP_METADATA).is_file():
                raise CheckpointError(
                    f"{path}: no {DCP_METADATA}; an olmo-core: directory is a torch.distributed.checkpoint"
                )
            self._dcp = DCPDir(path)
            # OLMo-core keeps model and optimizer in one DCP: model keys under "model.".
            keys = {k.removeprefix("model."): k for k in self._dcp.tensors if k.startswith("model.")}
            shapes = {k: self._dcp.tensors[full] for k, full in keys.items()}
        elif path.is_file():
            self._state = load_torch_file(path)
            shapes = {k: (tuple(v.shape), v.dtype) for k, v in self._state.items() if isinstance(v, torch.Tensor)}
            keys = {k: k for k in shapes}
        else:
            raise CheckpointError(f"{path}: not found; olmo-core:PATH is a .pt state dict or a DCP directory")
        self._source_key: dict[str, str] = {}
        self.stored = {}
        for key, stored_key in keys.items():
            # Unknown keys keep their own name so that validate() reports them as unexpected.
            name = hf_name_from_olmo_core(key) or key
            self._source_key[name] = stored_key
            self.stored[name] = shapes[key]

    def tensor(self, name: str) -> torch.Tensor:
        key = self._source_key[name]
        if self._dcp is not None:
            return checked_tensor(self, name, self._dcp.load(key))
        assert self._state is not None  # __init__ sets _dcp or _state
        return checked_tensor(self, name, self._state[key])


def write_olmo_core(dst: Path, ckpt: Checkpoint, dtype_of: Callable[[str], torch.dtype], as_file: bool) -> None:
    """A ``.pt`` state dict (``as_file``), else a DCP directory with keys under ``model.``
    (both need the whole state in memory: torch.save and DCP write one dict)."""
    names = hf_param_shapes(ckpt.spec)
    if as_file:
        state = {olmo_core_name(n): ckpt.tensor(n).to(dtype_of(n)) for n in names}
        with open(dst, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    else:
        save_dcp(dst, {f"model.{olmo_core_name(n)}": ckpt.tensor(n).to(dtype_of(n)).contiguous() for n in names})


# ---- destinations ----------------------------------------------------------------------------
def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def check_destination(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst}: destination exists; pass --overwrite to replace it, or choose another path")


_PARTIAL = re.compile(r"\..+\.partial-(\d+)")  # atomic_destination's temporaries


def _remove_stale_partials(parent: Path) -> None:
    """Remove the temporaries (``.NAME.partial-PID``) that interrupted conversions into
    ``parent`` left, those whose process is gone: a killed olmo-convert cannot clean up after
    itself. A PID means something only on its host, so two hosts converting into one shared
    folder at the same time are not supported. ``.NAME.old-PID`` is left alone: a conversion
    interrupted between its two renames leaves the only copy of the old DST there."""
    for p in sorted(parent.iterdir()):
        m = _PARTIAL.fullmatch(p.name)
        if m and not pid_alive(int(m[1])):
            _remove(p)
            print(
                f"olmo-convert: removed {p}, left by an interrupted conversion (process {m[1]} is gone)",
                file=sys.stderr,
            )


@contextmanager
def atomic_destination(dst: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst`` to fill; it replaces ``dst`` only if the body succeeds,
    and is removed otherwise, so a failed write leaves ``dst`` as it was."""
    dst = dst.absolute()
    check_destination(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(dst.parent)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    _remove(tmp)
    try:
        yield tmp
        if not tmp.exists():
            raise CheckpointError(f"{dst}: the writer produced nothing")
    except BaseException:
        _remove(tmp)
        raise
    if dst.exists():
        # A directory cannot be renamed over a non-empty one: move the old one aside first.
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(tmp, dst)
        _remove(old)
    else:
        os.replace(tmp, dst)


def open_checkpoint(loc: Location, spec: str | ModelSpec | None = None) -> Checkpoint:
    """A validated reader for any source kind; ``spec`` is ``--spec`` (needed for olmo-core only)."""
    if loc.kind == "hf":
        ckpt: Checkpoint = HFCheckpoint(loc.path, spec)
    elif loc.kind == "olmo-core":
        ckpt = OlmoCoreCheckpoint(loc.path, spec)
    elif loc.kind == "torch":
        from .native import TorchCheckpoint

        ckpt = TorchCheckpoint(loc.path, spec)
    elif loc.kind == "jax":
        from .native import JaxCheckpoint

        ckpt = JaxCheckpoint(loc.path, spec)
    else:
        raise CheckpointError(f"{loc}: cannot read kind '{loc.kind}'; use one of {', '.join(KINDS)}")
    validate(ckpt)
    return ckpt

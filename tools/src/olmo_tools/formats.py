"""Weight formats olmo-convert and olmo-parity read and write, seen through one interface
(``olmo_tools.checkpoint.Checkpoint``), and ``open_checkpoint``, the reader of any kind.

A ``Checkpoint`` hands out one tensor at a time, so a conversion between streamable formats
holds about one tensor in memory:

- ``hf:DIR``: config.json + model.safetensors, or model-0000i-of-0000n.safetensors with
  model.safetensors.index.json; read tensor by tensor with positional reads, written by
  a streaming writer (the header is known from the spec before any tensor is read);
  transformers' Olmo3 for a dense spec, OLMoE for an MoE spec it can express (``hf_olmoe``).
- ``olmo-core:PATH``: an OLMo-core model state dict, either a torch ``.pt`` file
  (read with ``torch.load(mmap=True)``) or a torch.distributed.checkpoint directory whose
  model keys sit under ``model.`` (as OLMo-core's ``save_model_and_optim_state`` writes
  them; its ``optim.*`` entries are ignored). It carries no config: ``--spec`` is needed.
  A dense spec maps OLMo-core's olmo3 transformer (names below); a spec with a ``moe``
  section maps its OLMoDDP MoE model (``olmo_tools.olmo_core_moe``).

Our trainers' own checkpoints (``torch:DIR``, ``jax:DIR``) live in ``olmo_tools.native``,
torch.distributed.checkpoint reading in ``olmo_tools.dcp``.
Every check (missing/unexpected tensor, shape, vocab, spec/config agreement) runs before
anything is written, and writers fill a temporary sibling of the destination that is
renamed into place only when complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from olmo_model import ModelSpec, hf_config, hf_param_shapes, spec_from_hf_config
from olmo_model.hf_moe import olmoe_config, spec_from_olmoe_config
from olmo_model.presets import SpecError
from olmo_run.checkpoints import pid_alive

from .checkpoint import KINDS, Checkpoint, CheckpointError, Location, checked_tensor, resolve_spec, validate
from .dcp import DCP_METADATA, DCPDir, load_torch_file, save_dcp
from .hf_olmoe import is_olmoe, name_from_olmoe_file, olmoe_file_name
from .native import JaxCheckpoint, TorchCheckpoint
from .olmo_core_moe import Piece, check_stored, olmoddp_layout, olmoddp_state, stores_fused_qkv, stores_older_moe

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"  # a fast (tokenizers) tokenizer, as HF folders hold it

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DTYPE_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

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
            f"tensor '{hf_name}' has no OLMo-core olmo3 counterpart; MoE specs map through olmo_tools.olmo_core_moe"
        )
    return f"blocks.{m.group(1)}.{_HF_FROM_BLOCK[m.group(2)]}"


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
            cfg = json.loads(cfg_path.read_text())
            olmoe = is_olmoe(cfg)
            own = (spec_from_olmoe_config if olmoe else spec_from_hf_config)(cfg, source=str(cfg_path))
        except (SpecError, KeyError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{cfg_path}: not a usable Olmo3 or OLMoE config ({err})") from None
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
            for stored_name, (shape, dtype, begin, end) in _read_safetensors_header(path / file, f).items():
                name = name_from_olmoe_file(stored_name, f"{path / file}") if olmoe else stored_name
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
    """An HF directory (config.json + safetensors, sharded above ``max_shard_bytes``) in ``dst``:
    transformers' Olmo3 for a dense spec, OLMoE (olmo_tools.hf_olmoe) for an MoE spec it can express."""
    olmoe = spec.moe is not None
    config = olmoe_config(spec) if olmoe else hf_config(spec)  # refuses an MoE spec OLMoE cannot express
    dst.mkdir(parents=True)
    shapes = hf_param_shapes(spec)
    ours = {(olmoe_file_name(n) if olmoe else n): n for n in shapes}  # name in the file -> interchange name
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    used = 0
    for file_name, name in ours.items():
        size = math.prod(shapes[name]) * dtype_of(name).itemsize
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((file_name, shapes[name], dtype_of(name)))
        used += size

    def fetch_file(file_name: str) -> torch.Tensor:
        return fetch(ours[file_name])

    if len(shards) == 1:
        write_safetensors(dst / SINGLE_FILE, shards[0], fetch_file)
    else:
        weight_map, total = {}, 0
        for i, entries in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            total += write_safetensors(dst / file, entries, fetch_file)
            weight_map.update({name: file for name, _, _ in entries})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


# ---- OLMo-core ----------------------------------------------------------------------------
class OlmoCoreCheckpoint(Checkpoint):
    """An OLMo-core model state dict: a ``.pt`` file or a DCP directory (keys under ``model.``);
    olmo3 names for a dense spec, OLMoDDP names (``olmo_core_moe``) for an MoE spec."""

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
            # OLMo-core keeps model and optimizer in one DCP: model keys under "model.". The OLMoDDP
            # train module's own checkpoints hold the fp32 master weights instead, flat, as NAME.main
            # next to their AdamW moments (its _resolve_model_checkpoint_key reads both forms).
            keys = {k.removeprefix("model."): k for k in self._dcp.tensors if k.startswith("model.")}
            keys = keys or {
                k.removeprefix("module.").removesuffix(".main"): k for k in self._dcp.tensors if k.endswith(".main")
            }
            shapes = {k: self._dcp.tensors[full] for k, full in keys.items()}
        elif path.is_file():
            self._state = load_torch_file(path)
            shapes = {k: (tuple(v.shape), v.dtype) for k, v in self._state.items() if isinstance(v, torch.Tensor)}
            keys = {k: k for k in shapes}
        else:
            raise CheckpointError(f"{path}: not found; olmo-core:PATH is a .pt state dict or a DCP directory")
        self._source_key: dict[str, str] = {}
        self._pieces: dict[str, Piece] = {}
        self._unflatten: dict[str, tuple[int, ...]] = {}  # NAME.main keys -> the parameter's shape
        self._last: tuple[str, torch.Tensor] | None = None  # the OLMo-core tensor an MoE name was cut from
        self.stored = {}
        if self.spec.moe is not None:
            self._init_moe(keys, shapes)
            return
        if any(".routed_experts." in k or ".shared_experts." in k or ".feed_forward_moe." in k for k in keys):
            raise CheckpointError(
                f"{self.origin}: an OLMo-core MoE (OLMoDDP) checkpoint, but spec '{self.spec.name}' is dense; "
                "pass --spec with the moe section the checkpoint was trained with"
            )
        for key, stored_key in keys.items():
            # Unknown keys keep their own name so that validate() reports them as unexpected.
            name = hf_name_from_olmo_core(key) or key
            self._source_key[name] = stored_key
            self.stored[name] = shapes[key]

    def _init_moe(self, keys: dict[str, str], shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """The OLMoDDP layout: every OLMo-core tensor checked, then our names cut from them."""
        sizes, _ = olmoddp_layout(self.spec, fused_qkv=stores_fused_qkv(keys), older=stores_older_moe(keys))
        stored = {k: shape for k, (shape, _) in shapes.items()}
        for key, full in keys.items():
            want = sizes.get(key)
            if full.endswith(".main") and want is not None and stored[key] == (math.prod(want),):
                self._unflatten[key] = stored[key] = want
        _, self._pieces = check_stored(self.spec, stored, self.origin)
        self._source_key = keys
        ours = hf_param_shapes(self.spec)
        self.stored = {name: (ours[name], shapes[piece.key][1]) for name, piece in self._pieces.items()}

    def _load(self, key: str) -> torch.Tensor:
        if self._dcp is not None:
            t = self._dcp.load(self._source_key[key])
            return t.view(self._unflatten[key]) if key in self._unflatten else t
        assert self._state is not None  # __init__ sets _dcp or _state
        return self._state[self._source_key[key]]

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._pieces:
            return checked_tensor(self, name, self._load(name))
        piece = self._pieces[name]
        if self._last is None or self._last[0] != piece.key:
            self._last = (piece.key, self._load(piece.key))
        return checked_tensor(self, name, piece.take(self._last[1]).contiguous())


def write_olmo_core(dst: Path, ckpt: Checkpoint, dtype_of: Callable[[str], torch.dtype], as_file: bool) -> None:
    """A ``.pt`` state dict (``as_file``), else a DCP directory with keys under ``model.``
    (both need the whole state in memory: torch.save and DCP write one dict)."""
    names = hf_param_shapes(ckpt.spec)
    if ckpt.spec.moe is not None:
        state = olmoddp_state(ckpt.spec, lambda n: ckpt.tensor(n).to(dtype_of(n)))
    else:
        state = {olmo_core_name(n): ckpt.tensor(n).to(dtype_of(n)).contiguous() for n in names}
    if as_file:
        with open(dst, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    else:
        save_dcp(dst, {f"model.{key}": t for key, t in state.items()})


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
        ckpt = TorchCheckpoint(loc.path, spec)
    elif loc.kind == "jax":
        ckpt = JaxCheckpoint(loc.path, spec)
    else:
        raise CheckpointError(f"{loc}: cannot read kind '{loc.kind}'; use one of {', '.join(KINDS)}")
    validate(ckpt)
    return ckpt

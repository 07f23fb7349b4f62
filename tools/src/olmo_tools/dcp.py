"""torch.distributed.checkpoint directories and torch.save'd state dicts, read one tensor at a
time without a process group: OLMo-core's (``olmo_tools.formats``) and our torch trainer's
(``olmo_tools.native``).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from .checkpoint import CheckpointError

DCP_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes last


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

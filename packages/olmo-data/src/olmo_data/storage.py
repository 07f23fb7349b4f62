"""Token sources: random access to token ids stored on disk, whatever the format.

- `RawTokenFile`: an OLMo-core/Dolma token file as they write it: a headerless array of
  uint16/uint32 ids (read with np.memmap), each document followed by the eos id.
- `ShardSource` / `ShardWriter` (in `olmo_data.shards`): our zstd shard format.
- `ConcatSource`: several files as one logical source, in sorted path order.
- `open_source(...)`: resolves paths, globs and shard directories into one of the above,
  checking missing files, empty globs, dtype and vocab.

Every source returns uint32 ids from `read(start, stop)` and the sorted start offset of
every document from `doc_starts()`. Sources hold no open handles when pickled (Grain
worker processes reopen them).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Literal, Protocol, Sequence

import numpy as np

from olmo_data.errors import DataError
from olmo_data.shards import SHARD_SUFFIX, ShardSource, ShardWriter, check_dtype

__all__ = [
    "TokenSource",
    "RawTokenFile",
    "ShardSource",
    "ShardWriter",
    "ConcatSource",
    "open_source",
    "resolve_paths",
]

# Tokens scanned per step when looking for eos in a raw file: bounds the temporary
# boolean array to 64 MB however large the file is.
_SCAN_TOKENS = 1 << 26


class TokenSource(Protocol):
    """What the loader needs from stored tokens (see the olmo-data contract)."""

    path: str
    num_tokens: int
    num_docs: int
    dtype: np.dtype
    max_token_id: int

    def read(self, start: int, stop: int) -> np.ndarray: ...

    def doc_starts(self) -> np.ndarray: ...


class RawTokenFile:
    """A headerless OLMo/Dolma token file; documents are eos-terminated.

    Document starts come from one vectorised scan for eos (done on first use, cached);
    the same scan records the largest id for the vocab check.
    """

    def __init__(self, path: str | os.PathLike, dtype: Any = "uint16", eos_token_id: int | None = None) -> None:
        self.path = str(path)
        self.dtype = check_dtype(dtype, self.path)
        if eos_token_id is None:
            raise DataError(f"{self.path}: raw token files need eos_token_id to find documents; pass it (mixture: eos_token_id)")
        self.eos_token_id = int(eos_token_id)
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            raise DataError(f"{self.path}: token file not found; check the path or glob") from None
        itemsize = self.dtype.itemsize
        if size % itemsize:
            other = "uint16" if itemsize == 4 else "uint32"
            raise DataError(
                f"{self.path}: size {size} bytes is not a multiple of {itemsize} ({self.dtype.name}): wrong dtype "
                f"(try dtype: {other}) or a truncated file"
            )
        if size == 0:
            raise DataError(f"{self.path}: empty token file; remove it from the mixture")
        self.num_tokens = size // itemsize
        self._mm: np.memmap | None = None
        self._starts: np.ndarray | None = None
        self._max_token_id: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_mm": None}

    def __repr__(self) -> str:
        return f"RawTokenFile({self.path!r}, dtype={self.dtype.name}, tokens={self.num_tokens})"

    def _tokens(self) -> np.memmap:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=self.dtype.newbyteorder("<"), mode="r")
        return self._mm

    def _scan(self) -> None:
        tokens = self._tokens()
        ends, largest = [], 0
        for lo in range(0, self.num_tokens, _SCAN_TOKENS):
            block = tokens[lo : lo + _SCAN_TOKENS]
            ends.append(np.flatnonzero(block == self.eos_token_id).astype(np.int64) + lo + 1)
            largest = max(largest, int(block.max()))
        starts = np.concatenate([np.zeros(1, np.int64), *ends])
        # An eos as the very last token ends the last document; it starts none.
        self._starts = starts[starts < self.num_tokens]
        self._max_token_id = largest

    def doc_starts(self) -> np.ndarray:
        if self._starts is None:
            self._scan()
        return self._starts

    @property
    def num_docs(self) -> int:
        return int(self.doc_starts().size)

    @property
    def max_token_id(self) -> int:
        if self._max_token_id is None:
            self._scan()
        return self._max_token_id

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.path}: read [{start}, {stop}) outside [0, {self.num_tokens})")
        return self._tokens()[start:stop].astype(np.uint32)


class ConcatSource:
    """Several token sources read as one, in the order given (open_source sorts paths)."""

    def __init__(self, sources: Sequence[TokenSource]) -> None:
        if not sources:
            raise DataError("ConcatSource: no sources given; pass at least one file")
        self.sources = list(sources)
        self.path = self.sources[0].path + (f" (+{len(self.sources) - 1} more)" if len(self.sources) > 1 else "")
        self.paths = [s.path for s in self.sources]
        self.dtype = np.dtype(np.uint32 if any(s.dtype == np.uint32 for s in self.sources) else np.uint16)
        self._bounds = np.concatenate([[0], np.cumsum([s.num_tokens for s in self.sources])]).astype(np.int64)
        self.num_tokens = int(self._bounds[-1])
        self._starts: np.ndarray | None = None

    def __repr__(self) -> str:
        return f"ConcatSource({self.paths!r}, tokens={self.num_tokens})"

    @property
    def num_docs(self) -> int:
        return sum(s.num_docs for s in self.sources)

    @property
    def max_token_id(self) -> int:
        return max(s.max_token_id for s in self.sources)

    def doc_starts(self) -> np.ndarray:
        if self._starts is None:
            self._starts = np.concatenate(
                [s.doc_starts() + off for s, off in zip(self.sources, self._bounds[:-1])]
            ).astype(np.int64)
        return self._starts

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.path}: read [{start}, {stop}) outside [0, {self.num_tokens})")
        first = int(np.searchsorted(self._bounds, start, side="right")) - 1
        parts, pos = [], start
        for i in range(max(first, 0), len(self.sources)):
            if pos >= stop:
                break
            lo = int(self._bounds[i])
            hi = min(stop, int(self._bounds[i + 1]))
            parts.append(self.sources[i].read(pos - lo, hi - lo))
            pos = hi
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)


def resolve_paths(path_or_glob: str | os.PathLike | Sequence[str | os.PathLike], format: str) -> list[str]:
    """Files named by paths, globs or (shards) directories, sorted and de-duplicated."""
    items = [path_or_glob] if isinstance(path_or_glob, (str, os.PathLike)) else list(path_or_glob)
    if not items:
        raise DataError("open_source: no paths given; list at least one file or glob")
    suffix = SHARD_SUFFIX if format == "shards" else ".npy"
    found: set[str] = set()
    for item in items:
        item = str(item)
        if glob.has_magic(item):
            matches = [m for m in glob.glob(item, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise DataError(f"{item}: glob matches no file; check the pattern (relative to the mixture YAML)")
            found.update(matches)
        elif os.path.isdir(item):
            matches = [str(p) for p in Path(item).rglob(f"*{suffix}") if p.is_file()]
            if not matches:
                raise DataError(f"{item}: directory holds no *{suffix} file; point at the {format} files")
            found.update(matches)
        elif os.path.isfile(item):
            found.add(item)
        else:
            raise DataError(f"{item}: file not found; check the path (relative to the mixture YAML)")
    return sorted(found)


def open_source(
    path_or_glob: str | os.PathLike | Sequence[str | os.PathLike],
    format: Literal["shards", "numpy"] = "shards",
    dtype: Any = None,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
) -> TokenSource:
    """One token source over every file named (sorted by path; a single file is returned as is).

    format "numpy" reads raw OLMo token files and needs dtype and eos_token_id; format
    "shards" reads dtype from each manifest (a given dtype must then match). With
    vocab_size, an id >= vocab_size is a DataError (free for shards: the manifest
    records the largest id; a full scan for raw files).
    """
    if format not in ("shards", "numpy"):
        raise DataError(f"open_source: format {format!r} is unknown; use 'shards' or 'numpy'")
    paths = resolve_paths(path_or_glob, format)
    sources: list[TokenSource] = []
    for path in paths:
        if format == "numpy":
            if dtype is None:
                raise DataError(f"{path}: raw token files need a dtype; set dtype: uint16 or uint32")
            sources.append(RawTokenFile(path, dtype, eos_token_id))
        else:
            source = ShardSource(path)
            if dtype is not None and check_dtype(dtype, path) != source.dtype:
                raise DataError(
                    f"{path}: shard dtype is {source.dtype.name} but {np.dtype(dtype).name} was asked; drop dtype for shards"
                )
            sources.append(source)
    if vocab_size is not None:
        for source in sources:
            if source.max_token_id >= vocab_size:
                raise DataError(
                    f"{source.path}: token id {source.max_token_id} >= vocab_size {vocab_size}: wrong dtype, "
                    "tokenizer or vocab_size; fix the mixture's vocab_size or re-tokenize"
                )
    return sources[0] if len(sources) == 1 else ConcatSource(sources)

"""Token sources: random access to token ids stored on disk, whatever the format.

- `RawTokenFile`: an OLMo-core/Dolma token file as they write it: a headerless array of
  uint16/uint32 ids (read with np.memmap), each document followed by the eos id.
- `ShardSource` / `ShardWriter` (in `olmo_data.shards`): our zstd shard format.
- `ConcatSource`: several files as one logical source, in sorted path order.
- `open_source(...)`: resolves paths, globs and shard directories into one of the above,
  checking missing files, empty globs, dtype and vocab.
- `content_sha256(path)`: the sha256 of a file's bytes, cached on disk by its stat (the
  fingerprint of raw files, which carry no checksums of their own).

Every source returns uint32 ids from `read(start, stop)` and the sorted start offset of
every document from `doc_starts()`. Sources hold no open handles when pickled (Grain
worker processes reopen them).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
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
    "content_sha256",
    "cache_root",
    "locate",
]

# Tokens scanned per step when looking for eos in a raw file: bounds the temporary
# boolean array to 64 MB however large the file is.
_SCAN_TOKENS = 1 << 26
# Every tokenizer in use has fewer than 2**20 ids (the largest hold ~256k), so the high 16
# bits of a genuine uint32 id are < 16; the dtype probe of raw files rests on that.
_ID_LIMIT = 1 << 20
# The dtype probe reads this many blocks of this many 4-byte words, spread evenly over the
# file: a few KiB of reads whatever its size, and thousands of samples.
_PROBE_BLOCKS, _PROBE_WORDS = 16, 256
# Fewer words than this say nothing about a uint16 file: a tiny genuine one could hold
# only small ids at its odd positions by chance.
_PROBE_MIN_WORDS = 64
# A file modified less than this before its hash started is hashed but not cached: a later
# write within the same file-system timestamp tick would leave its mtime unchanged (git's
# "racy clean" case); 2 s covers the coarsest timestamps (FAT) and modest clock skew.
_RACY_NS = 2_000_000_000


class TokenSource(Protocol):
    """What the loader needs from stored tokens (see the olmo-data contract).

    Read-only properties: an implementation may hold each as a plain attribute or compute
    it (RawTokenFile scans for num_docs and max_token_id on first use)."""

    @property
    def path(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_docs(self) -> int: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def max_token_id(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...

    def doc_starts(self) -> np.ndarray: ...


def _probe_words(f: Any, size: int) -> np.ndarray:
    """[n, 2] little-endian uint16 halves of up to _PROBE_BLOCKS x _PROBE_WORDS 4-byte words
    spread evenly over an open file of `size` bytes (a multiple of 4)."""
    words = size // 4
    if words <= _PROBE_BLOCKS * _PROBE_WORDS:
        starts, count = [0], words
    else:
        starts, count = np.linspace(0, words - _PROBE_WORDS, _PROBE_BLOCKS).astype(np.int64).tolist(), _PROBE_WORDS
    parts = []
    for start in starts:
        f.seek(4 * start)
        parts.append(np.frombuffer(f.read(4 * count), dtype="<u2"))
    return np.concatenate(parts).reshape(-1, 2)


class RawTokenFile:
    """A headerless OLMo/Dolma token file; documents are eos-terminated.

    Opening reads a few KiB: a sampled probe that the ids fit the declared dtype, and the
    last token, which must be eos (else the file is truncated). Document starts come from
    one vectorised scan for eos (done on first use, cached); the same scan records the
    largest id for the vocab check.
    """

    def __init__(self, path: str | os.PathLike, dtype: Any = "uint16", eos_token_id: int | None = None) -> None:
        self.path = str(path)
        self.dtype = check_dtype(dtype, self.path)
        if eos_token_id is None:
            raise DataError(
                f"{self.path}: raw token files need eos_token_id to find documents; pass it (mixture: eos_token_id)"
            )
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
        with open(self.path, "rb") as f:
            if size % 4 == 0:  # otherwise the file cannot be uint32 ids, nor read as them
                self._check_dtype(_probe_words(f, size))
            f.seek(size - itemsize)
            last = int(np.frombuffer(f.read(itemsize), dtype=self.dtype.newbyteorder("<"))[0])
        if last != self.eos_token_id:
            # Writers end every document with eos, so a file that does not end with it lost
            # its tail (a copy or export cut short by a multiple of the item size).
            raise DataError(
                f"{self.path}: last token is {last}, not eos_token_id {self.eos_token_id}: the file looks truncated "
                "(its last document lost its eos); re-export or re-tokenize it (or fix eos_token_id)"
            )
        self.num_tokens = size // itemsize
        self._mm: np.memmap | None = None
        self._starts: np.ndarray | None = None
        self._max_token_id: int | None = None

    def _check_dtype(self, words: np.ndarray) -> None:
        """Refuse ids that were written with the other dtype; `words` are sampled 4-byte
        words as (low, high) uint16 halves."""
        low, high = words[:, 0], words[:, 1]
        if self.dtype == np.uint16:
            # Read as uint16, uint32 ids put their high halves at the odd positions: all < 16
            # (0 below 65536 ids, 0 or 1 for Olmo 3's ~100k vocab). Genuine uint16 data holds
            # ordinary tokens there, distributed as at the even positions; thousands of them
            # all among the 16 smallest ids does not occur (and a low half >= 16 rules out a
            # file whose every id is tiny, where the two dtypes cannot be told apart).
            if len(words) >= _PROBE_MIN_WORDS and high.max() < 16 <= low.max():
                raise DataError(
                    f"{self.path}: dtype uint16 does not fit this file: all {len(words)} sampled odd positions "
                    "hold ids < 16, as the high halves of uint32 ids do; set dtype: uint32"
                )
        else:
            # Read as uint32, uint16 data fuses two tokens into one id, t0 + 65536 * t1:
            # ids far beyond any vocabulary as soon as one odd token is >= 16.
            ids = low.astype(np.uint32) | (high.astype(np.uint32) << 16)
            if ids.size and int(ids.max()) >= _ID_LIMIT:
                raise DataError(
                    f"{self.path}: dtype uint32 does not fit this file: sampled id {int(ids.max())} is beyond any "
                    f"vocabulary (>= {_ID_LIMIT}), as two uint16 ids read as one uint32 are; set dtype: uint16"
                )

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
        assert self._starts is not None  # set by _scan
        return self._starts

    @property
    def num_docs(self) -> int:
        return int(self.doc_starts().size)

    @property
    def max_token_id(self) -> int:
        if self._max_token_id is None:
            self._scan()
        assert self._max_token_id is not None  # set by _scan
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


def locate(source: TokenSource, offset: int) -> tuple[TokenSource, int]:
    """The single-file source holding token `offset` of `source`, and the offset within it."""
    parts = getattr(source, "sources", None)
    if parts is None:
        return source, offset
    bounds = np.concatenate([[0], np.cumsum([p.num_tokens for p in parts])])
    i = int(np.searchsorted(bounds, offset, side="right")) - 1
    return locate(parts[i], offset - int(bounds[i]))


def cache_root() -> Path:
    """Where olmo_data keeps what it derives from data: $OLMO_CACHE, default ~/.cache/olmo-twin."""
    return Path(os.environ.get("OLMO_CACHE") or Path.home() / ".cache" / "olmo-twin")


def content_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes, streamed (bounded memory), cached in
    cache_root()/file-sha256 under its (real path, size, mtime_ns, ctime_ns, inode).
    sha256 rather than blake2b: CPUs with SHA extensions run it faster, and the shard
    manifests already use it.

    The cache sits on disk beside the leakage reports, not only in memory, because every
    process that loads a mixture (each rank, each restart, the CLI) needs the fingerprint,
    and re-reading a corpus each time is what the cache avoids. What the key trusts: that
    any change to a file's bytes changes its stat. A write moves mtime; a file rewritten
    and renamed into place has a new inode even if os.utime restores its mtime, and
    os.utime itself moves ctime, which only the kernel sets. A write within the same
    timestamp tick as the hashed version is covered by not caching files modified less
    than _RACY_NS before hashing. Not seen: an edit that bypasses the file system (writes
    to the block device) or a clock set back.
    """
    real = os.path.realpath(path)

    def stat_key() -> list:
        st = os.stat(real)
        return [real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    key = stat_key()
    mtime_ns = key[2]
    entry = cache_root() / "file-sha256" / f"v1-{hashlib.sha256(json.dumps(key).encode()).hexdigest()}.json"
    try:
        cached = json.loads(entry.read_text())
        if cached["key"] == key:
            return cached["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no entry, or an unreadable one: hash the file
    started = time.time_ns()
    with open(real, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    # Cache only a file that was settled before the hash began and did not change during it.
    if started - mtime_ns >= _RACY_NS and stat_key() == key:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "sha256": digest}))
            os.replace(tmp, entry)
        except OSError:
            pass  # a read-only cache costs a re-hash next time, nothing else
    return digest


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
            source: TokenSource = ShardSource(path)
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

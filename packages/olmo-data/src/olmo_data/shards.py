"""The zstd shard format: one file per shard (``*.shard``), random access by chunk.

Layout of a shard file (all integers little-endian)::

    b"OLMOSHD1"                      8-byte magic
    chunk 0 .. chunk K-1             zstd frames, each `chunk_tokens` tokens (the last may be
                                     shorter), with zstd's own xxh64 content checksum
    doc starts                       one zstd frame: int64 start offset of every document
    manifest                         UTF-8 JSON (below)
    u64 manifest length, b"OLMOSHDE" 16-byte footer

The manifest holds dtype, num_tokens, num_docs, max_token_id, chunk_tokens and for every
chunk (and for the doc-start block) its byte offset, compressed size, token count and the
sha256 of both its compressed and its uncompressed bytes. A read verifies the sha256 of the
compressed bytes it touches and zstd verifies the xxh64 of the decompressed bytes
(measured: ~1.7 ms per 2 MB for sha256 vs ~3 ms to decompress 1M tokens);
`ShardSource.verify()` also re-checks every uncompressed sha256. A file is complete iff it
is present under its final name: `ShardWriter` writes a temp file and renames (or, for a
``gs://`` / ``s3://`` URL, uploads) it.

Shards are read through `olmo_data.fileio.RangeReader`, locally or from object storage with
the same code: opening reads the magic and the file's tail (footer and manifest) in one
round of two ranged reads, and a token read fetches only the compressed chunks it touches,
so reading one window of a remote shard costs about one compressed chunk, never the file.
`ShardSource.remote_ranges` names those chunks ahead of a read, so that the loader can fetch
all of a batch's chunks at once (`olmo_data.fileio.staged_reads`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import zstandard

from olmo_data.errors import DataError, ShardCorruptError
from olmo_data.fileio import AtomicWriter, RangeReader, is_remote

SHARD_SUFFIX = ".shard"
_MAGIC = b"OLMOSHD1"
_FOOTER_MAGIC = b"OLMOSHDE"
_FOOTER = struct.Struct("<Q8s")
_FORMAT_VERSION = 1
# 1M tokens per chunk (2 MB of uint16): a loader reading 4-8k-token instances
# decompresses each chunk once and then serves ~200 sequential instances from the cache.
DEFAULT_CHUNK_TOKENS = 1 << 20
# zstd level 3 is zstd's default: fast to write, and decompression speed barely depends on it.
_ZSTD_LEVEL = 3
# Decompressed chunks kept per shard: enough for a few interleaved sequential readers.
_CACHE_CHUNKS = 4
# ... and by all of a process's shards together: a corpus of thousands of shards read in a
# shuffled order would otherwise keep _CACHE_CHUNKS chunks of every one (4 MiB apiece at the
# default chunk size of uint32 ids). 256 MiB: 64 such chunks.
_CACHE_BYTES = 256 << 20
# Opening reads this much of the file's end, which holds the footer and, for shards of up to
# ~200 chunks (200M tokens at the default chunk size), the whole manifest: one read, not two.
_TAIL_BYTES = 64 << 10
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class _ChunkCache:
    """Decompressed chunks of every ShardSource in the process, least recently used first out:
    at most `per_source` chunks of one source and `max_bytes` in all. Sources are told apart
    by a token of their own (never id(), which a new object may reuse)."""

    def __init__(self, per_source: int, max_bytes: int) -> None:
        self.per_source, self.max_bytes = per_source, max_bytes
        self._lock = threading.Lock()
        self._all: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._of: dict[int, OrderedDict[int, None]] = {}
        self.nbytes = 0

    def get(self, owner: int, index: int) -> np.ndarray | None:
        with self._lock:
            arr = self._all.get((owner, index))
            if arr is not None:
                self._all.move_to_end((owner, index))
                self._of[owner].move_to_end(index)
            return arr

    def missing(self, owner: int, indices: range) -> list[int]:
        with self._lock:
            return [i for i in indices if (owner, i) not in self._all]

    def put(self, owner: int, index: int, arr: np.ndarray) -> None:
        with self._lock:
            if (owner, index) in self._all:
                return
            self._all[(owner, index)] = arr
            self._of.setdefault(owner, OrderedDict())[index] = None
            self.nbytes += arr.nbytes
            while len(self._of[owner]) > self.per_source:
                self._evict(owner, next(iter(self._of[owner])))
            while self.nbytes > self.max_bytes and len(self._all) > 1:
                self._evict(*next(iter(self._all)))

    def drop(self, owner: int) -> None:
        """Forget a source's chunks (it was garbage-collected)."""
        with self._lock:
            for index in list(self._of.get(owner, ())):
                self._evict(owner, index)

    def _evict(self, owner: int, index: int) -> None:
        self.nbytes -= self._all.pop((owner, index)).nbytes
        del self._of[owner][index]
        if not self._of[owner]:
            del self._of[owner]


_CHUNKS = _ChunkCache(_CACHE_CHUNKS, _CACHE_BYTES)
_OWNERS = itertools.count()


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def check_dtype(dtype: Any, where: str) -> np.dtype:
    """np.uint16 or np.uint32 from a name or numpy dtype, else a DataError naming `where`."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _DTYPES:
        raise DataError(f"{where}: dtype {dtype!r} is not supported; use uint16 (vocab <= 65536) or uint32")
    return np.dtype(_DTYPES[name])


class ShardWriter:
    """Writes one shard file atomically: documents go in with `add_document`, `close()`
    renames the finished temp file into place, or uploads it when `path` is a URL (a crash
    leaves no file under `path`; see `olmo_data.fileio.AtomicWriter`).

    Tokens are stored as given; callers append the eos id to each document themselves
    (`olmo-data tokenize` and the sample do), as OLMo-core/Dolma token files do.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        dtype: Any = "uint16",
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"ShardWriter({path}): chunk_tokens must be > 0, got {chunk_tokens}")
        self.dtype = check_dtype(dtype, f"ShardWriter({path})")
        self.chunk_tokens = chunk_tokens
        self.metadata = dict(metadata or {})
        self._out = AtomicWriter(path)
        self.path = self._out.path
        self._file = self._out.file
        self._file.write(_MAGIC)
        self._compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True)
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._chunks: list[dict[str, Any]] = []
        self._doc_starts: list[int] = []
        self._num_tokens = 0
        self._max_token_id = -1
        self._closed = False

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_docs(self) -> int:
        return len(self._doc_starts)

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document (its eos included, if the caller wants one)."""
        if self._closed:
            raise RuntimeError(f"ShardWriter({self.path}) is closed")
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.size == 0:
            raise DataError(f"{self.path}: a document must be a non-empty 1-D token array, got shape {arr.shape}")
        if arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max:
            raise DataError(
                f"{self.path}: token id {int(arr.max())} does not fit dtype {self.dtype.name}; write with dtype='uint32'"
            )
        self._doc_starts.append(self._num_tokens)
        self._num_tokens += arr.size
        self._max_token_id = max(self._max_token_id, int(arr.max()))
        self._pending.append(arr.astype(self.dtype))
        self._pending_tokens += arr.size
        while self._pending_tokens >= self.chunk_tokens:
            self._flush_chunk(self.chunk_tokens)

    def _flush_chunk(self, n: int) -> None:
        buf = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        chunk, rest = buf[:n], buf[n:]
        self._pending = [rest] if rest.size else []
        self._pending_tokens = rest.size
        raw = chunk.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self._chunks.append({"num_tokens": int(chunk.size), **self._write_block(raw)})

    def _write_block(self, raw: bytes) -> dict[str, Any]:
        comp = self._compressor.compress(raw)
        offset = self._file.tell()
        self._file.write(comp)
        return {
            "offset": offset,
            "compressed_size": len(comp),
            "sha256_compressed": _sha256(comp),
            "sha256_uncompressed": _sha256(raw),
        }

    def close(self) -> str:
        """Finish the shard and put it in place; returns its path."""
        if self._closed:
            return self.path
        if self._num_tokens == 0:
            self.abort()
            raise DataError(f"{self.path}: a shard needs at least one document; add_document() before close()")
        if self._pending_tokens:
            self._flush_chunk(self._pending_tokens)
        doc_block = self._write_block(np.asarray(self._doc_starts, dtype="<i8").tobytes())
        manifest = {
            "format": "olmo-shard",
            "version": _FORMAT_VERSION,
            "dtype": self.dtype.name,
            "num_tokens": self._num_tokens,
            "num_docs": len(self._doc_starts),
            "max_token_id": self._max_token_id,
            "chunk_tokens": self.chunk_tokens,
            "chunks": self._chunks,
            "doc_starts": doc_block,
            "metadata": self.metadata,
        }
        blob = json.dumps(manifest, sort_keys=True).encode()
        self._file.write(blob)
        self._file.write(_FOOTER.pack(len(blob), _FOOTER_MAGIC))
        self._closed = True
        return self._out.commit()

    def abort(self) -> None:
        """Drop the unfinished shard (no file is left under `path`)."""
        if not self._closed:
            self._out.abort()
            self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a shard file, checking magic, footer and sizes (not the chunk hashes)."""
    return _read_manifest(RangeReader(path))


def _read_manifest(reader: RangeReader) -> dict[str, Any]:
    path = reader.path
    try:
        size = reader.size()
        if size < len(_MAGIC) + _FOOTER.size:
            raise ShardCorruptError(f"{path}: truncated shard ({size} bytes); re-create it (olmo-data tokenize)")
        tail_len = min(size, _TAIL_BYTES)
        head, tail = reader.pread_many([(0, len(_MAGIC)), (size - tail_len, tail_len)])
        if len(tail) != tail_len:
            raise ShardCorruptError(f"{path}: shorter than its {size} bytes while read (truncated?); re-create it")
        length, magic = _FOOTER.unpack(tail[-_FOOTER.size :])
        if head != _MAGIC or magic != _FOOTER_MAGIC or length > size - _FOOTER.size - len(_MAGIC):
            raise ShardCorruptError(
                f"{path}: not a complete olmo shard (bad magic or footer: truncated?); re-create it"
            )
        if length + _FOOTER.size <= tail_len:
            blob = tail[tail_len - _FOOTER.size - length : tail_len - _FOOTER.size]
        else:
            blob = reader.pread(size - _FOOTER.size - length, length)
        manifest = json.loads(blob)
    except FileNotFoundError:
        raise DataError(f"{path}: shard file not found; check the path or glob in the mixture") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardCorruptError(f"{path}: manifest is not valid JSON ({e}); re-create the shard") from None
    if manifest.get("format") != "olmo-shard" or manifest.get("version") != _FORMAT_VERSION:
        raise ShardCorruptError(
            f"{path}: manifest format {manifest.get('format')}/{manifest.get('version')} is not olmo-shard/"
            f"{_FORMAT_VERSION}; re-create the shard"
        )
    end = manifest["doc_starts"]["offset"] + manifest["doc_starts"]["compressed_size"]
    if end + length + _FOOTER.size != size:
        raise ShardCorruptError(f"{path}: size {size} does not match its manifest (truncated?); re-create it")
    if sum(c["num_tokens"] for c in manifest["chunks"]) != manifest["num_tokens"]:
        raise ShardCorruptError(f"{path}: manifest chunk token counts do not sum to num_tokens; re-create it")
    return manifest


class ShardSource:
    """A `TokenSource` over one shard file, local or a URL. Thread-safe; picklable (reopens the
    file lazily). Decompressed chunks are kept in a cache shared by the process's shards
    (`_CACHE_CHUNKS` per shard, `_CACHE_BYTES` in all)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._reader = RangeReader(path)
        self.path = self._reader.path
        self.manifest = _read_manifest(self._reader)
        self.dtype = check_dtype(self.manifest["dtype"], self.path)
        self.num_tokens: int = int(self.manifest["num_tokens"])
        self.num_docs: int = int(self.manifest["num_docs"])
        self.max_token_id: int = int(self.manifest["max_token_id"])
        sizes = [c["num_tokens"] for c in self.manifest["chunks"]]
        # Token offset where each chunk starts, plus the end: a read bisects this.
        self._chunk_bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._init_runtime()

    def _init_runtime(self) -> None:
        # The key of this source's chunks in the process-wide cache (_CHUNKS), freed with it.
        self._owner = next(_OWNERS)
        weakref.finalize(self, _CHUNKS.drop, self._owner)
        self._doc_starts: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_owner", "_doc_starts"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return f"ShardSource({self.path!r}, tokens={self.num_tokens}, docs={self.num_docs})"

    def _read_block(self, block: dict[str, Any], what: str) -> bytes:
        try:
            comp = self._reader.pread(block["offset"], block["compressed_size"])
        except FileNotFoundError:
            raise DataError(f"{self.path}: shard file vanished after opening; check the path") from None
        if len(comp) != block["compressed_size"] or _sha256(comp) != block["sha256_compressed"]:
            raise ShardCorruptError(
                f"{self.path}: {what} is corrupt (sha256 of compressed bytes differs from the manifest); re-create the shard"
            )
        try:
            return zstandard.ZstdDecompressor().decompress(comp)
        except zstandard.ZstdError as e:
            raise ShardCorruptError(f"{self.path}: {what} does not decompress ({e}); re-create the shard") from None

    def _chunk(self, index: int, verify_uncompressed: bool = False) -> np.ndarray:
        cached = None if verify_uncompressed else _CHUNKS.get(self._owner, index)
        if cached is not None:
            return cached
        meta = self.manifest["chunks"][index]
        raw = self._read_block(meta, f"chunk {index}")
        if verify_uncompressed and _sha256(raw) != meta["sha256_uncompressed"]:
            raise ShardCorruptError(f"{self.path}: chunk {index} sha256 of uncompressed bytes differs; re-create it")
        arr = np.frombuffer(raw, dtype=self.dtype.newbyteorder("<"))
        if arr.size != meta["num_tokens"]:
            raise ShardCorruptError(
                f"{self.path}: chunk {index} holds {arr.size} tokens, manifest says {meta['num_tokens']}; re-create it"
            )
        _CHUNKS.put(self._owner, index, arr)
        return arr

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as uint32; decompresses only the chunks the range touches."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.path}: read [{start}, {stop}) outside [0, {self.num_tokens})")
        out = np.empty(stop - start, dtype=np.uint32)
        if stop == start:
            return out
        first = int(np.searchsorted(self._chunk_bounds, start, side="right")) - 1
        pos = start
        for index in range(first, len(self.manifest["chunks"])):
            if pos >= stop:
                break
            lo = int(self._chunk_bounds[index])
            hi = min(stop, int(self._chunk_bounds[index + 1]))
            out[pos - start : hi - start] = self._chunk(index)[pos - lo : hi - lo]
            pos = hi
        return out

    def remote_ranges(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        """(URL, offset, length) of the compressed chunks `read(start, stop)` would fetch from
        object storage: the chunks it touches that are not in the cache now (none locally)."""
        if stop <= start or not is_remote(self.path):
            return []
        first = int(np.searchsorted(self._chunk_bounds, start, side="right")) - 1
        last = int(np.searchsorted(self._chunk_bounds, stop - 1, side="right")) - 1
        missing = _CHUNKS.missing(self._owner, range(first, last + 1))
        chunks = self.manifest["chunks"]
        return [(self.path, chunks[i]["offset"], chunks[i]["compressed_size"]) for i in missing]

    def index_ranges(self) -> list[tuple[str, int, int]]:
        """(URL, offset, length) of the doc-start block if `doc_starts()` has yet to fetch it."""
        if self._doc_starts is not None or not is_remote(self.path):
            return []
        block = self.manifest["doc_starts"]
        return [(self.path, block["offset"], block["compressed_size"])]

    def doc_starts(self) -> np.ndarray:
        if self._doc_starts is None:
            raw = self._read_block(self.manifest["doc_starts"], "doc-start index")
            starts = np.frombuffer(raw, dtype="<i8").astype(np.int64)
            if starts.size != self.num_docs or (starts.size and starts[0] != 0) or np.any(np.diff(starts) <= 0):
                raise ShardCorruptError(f"{self.path}: doc-start index is inconsistent with the manifest; re-create it")
            self._doc_starts = starts
        return self._doc_starts

    def verify(self) -> None:
        """Check every chunk's compressed and uncompressed sha256 (a full read of the shard)."""
        for index in range(len(self.manifest["chunks"])):
            self._chunk(index, verify_uncompressed=True)
        self.doc_starts()

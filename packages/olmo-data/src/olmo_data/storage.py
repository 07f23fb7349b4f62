"""Token sources: random access to token ids stored on disk or in object storage, whatever
the format. Every path may be local, ``file://``, ``gs://`` or ``s3://`` (`olmo_data.fileio`).

- `RawTokenFile`: an OLMo-core/Dolma token file as they write it: a headerless array of
  uint16/uint32 ids (local: np.memmap; remote: one ranged read per `read`), each document
  followed by the eos id.
- `ShardSource` / `ShardWriter` (in `olmo_data.shards`): our zstd shard format.
- `ConcatSource`: several files as one logical source, in sorted path order.
- `PerFileWindows`: a ConcatSource windowed as OLMo-core's `NumpyFSLDataset` windows its
  files: in the order given, each file cut into its own windows (`windowing: olmo-core`).
- `open_source(...)`: resolves paths, globs and shard directories into one of the above,
  checking missing files, empty globs, dtype and vocab.
- `num_windows` / `window_spans`: where the windows of sequence_length tokens of any of them lie.
- `remote_ranges` / `window_ranges`: the object-storage byte ranges that reading some token
  spans or windows will fetch, so that a loader can fetch a whole batch's at once
  (`olmo_data.fileio.staged_reads`) instead of one GET per window as each is read.
- `content_sha256(path)`: the sha256 of a file's bytes, cached on disk by its stat or, for
  an object, its (URL, size, generation or ETag) (the fingerprint of raw files, which carry
  no checksums of their own).

Every source returns uint32 ids from `read(start, stop)` and the sorted start offset of
every document from `doc_starts()`. Sources hold no open handles when pickled (Grain
worker processes reopen them).

A raw file carries no document index, so its documents are found by scanning every token
for eos. For a remote file that scan streams the object once (the same pass computes its
sha256) and its result, 8 bytes per document, is cached under cache_root()/raw-index keyed
by (URL, size, version, dtype, eos): every later open on the machine, by any rank or
restart, reads that small file instead of the object. No cache of token bytes is kept: the
data order visits every window once per epoch in a shuffled order, so a local cache smaller
than the data would rarely hit, and shards already keep their last decompressed chunks.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol, Sequence

import numpy as np

from olmo_data import fileio
from olmo_data.errors import DataError
from olmo_data.shards import _MAGIC, SHARD_SUFFIX, ShardSource, ShardWriter, check_dtype

__all__ = [
    "TokenSource",
    "RawTokenFile",
    "ShardSource",
    "ShardWriter",
    "ConcatSource",
    "PerFileWindows",
    "Windowing",
    "open_source",
    "num_windows",
    "window_spans",
    "remote_ranges",
    "window_ranges",
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

# How a source's files are cut into windows: "concat" (ours: files sorted by path, one token
# stream, a window may cross a file end) or "olmo-core" (NumpyFSLDataset's: PerFileWindows).
Windowing = Literal["concat", "olmo-core"]


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


def _probe_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) of up to _PROBE_BLOCKS runs of _PROBE_WORDS 4-byte words spread evenly
    over a file of `size` bytes (a multiple of 4)."""
    words = size // 4
    if words <= _PROBE_BLOCKS * _PROBE_WORDS:
        return [(0, 4 * words)]
    starts = np.linspace(0, words - _PROBE_WORDS, _PROBE_BLOCKS).astype(np.int64).tolist()
    return [(4 * start, 4 * _PROBE_WORDS) for start in starts]


class RawTokenFile:
    """A headerless OLMo/Dolma token file; documents are eos-terminated.

    Opening reads a few KiB: a sampled probe that the ids fit the declared dtype, and the
    last token, which must be eos (else the file is truncated). Document starts come from
    one vectorised scan for eos (done on first use, cached); the same scan records the
    largest id for the vocab check.
    """

    def __init__(self, path: str | os.PathLike, dtype: Any = "uint16", eos_token_id: int | None = None) -> None:
        self.path = fileio.normalize(path)
        self.dtype = check_dtype(dtype, self.path)
        if eos_token_id is None:
            raise DataError(
                f"{self.path}: raw token files need eos_token_id to find documents; pass it (mixture: eos_token_id)"
            )
        self.eos_token_id = int(eos_token_id)
        try:
            size = fileio.size(self.path)
        except FileNotFoundError:
            raise DataError(f"{self.path}: token file not found; check the path or glob") from None
        itemsize = self.dtype.itemsize
        if size % itemsize:
            # Only a dtype whose item size divides the file's size can be the right one.
            fits = [d for d in ("uint16", "uint32") if d != self.dtype.name and size % np.dtype(d).itemsize == 0]
            cause = "no token dtype divides it: a truncated or foreign file; re-write it or remove it from the mixture"
            if fits:
                cause = f"wrong dtype (try dtype: {fits[0]}) or a truncated file"
            raise DataError(
                f"{self.path}: size {size} bytes is not a multiple of {itemsize} ({self.dtype.name}): {cause}"
            )
        if size == 0:
            raise DataError(f"{self.path}: empty token file; remove it from the mixture")
        self.remote = fileio.is_remote(self.path)
        reader = fileio.RangeReader(self.path)
        # Local reads go through the memmap; only a remote file keeps its reader.
        self._reader = reader if self.remote else None
        # One round of reads (concurrent on object storage): the head, the probe, the last token.
        # (_MAGIC stays private to shards.py: any edit there changes the sample's recipe hash,
        # which rebuilds every sample cache.)
        head = min(size, len(_MAGIC))
        probe = _probe_ranges(size) if size % 4 == 0 else []  # otherwise it cannot be uint32 ids
        parts = reader.pread_many([(0, head), *probe, (size - itemsize, itemsize)])
        if sum(map(len, parts)) != head + sum(n for _, n in probe) + itemsize:
            raise DataError(f"{self.path}: shorter than its {size} bytes while read; retry once it is complete")
        if parts[0] == _MAGIC:
            # Read as ids, a shard's zstd bytes pass every other check by chance often enough; its
            # magic as uint16 ids would be 4 particular tokens opening a file, as uint32 ids >= 2**20.
            raise DataError(
                f"{self.path}: this is an olmo-data zstd shard, not raw tokens; read it with format: shards "
                "(or write raw token files with olmo-data tokenize --format numpy)"
            )
        if probe:
            self._check_dtype(np.frombuffer(b"".join(parts[1:-1]), dtype="<u2").reshape(-1, 2))
        last = int(np.frombuffer(parts[-1], dtype=self.dtype.newbyteorder("<"))[0])
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
        if self.remote:
            self._starts, self._max_token_id = _remote_raw_index(self)
            return
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

    def remote_ranges(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        """(URL, offset, length) that `read(start, stop)` fetches from object storage (none locally)."""
        if not self.remote or stop <= start:
            return []
        return [(self.path, start * self.dtype.itemsize, (stop - start) * self.dtype.itemsize)]

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.path}: read [{start}, {stop}) outside [0, {self.num_tokens})")
        if not self.remote:
            return self._tokens()[start:stop].astype(np.uint32)
        assert self._reader is not None  # kept for every remote file
        itemsize = self.dtype.itemsize
        raw = self._reader.pread(start * itemsize, (stop - start) * itemsize)
        if len(raw) != (stop - start) * itemsize:
            raise DataError(
                f"{self.path}: read of tokens [{start}, {stop}) came back short: the object shrank after opening; "
                "re-upload it and restart"
            )
        return np.frombuffer(raw, dtype=self.dtype.newbyteorder("<")).astype(np.uint32)


def _remote_raw_index(src: RawTokenFile) -> tuple[np.ndarray, int]:
    """(document starts, largest id) of a remote raw file: from the cache (module docstring)
    or by streaming the object once, which also records its content sha256."""
    st = fileio.stat(src.path)
    if st.size != src.num_tokens * src.dtype.itemsize:
        raise DataError(f"{src.path}: changed size since it was opened ({st.size} bytes); restart to reopen it")
    key = ["raw-index", st.path, st.size, st.version, src.dtype.name, src.eos_token_id]
    entry = cache_root() / "raw-index" / f"v1-{hashlib.sha256(json.dumps(key).encode()).hexdigest()}.npz"
    try:
        with np.load(entry) as cached:
            if json.loads(str(cached["key"])) == key:
                return cached["starts"], int(cached["max_token_id"])
    except (OSError, ValueError, KeyError):
        pass  # no entry, or an unreadable one: scan the object
    digest = hashlib.sha256()
    dtype = src.dtype.newbyteorder("<")
    ends, largest, pos = [], 0, 0
    # STREAM_BLOCK_BYTES is a multiple of 4, so no token straddles two blocks.
    for block in fileio.iter_blocks(src.path):
        digest.update(block)
        tokens = np.frombuffer(block, dtype=dtype)
        ends.append(np.flatnonzero(tokens == src.eos_token_id).astype(np.int64) + pos + 1)
        largest = max(largest, int(tokens.max()))
        pos += tokens.size
    if fileio.stat(src.path) != st:
        raise DataError(f"{src.path}: the object was replaced while it was scanned; retry once it is settled")
    starts = np.concatenate([np.zeros(1, np.int64), *ends])
    starts = starts[starts < src.num_tokens]  # the final eos ends the last document; it starts none
    _cache_sha256(["url", st.path, st.size, st.version], digest.hexdigest())
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.stem}.tmp{os.getpid()}.npz")
        np.savez(tmp, key=np.array(json.dumps(key)), starts=starts, max_token_id=np.array(largest))
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache costs a re-scan next time, nothing else
    return starts, largest


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
            # The remote shards' doc-start blocks, fetched together rather than one file after another.
            pending = [r for s in self.sources for r in getattr(s, "index_ranges", list)()]
            with fileio.staged_reads(pending):
                self._starts = np.concatenate(
                    [s.doc_starts() + off for s, off in zip(self.sources, self._bounds[:-1])]
                ).astype(np.int64)
        return self._starts

    def _parts(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(source index, first, stop) within each source that tokens [start, stop) cover."""
        first = int(np.searchsorted(self._bounds, start, side="right")) - 1
        pos = start
        for i in range(max(first, 0), len(self.sources)):
            if pos >= stop:
                break
            lo = int(self._bounds[i])
            hi = min(stop, int(self._bounds[i + 1]))
            yield i, pos - lo, hi - lo
            pos = hi

    def remote_ranges(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        """(URL, offset, length) that `read(start, stop)` fetches from object storage."""
        return [r for i, a, b in self._parts(start, stop) for r in remote_ranges(self.sources[i], [(a, b)])]

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


class PerFileWindows(ConcatSource):
    """Files windowed as OLMo-core's `NumpyFSLDataset` windows them (`windowing: olmo-core`):
    in the order given, file i holds floor(N_i / S) windows of S tokens, [k*S, (k+1)*S) of
    that file, and its tail is dropped; window w of the source is entry w of that list, so a
    window never crosses a file end. Tokens, documents and reads are those of the files
    concatenated in the given order (what the vocab and leakage checks see)."""

    def _windows_per_file(self, sequence_length: int) -> np.ndarray:
        return np.array([s.num_tokens // sequence_length for s in self.sources], np.int64)

    def num_windows(self, sequence_length: int) -> int:
        return int(self._windows_per_file(sequence_length).sum())

    def window_spans(self, within: np.ndarray, sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
        """(first token, end of its file) of each window `within`, as offsets into the source."""
        counts = self._windows_per_file(sequence_length)
        ends = np.cumsum(counts)
        file = np.searchsorted(ends, within, side="right")
        local = within - (ends[file] - counts[file])
        return self._bounds[file] + local * sequence_length, self._bounds[file + 1]


def num_windows(source: TokenSource, sequence_length: int) -> int:
    """Windows of `sequence_length` tokens in a source (its instances, olmo_data.order)."""
    if isinstance(source, PerFileWindows):
        return source.num_windows(sequence_length)
    return source.num_tokens // sequence_length


def window_spans(source: TokenSource, within: np.ndarray, sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(first token, limit) of windows `within` of a source: a window is the `sequence_length`
    tokens from its first, and the token after it (its last label) exists only below the limit:
    the source's end, or with PerFileWindows the end of the window's file."""
    within = np.asarray(within, dtype=np.int64)
    if isinstance(source, PerFileWindows):
        return source.window_spans(within, sequence_length)
    return within * sequence_length, np.full(within.shape, source.num_tokens, np.int64)


def remote_ranges(source: TokenSource, spans: Iterable[tuple[int, int]]) -> list[tuple[str, int, int]]:
    """(URL, offset, length) of the object-storage bytes that reading token spans (start, stop)
    of `source` fetches: a raw file's exact byte range, a shard's compressed chunks not in its
    cache. Nothing for local files, nor for a source type that does not say (`remote_ranges`
    is optional: what it names is only fetched ahead, `fileio.staged_reads`)."""
    plan = getattr(source, "remote_ranges", None)
    if plan is None:
        return []
    return [r for start, stop in spans for r in plan(int(start), int(stop))]


def window_ranges(source: TokenSource, within: np.ndarray, sequence_length: int) -> list[tuple[str, int, int]]:
    """`remote_ranges` of the token reads `olmo_data.order.read_instances` makes for windows
    `within`: each window and the token after it, up to its limit (`window_spans`). Should the
    two ever disagree, a read outside the staged ranges is fetched on its own: slower, the same bytes."""
    first, limit = window_spans(source, np.asarray(within, dtype=np.int64), sequence_length)
    stop = np.minimum(first + sequence_length + 1, limit)
    return remote_ranges(source, zip(first.tolist(), stop.tolist()))


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


def _sha256_entry(key: list) -> Path:
    return cache_root() / "file-sha256" / f"v1-{hashlib.sha256(json.dumps(key).encode()).hexdigest()}.json"


def _cached_sha256(key: list) -> str | None:
    try:
        cached = json.loads(_sha256_entry(key).read_text())
        if cached["key"] == key:
            return cached["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no entry, or an unreadable one: hash the file
    return None


def _cache_sha256(key: list, digest: str) -> None:
    entry = _sha256_entry(key)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "sha256": digest}))
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache costs a re-hash next time, nothing else


def _remote_sha256(url: str) -> str:
    """content_sha256 of an object. Keyed by (URL, size, version): an object is never edited
    in place, every upload makes a new generation (GCS) or ETag and modification time (S3),
    so no "racy" window applies. The stored checksums are not used as the value: GCS keeps
    an MD5 (absent for composite objects) and a CRC32C, S3 an ETag that is an MD5 only for
    single-part unencrypted uploads; none is the sha256 a local copy of the bytes gives."""
    st = fileio.stat(url)
    key = ["url", st.path, st.size, st.version]
    cached = _cached_sha256(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    for block in fileio.iter_blocks(url):
        digest.update(block)
    if fileio.stat(url) != st:
        raise DataError(f"{url}: the object was replaced while it was hashed; retry once it is settled")
    _cache_sha256(key, digest.hexdigest())
    return digest.hexdigest()


def content_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes, streamed (bounded memory), cached in
    cache_root()/file-sha256 under its (real path, size, mtime_ns, ctime_ns, inode); for an
    object (gs://, s3://) under its (URL, size, version), see `_remote_sha256`.
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
    path = fileio.normalize(path)
    if fileio.is_remote(path):
        return _remote_sha256(path)
    real = os.path.realpath(path)

    def stat_key() -> list:
        st = os.stat(real)
        return [real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    key = stat_key()
    mtime_ns = key[2]
    cached = _cached_sha256(key)
    if cached is not None:
        return cached
    started = time.time_ns()
    with open(real, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    # Cache only a file that was settled before the hash began and did not change during it.
    if started - mtime_ns >= _RACY_NS and stat_key() == key:
        _cache_sha256(key, digest)
    return digest


def resolve_paths(
    path_or_glob: str | os.PathLike | Sequence[str | os.PathLike], format: str, keep_order: bool = False
) -> list[str]:
    """Files named by paths, globs or directories, local or URLs, sorted and de-duplicated; with
    `keep_order`, in the order the items are given (each glob's or directory's matches sorted,
    as OLMo-core expands a glob) and a file named twice read twice, as OLMo-core reads it."""
    items = [path_or_glob] if isinstance(path_or_glob, (str, os.PathLike)) else list(path_or_glob)
    if not items:
        raise DataError("open_source: no paths given; list at least one file or glob")
    suffix = SHARD_SUFFIX if format == "shards" else ".npy"
    found: list[str] = []
    for item in items:
        item = fileio.normalize(item)
        if glob.has_magic(item):
            matches = fileio.glob(item)
            if not matches:
                raise DataError(f"{item}: glob matches no file; check the pattern (relative to the mixture YAML)")
            found.extend(sorted(matches))
        elif fileio.isfile(item):
            found.append(item)
        elif fileio.isdir(item):
            matches = fileio.find(item, suffix)
            if not matches:
                raise DataError(f"{item}: directory holds no *{suffix} file; point at the {format} files")
            found.extend(sorted(matches))
        else:
            raise DataError(f"{item}: file not found; check the path (relative to the mixture YAML)")
    return found if keep_order else sorted(set(found))


def open_source(
    path_or_glob: str | os.PathLike | Sequence[str | os.PathLike],
    format: Literal["shards", "numpy"] = "shards",
    dtype: Any = None,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
    windowing: Windowing = "concat",
) -> TokenSource:
    """One token source over every file named (sorted by path; a single file is returned as is).

    format "numpy" reads raw OLMo token files and needs dtype and eos_token_id; format
    "shards" reads dtype from each manifest (a given dtype must then match). With
    vocab_size, an id >= vocab_size is a DataError (free for shards: the manifest
    records the largest id; a full scan for raw files). windowing "olmo-core" (format
    numpy only) keeps the files in the order named and windows each on its own, as
    OLMo-core's NumpyFSLDataset does (`PerFileWindows`).
    """
    if format not in ("shards", "numpy"):
        raise DataError(f"open_source: format {format!r} is unknown; use 'shards' or 'numpy'")
    if windowing not in ("concat", "olmo-core"):
        raise DataError(f"open_source: windowing {windowing!r} is unknown; use 'concat' or 'olmo-core'")
    if windowing == "olmo-core" and format != "numpy":
        raise DataError(
            "open_source: windowing 'olmo-core' reproduces OLMo-core over its raw token files; use format numpy"
        )
    paths = resolve_paths(path_or_glob, format, keep_order=windowing == "olmo-core")
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
    if windowing == "olmo-core":
        return PerFileWindows(sources)
    return sources[0] if len(sources) == 1 else ConcatSource(sources)

"""Reads: exact byte ranges (`RangeReader`; on object storage ranged GETs, never a whole-object
download), ranges fetched ahead for a block of code (`staged_reads`), whole files
(`read_bytes`, `read_text`) and bounded-memory streaming (`iter_blocks`, `sha256`)."""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .clients import DEFAULT_CONCURRENT_READS, _filesystem
from .errors import StorageError
from .meta import stat
from .names import PathArg, _split, is_remote, normalize
from .translate import _errors

# Bytes per request when a whole object is streamed (hashing, the eos scan of raw token files):
# large enough that request latency is small beside the transfer, small enough to bound memory.
STREAM_BLOCK_BYTES = 16 << 20


def coalesce(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (offset, length) spans that cover `ranges` of one file, sorted, with every pair of
    ranges that overlap or touch merged into one span (so reading them costs one request per
    span, and never a byte that no range asked for). Empty ranges are dropped."""
    spans: list[list[int]] = []
    for offset, length in sorted((o, n) for o, n in ranges if n > 0):
        if spans and offset <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], offset + length)
        else:
            spans.append([offset, offset + length])
    return [(lo, hi - lo) for lo, hi in spans]


def _fetch(requests: Sequence[tuple[str, int, int]], concurrency: int) -> list[bytes | BaseException]:
    """One ranged GET per (remote URL, offset, length), at most `concurrency` in flight per
    scheme (fsspec's async ``cat_ranges``, which gathers them on its event loop). A request
    that failed gives its exception in its place (translated later, where it is read)."""
    out: list[bytes | BaseException] = [b""] * len(requests)
    by_scheme: dict[str, list[int]] = {}
    for i, (url, _, _) in enumerate(requests):
        by_scheme.setdefault(_split(url)[0], []).append(i)
    for scheme, indices in by_scheme.items():
        fs = _filesystem(scheme)
        keys = [_split(requests[i][0])[1] for i in indices]
        starts = [requests[i][1] for i in indices]
        ends = [requests[i][1] + requests[i][2] for i in indices]
        try:
            got = fs.cat_ranges(keys, starts, ends, batch_size=max(1, concurrency), on_error="return")
        except Exception as e:  # failed before any request went out (a client that cannot start)
            got = [e] * len(indices)
        for i, data in zip(indices, got):
            out[i] = data
    return out


@dataclass
class _Span:
    """Staged bytes of one file from `offset` on: the data, or the exception its GET raised
    (covering the `length` bytes asked for)."""

    offset: int
    length: int
    data: bytes | BaseException


# Per thread: a stack of {URL: spans sorted by offset}, one entry per open `staged_reads`.
_staged = threading.local()


def _staged_lookup(url: str, offset: int, length: int) -> bytes | BaseException | None:
    """The staged bytes [offset, offset + length) of `url`, the exception the GET that covered
    them raised, or None when no staged span of this thread holds the whole range."""
    for table in reversed(getattr(_staged, "stack", ())):
        spans = table.get(url)
        if not spans:
            continue
        i = bisect.bisect_right([sp.offset for sp in spans], offset) - 1
        if i < 0:
            continue
        span = spans[i]
        if isinstance(span.data, BaseException):
            if offset + length <= span.offset + span.length:
                return span.data
        else:
            end = span.offset + len(span.data)
            # A span shorter than asked ends where the file does: a read running past that end
            # gets what the file holds, as its own GET would (if it starts before the end).
            at_eof = len(span.data) < span.length and offset < end and offset + length <= span.offset + span.length
            if offset + length <= end or at_eof:
                return span.data[offset - span.offset : offset - span.offset + length]
    return None


@contextlib.contextmanager
def staged_reads(
    ranges: Iterable[tuple[PathArg, int, int]], concurrency: int = DEFAULT_CONCURRENT_READS
) -> Iterator[int]:
    """Fetch the byte ranges a block of code is about to read, all at once, before it runs.

    `ranges` are (path, offset, length); local paths are skipped (os.pread needs no help).
    The ranges of each object are coalesced (overlapping or touching ones become one span,
    `coalesce`) and all spans are requested together, `concurrency` GETs in flight at most.
    Inside the block, `RangeReader.pread` in this thread serves any range that lies inside a
    staged span from memory; anything else is read as without staging. So staging changes
    only how many requests are made and when, never what a read returns or raises: a failed
    GET is kept and raised, translated exactly as `pread` translates it (the same one-line
    StorageError naming the URL), by the read that needs those bytes, and by none other.
    Memory: the staged bytes, held until the block ends. Yields the number of GETs made.
    """
    wanted: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in ranges:
        url = normalize(path)
        if is_remote(url) and length > 0:
            wanted.setdefault(url, []).append((int(offset), int(length)))
    requests = [(url, o, n) for url, rs in wanted.items() for o, n in coalesce(rs)]
    table: dict[str, list[_Span]] = {}
    for (url, offset, length), data in zip(requests, _fetch(requests, concurrency) if requests else []):
        table.setdefault(url, []).append(_Span(offset, length, data))
    stack = _staged.__dict__.setdefault("stack", [])
    stack.append(table)
    try:
        yield len(requests)
    finally:
        # By identity (tables with equal contents compare equal); blocks nest, so it is the last.
        del stack[max(i for i, t in enumerate(stack) if t is table)]


class RangeReader:
    """Random access to one file's bytes. `pread(offset, length)` reads exactly that range:
    locally with os.pread, on object storage with one ranged GET (no read-ahead, no download of
    the rest) unless the range was fetched ahead by `staged_reads`. Opens lazily, is
    thread-safe, and pickles as its path (a worker process reopens)."""

    def __init__(self, path: PathArg) -> None:
        self.path = normalize(path)
        self._remote = is_remote(self.path)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_remote": self._remote}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        return f"RangeReader({self.path!r})"

    def _local_fd(self) -> int:
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    with _errors(self.path, "read"):
                        self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def size(self) -> int:
        if not self._remote:
            return os.fstat(self._local_fd()).st_size
        return stat(self.path).size

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0:
            raise ValueError(f"{self.path}: pread({offset}, {length}) needs offset, length >= 0")

    def _result(self, got: bytes | BaseException) -> bytes:
        """A fetched range's bytes, or its failure raised as `pread` raises it."""
        if isinstance(got, BaseException):
            fs = _filesystem(_split(self.path)[0])
            with _errors(self.path, "read", fs):
                raise got.with_traceback(None)
        return got

    def pread(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length); fewer only where the file ends before."""
        self._check(offset, length)
        if length == 0:
            return b""
        if not self._remote:
            return os.pread(self._local_fd(), length, offset)
        staged = _staged_lookup(self.path, offset, length)
        if staged is not None:
            return self._result(staged)
        scheme, key = _split(self.path)
        fs = _filesystem(scheme)
        with _errors(self.path, "read", fs):
            return fs.cat_file(key, start=offset, end=offset + length)

    def pread_many(self, ranges: Sequence[tuple[int, int]], concurrency: int = DEFAULT_CONCURRENT_READS) -> list[bytes]:
        """Several (offset, length) ranges; on object storage the GETs run concurrently (ranges
        that overlap or touch are fetched by one, `coalesce`). A failed GET raises as `pread`."""
        for offset, length in ranges:
            self._check(offset, length)
        if not self._remote or len(ranges) <= 1:
            return [self.pread(o, n) for o, n in ranges]
        with staged_reads([(self.path, o, n) for o, n in ranges], concurrency):
            return [self.pread(o, n) for o, n in ranges]


def iter_blocks(path: PathArg, block_bytes: int = STREAM_BLOCK_BYTES) -> Iterator[bytes]:
    """The file's bytes in order, `block_bytes` at a time (the last block may be shorter);
    memory stays bounded by one block. Raises StorageError if the file changes size meanwhile."""
    reader = RangeReader(path)
    total = reader.size()
    for offset in range(0, total, block_bytes):
        block = reader.pread(offset, min(block_bytes, total - offset))
        if len(block) != min(block_bytes, total - offset):
            raise StorageError(
                f"{reader.path}: got {len(block)} bytes at offset {offset} of a {total}-byte file: it changed while "
                "being read; retry once it is complete"
            )
        yield block


def read_bytes(path: PathArg) -> bytes:
    path = normalize(path)
    if not is_remote(path):
        with _errors(path, "read"):
            return Path(path).read_bytes()
    scheme, key = _split(path)
    fs = _filesystem(scheme)
    with _errors(path, "read", fs):
        return fs.cat_file(key)


def read_text(path: PathArg, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


def sha256(path: PathArg) -> str:
    """The hex sha256 of a file's bytes, read in blocks: memory stays bounded, and on object
    storage the object is streamed (`iter_blocks`), never held whole."""
    path = normalize(path)
    if not is_remote(path):
        with _errors(path, "read"), open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    digest = hashlib.sha256()
    for block in iter_blocks(path):
        digest.update(block)
    return digest.hexdigest()

"""Token sources: random access to token ids stored on disk or in object storage, whatever
the format. Every path may be local, ``file://``, ``gs://`` or ``s3://`` (`olmo_data.fileio`).

- `RawTokenFile` (in `olmo_data.raw_tokens`): an OLMo-core/Dolma token file as they write it:
  a headerless array of uint16/uint32 ids, each document followed by the eos id.
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

The fingerprint of raw files, which carry no checksums of their own, is their content
sha256 (`olmo_data.content_hash.content_sha256`).

Every source returns uint32 ids from `read(start, stop)` and the sorted start offset of
every document from `doc_starts()`. Sources hold no open handles when pickled (Grain
worker processes reopen them).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from typing import Any, Literal, Protocol, Sequence

import numpy as np

from olmo_data import fileio
from olmo_data.errors import DataError
from olmo_data.raw_tokens import RawTokenFile
from olmo_data.shards import SHARD_SUFFIX, ShardSource, ShardWriter, check_dtype

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
    "locate",
]

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

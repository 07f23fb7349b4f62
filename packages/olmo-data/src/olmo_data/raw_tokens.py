"""`RawTokenFile`: an OLMo-core/Dolma token file as they write it: a headerless array of
uint16/uint32 ids (local: np.memmap; remote: one ranged read per `read`), each document
followed by the eos id. Any path may be local, ``file://``, ``gs://`` or ``s3://``
(`olmo_data.fileio`); `olmo_data.sources` opens it among the other token sources.

A raw file carries no document index, so its documents are found by scanning every token
for eos. For a remote file that scan streams the object once (the same pass computes its
sha256) and its result, 8 bytes per document, is cached under cache_root()/raw-index keyed
by (URL, size, version, dtype, eos): every later open on the machine, by any rank or
restart, reads that small file instead of the object. No cache of token bytes is kept: the
data order visits every window once per epoch in a shuffled order, so a local cache smaller
than the data would rarely hit, and shards already keep their last decompressed chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from olmo_data import fileio
from olmo_data.content_hash import cache_root, record_object_sha256
from olmo_data.errors import DataError
from olmo_data.shards import _MAGIC, check_dtype

__all__ = ["RawTokenFile"]

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
    record_object_sha256(st, digest.hexdigest())
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.stem}.tmp{os.getpid()}.npz")
        np.savez(tmp, key=np.array(json.dumps(key)), starts=starts, max_token_id=np.array(largest))
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache costs a re-scan next time, nothing else
    return starts, largest

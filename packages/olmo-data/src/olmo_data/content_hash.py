"""The content sha256 of data files, cached on disk, and where olmo_data keeps what it
derives from data (`cache_root`).

- `content_sha256(path)`: the sha256 of a file's bytes, cached on disk by its stat or, for
  an object, its (URL, size, generation or ETag) (the fingerprint of raw files, which carry
  no checksums of their own).
- `record_object_sha256(stat, digest)`: caches the sha256 of an object that another full
  read computed on the way (the document scan of a remote raw file, `olmo_data.raw_tokens`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from olmo_data import fileio
from olmo_data.errors import DataError

__all__ = ["cache_root", "content_sha256", "record_object_sha256"]

# A file modified less than this before its hash started is hashed but not cached: a later
# write within the same file-system timestamp tick would leave its mtime unchanged (git's
# "racy clean" case); 2 s covers the coarsest timestamps (FAT) and modest clock skew.
_RACY_NS = 2_000_000_000


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


def _object_key(st: fileio.FileStat) -> list:
    """The cache key of an object's sha256 (see `_remote_sha256`)."""
    return ["url", st.path, st.size, st.version]


def record_object_sha256(st: fileio.FileStat, digest: str) -> None:
    """Cache `digest` as the content_sha256 of the object `st` describes, read whole elsewhere."""
    _cache_sha256(_object_key(st), digest)


def _remote_sha256(url: str) -> str:
    """content_sha256 of an object. Keyed by (URL, size, version): an object is never edited
    in place, every upload makes a new generation (GCS) or ETag and modification time (S3),
    so no "racy" window applies. The stored checksums are not used as the value: GCS keeps
    an MD5 (absent for composite objects) and a CRC32C, S3 an ETag that is an MD5 only for
    single-part unencrypted uploads; none is the sha256 a local copy of the bytes gives."""
    st = fileio.stat(url)
    key = _object_key(st)
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

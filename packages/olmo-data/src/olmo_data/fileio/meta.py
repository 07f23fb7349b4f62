"""Metadata: size and version (`stat`), what is there (`exists`, `isfile`, `isdir`) and listings
(`listdir`, `glob`, `find`)."""

from __future__ import annotations

import glob as _glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .clients import _filesystem
from .errors import StorageNotFoundError
from .names import PathArg, _split, is_remote, normalize
from .translate import _check_bucket, _errors


@dataclass(frozen=True)
class FileStat:
    """A file's size and a version token that changes whenever its bytes may have: local
    (mtime_ns, ctime_ns, inode); GCS the object generation; S3 the ETag and last-modified time
    (a new upload gets a new pair; an identical re-upload keeps the ETag, which is an MD5 of
    the bytes or of the parts)."""

    path: str
    size: int
    version: str


def _remote_info(url: str, op: str = "stat") -> tuple[dict[str, Any], Any]:
    scheme, key = _split(url)
    fs = _filesystem(scheme)
    with _errors(url, op, fs):
        return fs.info(key), fs


def stat(path: PathArg) -> FileStat:
    """Size and version of a file or object (a folder is a StorageNotFoundError)."""
    path = normalize(path)
    if not is_remote(path):
        with _errors(path, "stat"):
            st = os.stat(path)
        if not os.path.isfile(path):
            raise StorageNotFoundError(f"{path}: is a folder, not a file; name a file")
        return FileStat(path, st.st_size, f"{st.st_mtime_ns}-{st.st_ctime_ns}-{st.st_ino}")
    info, _ = _remote_info(path)
    if info.get("type") != "file":
        raise StorageNotFoundError(f"{path}: is a folder (a key prefix), not an object; name an object")
    if path.startswith("gs://"):
        version = f"generation {info.get('generation')}"
    else:
        version = f"etag {info.get('ETag')} modified {info.get('LastModified')}"
    return FileStat(path, int(info["size"]), version)


def size(path: PathArg) -> int:
    return stat(path).size


def _kind(path: str) -> str | None:
    """What is at `path`: "file", "directory", or None (nothing)."""
    if not is_remote(path):
        return "file" if os.path.isfile(path) else "directory" if os.path.isdir(path) else None
    try:
        info, _ = _remote_info(path)
    except StorageNotFoundError:
        return None
    return info.get("type")


def exists(path: PathArg) -> bool:
    """Whether something is there: locally anything os.path.exists sees, on object storage an
    object or a folder with something in it. A missing bucket is an error
    (BucketNotFoundError), not False; so are missing credentials."""
    path = normalize(path)
    return os.path.exists(path) if not is_remote(path) else _kind(path) is not None


def isfile(path: PathArg) -> bool:
    return _kind(normalize(path)) == "file"


def isdir(path: PathArg) -> bool:
    return _kind(normalize(path)) == "directory"


def listdir(path: PathArg) -> list[str]:
    """Sorted names of the files and folders directly inside `path`. A folder that does not
    exist (or a file) lists as empty: on object storage a folder exists only through its objects."""
    path = normalize(path)
    if not is_remote(path):
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
    scheme, key = _split(path)
    fs = _filesystem(scheme)
    try:
        with _errors(path, "list", fs):
            entries = fs.ls(key, detail=False)
    except StorageNotFoundError:
        return []
    prefix = key + "/"
    names = sorted({e.rstrip("/")[len(prefix) :] for e in entries if e.startswith(prefix) and e.rstrip("/") != key})
    if not names:
        _check_bucket(path, fs)
    return names


def glob(pattern: PathArg) -> list[str]:
    """Sorted files matching a glob (``**`` spans folders); folders are left out."""
    pattern = normalize(pattern)
    if not is_remote(pattern):
        return sorted(m for m in _glob.glob(pattern, recursive=True) if os.path.isfile(m))
    scheme, key = _split(pattern)
    fs = _filesystem(scheme)
    try:
        with _errors(pattern, "list", fs):
            found = fs.glob(key, detail=True)
    except StorageNotFoundError:
        return []
    files = sorted(f"{scheme}://{name}" for name, info in found.items() if info.get("type") == "file")
    if not files:
        _check_bucket(pattern, fs)
    return files


def find(path: PathArg, suffix: str = "") -> list[str]:
    """Sorted files anywhere below the folder `path` whose names end with `suffix`."""
    path = normalize(path)
    if not is_remote(path):
        return sorted(str(p) for p in Path(path).rglob(f"*{suffix}") if p.is_file())
    scheme, key = _split(path)
    fs = _filesystem(scheme)
    try:
        with _errors(path, "list", fs):
            found = fs.find(key)
    except StorageNotFoundError:
        return []
    files = sorted(f"{scheme}://{name}" for name in found if name.endswith(suffix))
    if not files:
        _check_bucket(path, fs)
    return files

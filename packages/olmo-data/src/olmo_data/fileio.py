"""Paths are URLs (docs/design.md, contract 8): one storage layer for everything olmo names by
path, be it a local path, a ``file://`` URL, ``gs://bucket/key`` or ``s3://bucket/key``.

Local paths go straight to the OS (``os.pread``, ``os.replace``); URLs go through fsspec
(gcsfs, s3fs: the olmo-data extras ``gcs`` and ``s3``). The functions take and return plain
strings (a ``file://`` URL comes back as its local path), so a caller needs no branch of its own:

- names: `is_remote`, `normalize`, `join`, `dirname`, `relpath`;
- metadata: `stat` (size and a version token that changes with the bytes), `size`, `exists`,
  `isfile`, `isdir`, `listdir`, `glob`, `find`;
- reads: `RangeReader` (`pread` of exactly one byte range, `pread_many` of several at once:
  on object storage ranged GETs, never a whole-object download), `staged_reads` (fetch the
  ranges a block of code will read, coalesced and concurrently, before it runs: how the loader
  reads a batch's windows), `read_bytes`, `read_text`, `iter_blocks` (bounded-memory streaming);
- writes, atomic: `write_bytes`, `write_text`, `AtomicWriter` / `open_write`, `put_file`. A
  local file is written to a temp file beside it and renamed into place; an object is uploaded
  from a local temp file when the writer commits, by one PUT (or a multipart / resumable upload
  for large files, which the store also publishes only once complete), so a reader never sees a
  partial object and a failed write leaves the old object (or none);
- `delete` (a file, or a whole folder with ``recursive=True``), `makedirs` (a no-op on object
  storage, where folders exist only through the objects in them).

Credentials and endpoints come only from where the clients themselves look:

- ``s3://``: botocore's chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ~/.aws, an instance or container role),
  ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for another endpoint (R2, MinIO, Weka, an
  emulator), ``AWS_DEFAULT_REGION``, ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` for retries;
- ``gs://``: Google Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``,
  ``gcloud auth application-default login``, the metadata server on GCP).
  ``STORAGE_EMULATOR_HOST`` points at an emulator and then, as in google-cloud-storage,
  means anonymous access (an emulator checks no credentials, and looking for them would
  probe the GCP metadata server).

A client is made once per process and environment: changing one of those variables (a test
that unsets the credentials, a fork) gets a new one. Every failure of a storage call is a
`StorageError` (a `DataError`, which the CLIs print as one line) naming the path and the fix;
the kinds also derive from the matching builtin (FileNotFoundError, PermissionError,
ConnectionError), so code written for local files catches them unchanged.
"""

from __future__ import annotations

import bisect
import contextlib
import glob as _glob
import os
import posixpath
import re
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from olmo_data.errors import DataError

__all__ = [
    "StorageError",
    "StorageNotFoundError",
    "BucketNotFoundError",
    "StorageCredentialsError",
    "StoragePermissionError",
    "StorageNetworkError",
    "FileStat",
    "RangeReader",
    "staged_reads",
    "coalesce",
    "DEFAULT_CONCURRENT_READS",
    "AtomicWriter",
    "is_remote",
    "normalize",
    "join",
    "dirname",
    "relpath",
    "stat",
    "size",
    "exists",
    "isfile",
    "isdir",
    "listdir",
    "glob",
    "find",
    "read_bytes",
    "read_text",
    "iter_blocks",
    "write_bytes",
    "write_text",
    "open_write",
    "put_file",
    "delete",
    "makedirs",
    "filesystem",
    "storage_error",
]

REMOTE_SCHEMES = ("gs", "s3")
# Bytes per request when a whole object is streamed (hashing, the eos scan of raw token files):
# large enough that request latency is small beside the transfer, small enough to bound memory.
STREAM_BLOCK_BYTES = 16 << 20
# Ranged GETs one `staged_reads` (one batch of a loader thread) keeps in flight at most: enough
# to cover a rank's windows of a batch in one or two round trips, few enough not to swamp a
# store or a small host's event loop with connections.
DEFAULT_CONCURRENT_READS = 32
# HTTP connections a client keeps open to its endpoint (S3; gcsfs's aiohttp allows 100):
# two loader threads' worth of DEFAULT_CONCURRENT_READS.
MAX_CONNECTIONS = 2 * DEFAULT_CONCURRENT_READS


class StorageError(DataError):
    """A storage call failed; the message names the path and the fix."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """No file or object under that name (its bucket exists)."""


class BucketNotFoundError(StorageError):
    """The bucket of a URL does not exist. Not a FileNotFoundError on purpose: code that treats
    a missing file as "nothing there yet" (no checkpoint, start fresh) must not take a bucket
    typo for an empty folder."""


class StorageCredentialsError(StorageError):
    """No credentials found, or the store rejected them as invalid or expired."""


class StoragePermissionError(StorageError, PermissionError):
    """Valid credentials that lack the permission for this operation."""


class StorageNetworkError(StorageError, ConnectionError):
    """The store could not be reached (connection refused or reset, DNS, timeout)."""


# ---- names ------------------------------------------------------------------------------------


def _scheme(path: str) -> str | None:
    head, sep, _ = path.partition("://")
    # A scheme is letters first (RFC 3986); "C:\\x" or "a/b://c" are local names.
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        return None
    return head.lower()


def normalize(path: str | os.PathLike) -> str:
    """The one spelling of a path: ``file://`` URLs become local paths, ``gs://`` / ``s3://``
    URLs are checked (a bucket is named, the scheme is one we serve); local paths are returned
    as given (relative ones stay relative)."""
    text = os.fspath(path)
    scheme = _scheme(text)
    if scheme is None:
        return text
    if scheme == "file":
        parsed = urllib.parse.urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"{text}: a file:// URL cannot name host {parsed.netloc!r}; write file:///absolute/path")
        return urllib.parse.unquote(parsed.path)
    if scheme not in REMOTE_SCHEMES:
        raise StorageError(
            f"{text}: URL scheme {scheme}:// is not supported; use a local path, file://, gs:// or s3://"
        )
    rest = text.split("://", 1)[1]
    if not rest.split("/", 1)[0]:
        raise StorageError(f"{text}: the URL names no bucket; write {scheme}://BUCKET/PATH")
    return f"{scheme}://{rest}"


def is_remote(path: str | os.PathLike) -> bool:
    """True for ``gs://`` and ``s3://`` URLs (``file://`` URLs are local paths)."""
    return _scheme(os.fspath(path)) in REMOTE_SCHEMES


def _split(url: str) -> tuple[str, str]:
    """(scheme, "bucket/key") of a normalized remote URL: the form fsspec takes."""
    scheme, rest = url.split("://", 1)
    return scheme, rest.rstrip("/")


def _bucket(url: str) -> str:
    return _split(url)[1].split("/", 1)[0]


def join(base: str | os.PathLike, *parts: str | os.PathLike) -> str:
    """`base` / parts. A part that is a URL or an absolute path replaces what is before it, as
    in os.path.join; on a URL ``..`` is resolved (object keys have no real parent folders)."""
    out = normalize(base)
    for part in map(normalize, parts):
        if is_remote(part) or os.path.isabs(part):
            out = part
        elif is_remote(out):
            scheme, rest = _split(out)
            joined = posixpath.normpath(posixpath.join(rest, part))
            if joined.split("/", 1)[0] != rest.split("/", 1)[0]:
                raise StorageError(f"{out} + {part}: the path leaves bucket {_bucket(out)!r}; use a full URL instead")
            out = f"{scheme}://{joined}"
        else:
            # pathlib's join, as the mixture loader has always used for local paths.
            out = str(Path(out) / part)
    return out


def dirname(path: str | os.PathLike) -> str:
    """The folder holding `path` (a bucket's root for a top-level object)."""
    path = normalize(path)
    if not is_remote(path):
        return str(Path(path).parent)
    scheme, rest = _split(path)
    return f"{scheme}://{posixpath.dirname(rest) or rest}"


def relpath(path: str | os.PathLike, root: str | os.PathLike) -> str:
    """`path` relative to the folder `root` when both are local or both lie in one bucket;
    otherwise `path` itself (a name that cannot be made relative stays absolute)."""
    path, root = normalize(path), normalize(root)
    if not is_remote(path) and not is_remote(root):
        return os.path.relpath(path, root)
    if is_remote(path) and is_remote(root):
        (s1, p1), (s2, p2) = _split(path), _split(root)
        if s1 == s2 and p1.split("/", 1)[0] == p2.split("/", 1)[0]:
            return posixpath.relpath(p1, p2)
    return path


# ---- clients and errors -----------------------------------------------------------------------

# The variables the cloud clients read. A client is cached per value of all of them, so a
# changed credential, endpoint or retry setting takes effect on the next call.
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "CLOUDSDK_", "GCE_", "STORAGE_EMULATOR_HOST", "NO_GCE_CHECK")
_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()
_EXTRAS = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs")}


def _filesystem(scheme: str) -> Any:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    # The pid: a forked child must not reuse its parent's HTTP sessions.
    key = (scheme, os.getpid(), env)
    with _clients_lock:
        fs = _clients.get(key)
        if fs is not None:
            return fs
        module, extra = _EXTRAS[scheme]
        try:
            if scheme == "s3":
                import s3fs

                # botocore's connection pool holds 10 by default: fewer than the ranged GETs
                # `staged_reads` keeps in flight for two loader threads.
                fs = s3fs.S3FileSystem(
                    skip_instance_cache=True,
                    use_listings_cache=False,
                    config_kwargs={"max_pool_connections": MAX_CONNECTIONS},
                )
            else:
                import gcsfs
                import gcsfs.core

                if os.environ.get("STORAGE_EMULATOR_HOST"):
                    # The plain client, anonymous: gcsfs's default class asks the storage-control
                    # API for each bucket's layout, which no emulator serves.
                    fs = gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True, use_listings_cache=False)
                else:
                    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, use_listings_cache=False)
        except ImportError:
            raise StorageError(
                f"{scheme}:// paths need {module}; install the olmo-data extra: pip install 'olmo-data[{extra}]' "
                f"(uv sync --extra {extra})"
            ) from None
        # Clients of an older environment or process are dropped: at most one is live per scheme.
        for old in [k for k in _clients if k[0] == scheme]:
            del _clients[old]
        _clients[key] = fs
        return fs


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and everything it was raised from (s3fs re-raises botocore's errors)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


# Matched by class name (across each class's bases) so that neither botocore nor gcsfs nor
# aiohttp need be installed to import this module.
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
_GOOGLE_AUTH = {"DefaultCredentialsError", "RefreshError"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403", "Forbidden"}
_NETWORK = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectionError",  # aiohttp: refused, reset, server disconnected
    "ServerTimeoutError",
    "FSTimeoutError",
    "ConnectionError",  # the builtin (refused, reset) and requests'
    "TimeoutError",
}
_PERMISSION = {
    ("s3", "read"): "s3:GetObject",
    ("s3", "stat"): "s3:GetObject",
    ("s3", "list"): "s3:ListBucket",
    ("s3", "write"): "s3:PutObject",
    ("s3", "delete"): "s3:DeleteObject",
    ("gs", "read"): "storage.objects.get",
    ("gs", "stat"): "storage.objects.get",
    ("gs", "list"): "storage.objects.list",
    ("gs", "write"): "storage.objects.create",
    ("gs", "delete"): "storage.objects.delete",
}


def _endpoint(scheme: str, fs: Any) -> str:
    if scheme == "s3":
        client = getattr(fs, "s3", None)  # set once s3fs has connected
        url = getattr(getattr(client, "meta", None), "endpoint_url", None)
        url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return f"the S3 endpoint {url}" if url else "the S3 endpoint"
    location = getattr(fs, "_location", None) or os.environ.get("STORAGE_EMULATOR_HOST")
    return f"the GCS endpoint {location}" if location else "the GCS endpoint"


def _bucket_missing(scheme: str, fs: Any, bucket: str) -> bool:
    """Whether the bucket is known not to exist (False when it exists or cannot be told)."""
    try:
        if scheme == "s3":
            fs.call_s3("head_bucket", Bucket=bucket)
        else:
            fs.call("GET", "b/{}", bucket, json_out=True)
    except FileNotFoundError:
        return True
    except Exception:  # no right to read bucket metadata, a network error: cannot tell
        return False
    return False


def _s3_rejection(fs: Any, bucket: str) -> str | None:
    """The error code if S3 rejects these credentials outright. A HEAD answers a bare 403 for
    unknown keys and for missing permissions alike; a one-key listing carries the reason."""
    try:
        fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    except Exception as e:  # the listing itself may be denied: then nothing is learnt
        for c in _chain(e):
            response = getattr(c, "response", None)
            code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
            if code in _BAD_CREDENTIALS:
                return code
    return None


def _no_bucket(url: str, fs: Any) -> BucketNotFoundError:
    scheme = url.split("://", 1)[0]
    knob = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
    return BucketNotFoundError(
        f"{url}: bucket {_bucket(url)!r} does not exist at {_endpoint(scheme, fs)}; check the bucket name "
        f"(and {knob} if set)"
    )


def _check_bucket(url: str, fs: Any) -> None:
    """Raise BucketNotFoundError if the bucket of `url` does not exist. For listings that came
    back empty: the clients list a missing bucket as an empty one."""
    if _bucket_missing(url.split("://", 1)[0], fs, _bucket(url)):
        raise _no_bucket(url, fs)


def _translate(exc: BaseException, url: str, op: str, fs: Any) -> StorageError | None:
    """The StorageError for a client or OS exception, or None for one that is not a storage
    failure (a bug: it propagates unchanged)."""
    if isinstance(exc, StorageError):
        return exc
    chain = _chain(exc)
    names = {c.__name__ for e in chain for c in type(e).__mro__}
    codes = set()
    for e in chain:
        response = getattr(e, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            codes.add(str(response["Error"].get("Code")))
        code = getattr(e, "code", None)  # gcsfs HttpError
        if isinstance(code, int):
            codes.add(str(code))
    # The root cause says most ("[Errno 111] Connect call failed ..."); its wrappers repeat it.
    said = [e for e in chain if str(e).strip()]
    text = str(said[-1]).splitlines()[0][:200] if said else type(exc).__name__
    if not is_remote(url):
        if isinstance(exc, FileNotFoundError):
            return StorageNotFoundError(f"{url}: no such file; check the path")
        if isinstance(exc, PermissionError):
            return StoragePermissionError(f"{url}: permission denied ({op}); fix the file's permissions or the path")
        if isinstance(exc, IsADirectoryError):
            return StorageError(f"{url}: is a folder, not a file; name a file inside it")
        return None
    scheme, bucket = url.split("://", 1)[0], _bucket(url)
    if scheme == "s3" and (names & _NO_CREDENTIALS):
        return StorageCredentialsError(
            f"{url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE, or run where an instance or container role provides them)"
        )
    rejected = codes & _BAD_CREDENTIALS
    if scheme == "s3" and not rejected and "403" in codes:
        rejected = {code} if (code := _s3_rejection(fs, bucket)) else set()
    if scheme == "s3" and rejected:
        return StorageCredentialsError(
            f"{url}: {_endpoint(scheme, fs)} rejected the credentials ({', '.join(sorted(rejected))}); "
            "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (or AWS_PROFILE) and AWS_ENDPOINT_URL"
        )
    anonymous = scheme == "gs" and getattr(getattr(fs, "credentials", None), "credentials", object()) is None
    forbidden = bool(codes & _DENIED) or isinstance(exc, PermissionError) or str(exc).startswith("Forbidden")
    if scheme == "gs" and (
        names & _GOOGLE_AUTH
        or "401" in codes
        or (forbidden and anonymous and not os.environ.get("STORAGE_EMULATOR_HOST"))
    ):
        return StorageCredentialsError(
            f"{url}: no usable Google Cloud credentials ({text}); run `gcloud auth application-default login` "
            "or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file"
        )
    if "NoSuchBucket" in codes:
        return _no_bucket(url, fs)
    if forbidden:
        permission = _PERMISSION.get((scheme, op), "access")
        # S3 answers 403, not 404, for a missing key to a caller who may not list the bucket.
        missing = scheme == "s3" and op in ("read", "stat")
        hint = " (or the object does not exist and s3:ListBucket is not granted)" if missing else ""
        return StoragePermissionError(
            f"{url}: permission denied ({op}){hint}; grant the credentials in use {permission} on bucket "
            f"{bucket!r}, or use credentials that have it"
        )
    if isinstance(exc, FileNotFoundError) or codes & {"NoSuchKey", "404", "NotFound"}:
        if _bucket_missing(scheme, fs, bucket):
            return _no_bucket(url, fs)
        return StorageNotFoundError(f"{url}: no such object; check the path")
    if names & _NETWORK or isinstance(exc, (ConnectionError, TimeoutError)):
        knob = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
        return StorageNetworkError(
            f"{url}: cannot reach {_endpoint(scheme, fs)} ({text}); check the network (and {knob} if set), then retry"
        )
    return None


@contextlib.contextmanager
def _errors(url: str, op: str, fs: Any = None) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        err = _translate(e, url, op, fs)
        if err is None or err is e:
            raise
        raise err from None


# ---- metadata ---------------------------------------------------------------------------------


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


def stat(path: str | os.PathLike) -> FileStat:
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


def size(path: str | os.PathLike) -> int:
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


def exists(path: str | os.PathLike) -> bool:
    """Whether a file, or a folder with something in it, is there. A missing bucket is an
    error (BucketNotFoundError), not False; so are missing credentials."""
    return _kind(normalize(path)) is not None


def isfile(path: str | os.PathLike) -> bool:
    return _kind(normalize(path)) == "file"


def isdir(path: str | os.PathLike) -> bool:
    return _kind(normalize(path)) == "directory"


def listdir(path: str | os.PathLike) -> list[str]:
    """Sorted names of the files and folders directly inside `path`. A folder that does not
    exist lists as empty: on object storage a folder exists only through its objects."""
    path = normalize(path)
    if not is_remote(path):
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
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


def glob(pattern: str | os.PathLike) -> list[str]:
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


def find(path: str | os.PathLike, suffix: str = "") -> list[str]:
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


# ---- reads ------------------------------------------------------------------------------------


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
    ranges: Iterable[tuple[str | os.PathLike, int, int]], concurrency: int = DEFAULT_CONCURRENT_READS
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

    def __init__(self, path: str | os.PathLike) -> None:
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


def iter_blocks(path: str | os.PathLike, block_bytes: int = STREAM_BLOCK_BYTES) -> Iterator[bytes]:
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


def read_bytes(path: str | os.PathLike) -> bytes:
    path = normalize(path)
    if not is_remote(path):
        with _errors(path, "read"):
            return Path(path).read_bytes()
    scheme, key = _split(path)
    fs = _filesystem(scheme)
    with _errors(path, "read", fs):
        return fs.cat_file(key)


def read_text(path: str | os.PathLike, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


# ---- writes -----------------------------------------------------------------------------------


class AtomicWriter:
    """A binary file that appears under `path` only on `commit()`, complete; `abort()` (or an
    exception inside ``with``) leaves whatever was there before.

    Locally it is a temp file beside `path`, fsynced and renamed into place. For a URL it is a
    local temp file (in TMPDIR) uploaded on commit: object stores publish an object only once
    its upload completes, so no reader sees part of one; the cost is local disk for the file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = normalize(path)
        self._remote = is_remote(self.path)
        if self._remote:
            fd, self._tmp = tempfile.mkstemp(prefix=".olmo-upload-", suffix=".tmp")
        else:
            folder = os.path.dirname(os.path.abspath(self.path))
            with _errors(self.path, "write"):
                os.makedirs(folder, exist_ok=True)
                fd, self._tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(self.path)}.", suffix=".tmp")
        self.file: IO[bytes] = os.fdopen(fd, "wb")
        self._done = False

    def commit(self) -> str:
        """Publish the file under `path` (returns it)."""
        if self._done:
            raise RuntimeError(f"AtomicWriter({self.path}) is already committed or aborted")
        self._done = True
        try:
            self.file.flush()
            if not self._remote:
                os.fsync(self.file.fileno())  # the rename must not outrun the data on a crash
            self.file.close()
            if self._remote:
                scheme, key = _split(self.path)
                fs = _filesystem(scheme)
                with _errors(self.path, "write", fs):
                    fs.put_file(self._tmp, key)
            else:
                with _errors(self.path, "write"):
                    os.replace(self._tmp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
        return self.path

    def abort(self) -> None:
        """Drop what was written; `path` is left as it was."""
        if not self._done:
            self._done = True
            self.file.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


@contextlib.contextmanager
def open_write(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """``with open_write(p) as f: f.write(...)``: `p` appears, complete, only if the block ends
    without an exception (see AtomicWriter)."""
    with AtomicWriter(path) as writer:
        yield writer.file


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (a single PUT on object storage)."""
    path = normalize(path)
    if not is_remote(path):
        with open_write(path) as f:
            f.write(data)
        return
    scheme, key = _split(path)
    fs = _filesystem(scheme)
    with _errors(path, "write", fs):
        fs.pipe_file(key, data)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    write_bytes(path, text.encode(encoding))


def put_file(local_path: str | os.PathLike, path: str | os.PathLike) -> None:
    """Copy the local file `local_path` to `path` (local or a URL), atomically."""
    local_path, path = normalize(local_path), normalize(path)
    if is_remote(local_path):
        raise StorageError(f"put_file({local_path}): the source must be a local file; download it first")
    if not is_remote(path):
        with open_write(path) as out, open(local_path, "rb") as src:
            shutil.copyfileobj(src, out)
        return
    scheme, key = _split(path)
    fs = _filesystem(scheme)
    with _errors(path, "write", fs):
        fs.put_file(local_path, key)


def delete(path: str | os.PathLike, recursive: bool = False) -> None:
    """Remove a file or object; with recursive=True also a folder and everything below it
    (every object under the prefix). Nothing there is not an error (as S3's DELETE), a missing
    bucket is."""
    path = normalize(path)
    try:
        if not is_remote(path):
            with _errors(path, "delete"):
                if recursive and os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            return
        scheme, key = _split(path)
        fs = _filesystem(scheme)
        with _errors(path, "delete", fs):
            fs.rm(key, recursive=recursive)
    except StorageNotFoundError:
        pass


def makedirs(path: str | os.PathLike) -> None:
    """Create a local folder and its parents; nothing to do on object storage."""
    path = normalize(path)
    if not is_remote(path):
        with _errors(path, "write"):
            os.makedirs(path, exist_ok=True)


# ---- for code that drives fsspec itself (torch DCP's fsspec writer, Orbax) --------------------


def filesystem(url: str | os.PathLike) -> tuple[Any, str]:
    """(fsspec filesystem, "bucket/key") for a gs:// or s3:// URL: the same client, endpoint and
    credentials as every other call here (with ``STORAGE_EMULATOR_HOST`` the plain anonymous
    GCS client), for a library that takes an fsspec filesystem."""
    url = normalize(url)
    if not is_remote(url):
        raise StorageError(f"filesystem({url}): not a gs:// or s3:// URL")
    scheme, key = _split(url)
    return _filesystem(scheme), key


def storage_error(exc: BaseException, path: str | os.PathLike, op: str) -> StorageError | None:
    """The one-line StorageError for an exception a storage library raised while it worked on
    `path` (``op``: read, write, list, delete, stat), or None if it is no storage failure. For
    errors from code that calls the clients itself (a checkpoint library) and may wrap them."""
    path = normalize(path)
    fs = _filesystem(_split(path)[0]) if is_remote(path) else None
    for cause in _chain(exc):
        err = _translate(cause, path, op, fs)
        if err is not None:
            return err
    return None

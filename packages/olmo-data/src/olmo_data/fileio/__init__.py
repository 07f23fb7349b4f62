"""Paths are URLs (docs/design.md, contract 8): the one I/O layer for everything olmo names by
path, be it a local path, a ``file://`` URL, ``gs://bucket/key`` or ``s3://bucket/key``. Every
package calls it directly (the data loader, the run dir, the trainers' checkpoints, the tools);
nothing is registered at import.

Local paths go straight to the OS (``os.pread``, ``os.replace``); URLs go through fsspec
(gcsfs, s3fs: the olmo-data extras ``gcs`` and ``s3``). The functions take a string, an
``os.PathLike`` or a `URLPath` and return plain strings (a ``file://`` URL comes back as its
local path), so a caller needs no branch of its own:

- names (``names``): `URLPath`, `is_remote`, `normalize`, `join`, `dirname`, `relpath`;
- metadata (``meta``): `stat` (size and a version token that changes with the bytes), `size`,
  `exists`, `isfile`, `isdir`, `listdir`, `glob`, `find`;
- reads (``reads``): `RangeReader` (`pread` of exactly one byte range, `pread_many` of several
  at once: on object storage ranged GETs, never a whole-object download), `staged_reads` (fetch
  the ranges a block of code will read, coalesced and concurrently, before it runs: how the
  loader reads a batch's windows), `read_bytes`, `read_text`, `iter_blocks` and `sha256`
  (bounded-memory streaming);
- writes, atomic (``writes``): `write_bytes`, `write_text`, `AtomicWriter` / `open_write`,
  `put_file`. A local file is written to a temp file beside it (``.NAME.tmp-PID-RANDOM``) and
  renamed into place; an object is uploaded from a local temp file when the writer commits, by
  one PUT (or a multipart / resumable upload for large files, which the store also publishes
  only once complete), so a reader never sees a partial object and a failed write leaves the
  old object (or none);
- `delete` (a file, or a whole folder with ``recursive=True``), `makedirs` (a no-op on object
  storage, where folders exist only through the objects in them);
- for code that drives fsspec itself (torch DCP's fsspec writer, Orbax): `filesystem`, and
  `storage_error` for the errors it raises.

Credentials and endpoints come only from where the clients themselves look (``clients``):

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
`StorageError` (a `DataError`, which the CLIs print as one line) naming the path and the fix
(``translate``); the kinds also derive from the matching builtin (FileNotFoundError,
PermissionError, ConnectionError), so code written for local files catches them unchanged.
"""

from .clients import DEFAULT_CONCURRENT_READS, filesystem
from .errors import (
    BucketNotFoundError,
    StorageCredentialsError,
    StorageError,
    StorageNetworkError,
    StorageNotFoundError,
    StoragePermissionError,
)
from .meta import FileStat, exists, find, glob, isdir, isfile, listdir, size, stat
from .names import REMOTE_SCHEMES, PathArg, URLPath, dirname, is_remote, join, normalize, relpath
from .reads import RangeReader, coalesce, iter_blocks, read_bytes, read_text, sha256, staged_reads
from .translate import storage_error
from .writes import AtomicWriter, delete, makedirs, open_write, put_file, write_bytes, write_text

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
    "REMOTE_SCHEMES",
    "PathArg",
    "URLPath",
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
    "sha256",
    "write_bytes",
    "write_text",
    "open_write",
    "put_file",
    "delete",
    "makedirs",
    "filesystem",
    "storage_error",
]

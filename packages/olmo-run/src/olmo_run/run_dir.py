"""Run dirs on object storage: the URL backend of ``olmo_run.storage``, over ``olmo_data.fileio``.

olmo-model's run-log code (``olmo_run.runlog``: the run dir, checkpoint listing, commit,
verification, pruning, clean-up, resume, metrics) names paths as ``Path`` or
``storage.URLPath`` and leaves the file operations to a backend; importing this module (which
``olmo_run`` does) serves ``gs://`` and ``s3://`` with fileio, so both trainers, olmo-convert
and the driver share one implementation for local and remote run dirs.

What it means on object storage:

- writes are whole objects (one PUT, or a multipart / resumable upload the store publishes
  only once complete): meta.json, written last, commits a checkpoint without a rename;
- deletes go object by object below a prefix (keep-N pruning, clean-up of interrupted saves);
- sha256 of a checkpoint's files streams each object (``fileio.iter_blocks``), never whole;
- every failure is a one-line ``fileio.StorageError`` naming the URL and the fix (missing
  credentials, unknown bucket, permission, network).

Credentials and endpoints come from where the clients look (fileio's docstring): for S3 the
``AWS_*`` variables (``AWS_ENDPOINT_URL`` for another endpoint), for GCS Application Default
Credentials, or ``STORAGE_EMULATOR_HOST`` for an emulator.
"""

from __future__ import annotations

import hashlib

from olmo_data import fileio
from olmo_run import storage
from olmo_run.storage import RunPath, URLPath, is_url, run_path

__all__ = ["FileioBackend", "RunPath", "URLPath", "check_reachable", "is_url", "run_path", "storage_error"]


class FileioBackend:
    """``olmo_run.storage.Backend`` for gs:// and s3:// URLs."""

    def exists(self, path: str) -> bool:
        return fileio.exists(path)

    def isfile(self, path: str) -> bool:
        return fileio.isfile(path)

    def isdir(self, path: str) -> bool:
        return fileio.isdir(path)

    def listdir(self, path: str) -> list[str]:
        return fileio.listdir(path)

    def find(self, path: str) -> list[str]:
        return fileio.find(path)

    def size(self, path: str) -> int:
        return fileio.size(path)

    def read_bytes(self, path: str) -> bytes:
        return fileio.read_bytes(path)

    def write_text(self, path: str, text: str) -> None:
        fileio.write_text(path, text)

    def delete(self, path: str, recursive: bool = False) -> None:
        fileio.delete(path, recursive=recursive)

    def makedirs(self, path: str) -> None:
        fileio.makedirs(path)

    def sha256(self, path: str) -> str:
        digest = hashlib.sha256()
        for block in fileio.iter_blocks(path):
            digest.update(block)
        return digest.hexdigest()

    def upload(self, local_path: str, path: str) -> None:
        fileio.put_file(local_path, path)


storage.register_url_backend(FileioBackend())


def storage_error(exc: BaseException, path: RunPath, op: str) -> fileio.StorageError | None:
    """fileio's one-line error for a failure a checkpoint library hit on ``path`` (None when it
    is not a storage failure)."""
    return fileio.storage_error(exc, str(path), op)


def check_reachable(run_dir: RunPath) -> None:
    """For a URL run dir, one listing of it: a missing bucket, missing or rejected credentials,
    a denied listing or an unreachable endpoint is a one-line StorageError now, before the
    slower start-up checks, not at the first checkpoint. A local run dir has nothing to probe."""
    if isinstance(run_dir, URLPath):
        fileio.listdir(str(run_dir))

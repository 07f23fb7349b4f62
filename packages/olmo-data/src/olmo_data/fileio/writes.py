"""Writes, atomic: a file or object appears complete or not at all (`AtomicWriter`, `open_write`,
`write_bytes`, `write_text`, `put_file`); `delete` and `makedirs`."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

from .clients import _filesystem
from .errors import StorageError, StorageNotFoundError
from .names import PathArg, _split, is_remote, normalize
from .translate import _errors


class AtomicWriter:
    """A binary file that appears under `path` only on `commit()`, complete; `abort()` (or an
    exception inside ``with``) leaves whatever was there before.

    Locally it is a temp file beside `path` (``.NAME.tmp-PID-RANDOM``), fsynced and renamed
    into place. For a URL it is a local temp file (in TMPDIR) uploaded on commit: object stores
    publish an object only once its upload completes, so no reader sees part of one; the cost
    is local disk for the file.
    """

    def __init__(self, path: PathArg) -> None:
        self.path = normalize(path)
        self._remote = is_remote(self.path)
        if self._remote:
            fd, self._tmp = tempfile.mkstemp(prefix=".olmo-upload-", suffix=".tmp")
        else:
            folder = os.path.dirname(os.path.abspath(self.path))
            with _errors(self.path, "write"):
                os.makedirs(folder, exist_ok=True)
                # .NAME.tmp-PID-RANDOM: the PID tells a clean-up whether its writer still lives.
                prefix = f".{os.path.basename(self.path)}.tmp-{os.getpid()}-"
                fd, self._tmp = tempfile.mkstemp(dir=folder, prefix=prefix)
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
def open_write(path: PathArg) -> Iterator[IO[bytes]]:
    """``with open_write(p) as f: f.write(...)``: `p` appears, complete, only if the block ends
    without an exception (see AtomicWriter)."""
    with AtomicWriter(path) as writer:
        yield writer.file


def write_bytes(path: PathArg, data: bytes) -> None:
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


def write_text(path: PathArg, text: str, encoding: str = "utf-8") -> None:
    write_bytes(path, text.encode(encoding))


def put_file(local_path: PathArg, path: PathArg) -> None:
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


def delete(path: PathArg, recursive: bool = False) -> None:
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


def makedirs(path: PathArg) -> None:
    """Create a local folder and its parents; nothing to do on object storage."""
    path = normalize(path)
    if not is_remote(path):
        with _errors(path, "write"):
            os.makedirs(path, exist_ok=True)

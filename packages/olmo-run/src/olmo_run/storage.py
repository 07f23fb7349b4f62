"""Run-dir paths that may be URLs (docs/design.md, contract 8), for the run-log code in this package.

olmo-model depends on no storage client, so the run-dir helpers (``olmo_run.checkpoints``, ``olmo_run.metrics``,
``olmo_run.init_source``) do their file operations through a small backend chosen per path:

- a local path (a ``Path``, or a string without a scheme, or ``file://``) goes to the local
  backend below (os and pathlib; atomic writes are a temp file renamed into place);
- a ``gs://`` or ``s3://`` URL is a `URLPath` and goes to the URL backend that ``olmo_run``
  registers on import (``olmo_run.run_dir``, over ``olmo_data.fileio``). Without it a URL is
  a one-line error naming what to install, never a local folder named ``gs:``.

`run_path` turns a recipe's string into one of the two. A `URLPath` offers only the name
operations the run-log code uses (``/``, ``name``, ``parent``, ``str``); it has no
``__fspath__`` on purpose, so ``open(url_path)`` cannot silently create a local file.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

URL_SCHEMES = ("gs", "s3")


class StorageBackendError(RuntimeError):
    """A URL was named but no URL backend is registered (olmo_run not imported)."""


@dataclass(frozen=True, order=True)
class URLPath:
    """A ``gs://bucket/key`` or ``s3://bucket/key`` name (no trailing slash)."""

    url: str

    def __post_init__(self) -> None:
        scheme, sep, rest = self.url.partition("://")
        if not sep or scheme not in URL_SCHEMES or not rest.split("/", 1)[0]:
            raise ValueError(f"{self.url}: not a gs://BUCKET/PATH or s3://BUCKET/PATH URL")
        object.__setattr__(self, "url", f"{scheme}://{rest.strip('/')}")

    def __truediv__(self, part: str) -> URLPath:
        part = str(part).strip("/")
        return URLPath(f"{self.url}/{part}") if part else self

    def __str__(self) -> str:
        return self.url

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0]

    @property
    def bucket(self) -> str:
        return self.url.split("://", 1)[1].split("/", 1)[0]

    @property
    def key(self) -> str:
        """The object key (or prefix) inside the bucket; "" for the bucket itself."""
        rest = self.url.split("://", 1)[1]
        return rest.split("/", 1)[1] if "/" in rest else ""

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1] if self.key else ""

    @property
    def parent(self) -> URLPath:
        return URLPath(self.url.rsplit("/", 1)[0]) if self.key else self

    def relative(self, root: URLPath) -> str:
        """This URL's key relative to the folder ``root`` (which must contain it)."""
        prefix = root.url + "/"
        if not self.url.startswith(prefix):
            raise ValueError(f"{self.url} is not inside {root.url}")
        return self.url[len(prefix) :]


RunPath = Path | URLPath


def is_url(text: str | os.PathLike | URLPath) -> bool:
    if isinstance(text, URLPath):
        return True
    head, sep, _ = os.fspath(text).partition("://")
    return bool(sep) and head.lower() in URL_SCHEMES


def run_path(text: str | os.PathLike | URLPath) -> RunPath:
    """A path as named by a recipe or a command line: a `URLPath` for gs:// and s3://, a local
    Path otherwise (``file:///x`` is the local ``/x``). Other schemes are a ValueError."""
    if isinstance(text, (URLPath, Path)):
        return text
    text = os.fspath(text)
    head, sep, rest = text.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        scheme = head.lower()
        if scheme in URL_SCHEMES:
            return URLPath(f"{scheme}://{rest}")
        if scheme == "file":
            return Path(urllib.parse.unquote(urllib.parse.urlparse(text).path))
        raise ValueError(f"{text}: URL scheme {scheme}:// is not supported; use a local path, file://, gs:// or s3://")
    return Path(text)


class Backend(Protocol):
    """File operations on one kind of path; every function takes the path as a string."""

    def exists(self, path: str) -> bool: ...
    def isfile(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...  # names directly inside; [] for nothing there
    def find(self, path: str) -> list[str]: ...  # every file below, full names, sorted
    def size(self, path: str) -> int: ...
    def read_bytes(self, path: str) -> bytes: ...
    def write_text(self, path: str, text: str) -> None: ...  # atomic: all of it or what was there
    def delete(self, path: str, recursive: bool = False) -> None: ...  # nothing there: no error
    def makedirs(self, path: str) -> None: ...
    def sha256(self, path: str) -> str: ...
    def upload(self, local_path: str, path: str) -> None: ...  # a local file to ``path``, atomically


class LocalBackend:
    """The local file system. ``write_text`` writes ``.NAME.tmp-PID`` beside the file and renames
    it into place (``checkpoints.clean_orphans`` removes such temporaries of dead processes)."""

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def find(self, path: str) -> list[str]:
        return sorted(str(p) for p in Path(path).rglob("*") if p.is_file())

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def read_bytes(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def write_text(self, path: str, text: str) -> None:
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, p)

    def delete(self, path: str, recursive: bool = False) -> None:
        if recursive and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def sha256(self, path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()  # reads in chunks: bounded memory

    def upload(self, local_path: str, path: str) -> None:
        if os.path.abspath(local_path) != os.path.abspath(path):
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
            shutil.copyfile(local_path, tmp)
            os.replace(tmp, path)


LOCAL = LocalBackend()
_url_backend: Backend | None = None


def register_url_backend(backend: Backend) -> None:
    """Serve gs:// and s3:// paths with ``backend`` (``olmo_run.run_dir`` does this on import)."""
    global _url_backend
    _url_backend = backend


def backend(path: Any) -> Backend:
    """The backend for ``path`` (a Path, a `URLPath`, or a string)."""
    if not is_url(path):
        return LOCAL
    if _url_backend is None:
        raise StorageBackendError(
            f"{path}: gs:// and s3:// paths are served by olmo-run's storage layer, which is not loaded; "
            "install olmo-run with olmo-data's gcs/s3 extras and import olmo_run (the trainers and tools do)"
        )
    return _url_backend


def local_copy_root() -> Path:
    """Where the local copies of remote run dirs live: $OLMO_CACHE/run-dirs (default
    ~/.cache/olmo-twin/run-dirs), one folder per URL (scheme/bucket/key)."""
    return Path(os.environ.get("OLMO_CACHE") or Path.home() / ".cache" / "olmo-twin") / "run-dirs"


def local_copy(run_dir: RunPath) -> Path:
    """The folder holding process 0's copy of a run dir's small files (metrics.jsonl, loss.png,
    recipe.yaml, spec.json): the run dir itself when local, else a folder derived from the URL."""
    if isinstance(run_dir, Path):
        return run_dir
    return local_copy_root() / run_dir.scheme / run_dir.bucket / run_dir.key

"""Names: a path is a local path, a ``file://`` URL (its local path) or a ``gs://`` / ``s3://``
URL, given as a string, an ``os.PathLike`` or a `URLPath`; the functions here return strings."""

from __future__ import annotations

import os
import posixpath
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from .errors import StorageError

REMOTE_SCHEMES = ("gs", "s3")


@dataclass(frozen=True, order=True)
class URLPath:
    """A ``gs://bucket/key`` or ``s3://bucket/key`` name (no trailing slash), for code that
    builds names below a folder that may be a URL (a run dir: ``/``, ``name``, ``parent``).
    It has no ``__fspath__`` on purpose, so ``open(url_path)`` cannot silently create a local
    file; every function of fileio takes it."""

    url: str

    def __post_init__(self) -> None:
        scheme, sep, rest = self.url.partition("://")
        if not sep or scheme not in REMOTE_SCHEMES or not rest.split("/", 1)[0]:
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


# What every function of fileio takes as a path.
PathArg = str | os.PathLike | URLPath


def _text(path: PathArg) -> str:
    return path.url if isinstance(path, URLPath) else os.fspath(path)


def _scheme(path: str) -> str | None:
    head, sep, _ = path.partition("://")
    # A scheme is letters first (RFC 3986); "C:\\x" or "a/b://c" are local names.
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        return None
    return head.lower()


def normalize(path: PathArg) -> str:
    """The one spelling of a path: ``file://`` URLs become local paths, ``gs://`` / ``s3://``
    URLs are checked (a bucket is named, the scheme is one we serve); local paths are returned
    as given (relative ones stay relative)."""
    text = _text(path)
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


def is_remote(path: PathArg) -> bool:
    """True for ``gs://`` and ``s3://`` URLs (``file://`` URLs are local paths)."""
    return _scheme(_text(path)) in REMOTE_SCHEMES


def _split(url: str) -> tuple[str, str]:
    """(scheme, "bucket/key") of a normalized remote URL: the form fsspec takes."""
    scheme, rest = url.split("://", 1)
    return scheme, rest.rstrip("/")


def _bucket(url: str) -> str:
    return _split(url)[1].split("/", 1)[0]


def join(base: PathArg, *parts: PathArg) -> str:
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


def dirname(path: PathArg) -> str:
    """The folder holding `path` (a bucket's root for a top-level object)."""
    path = normalize(path)
    if not is_remote(path):
        return str(Path(path).parent)
    scheme, rest = _split(path)
    return f"{scheme}://{posixpath.dirname(rest) or rest}"


def relpath(path: PathArg, root: PathArg) -> str:
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

"""The errors of every storage call: a `StorageError` (a `DataError`, which the CLIs print as one
line) names the path and the fix; the kinds also derive from the matching builtin
(FileNotFoundError, PermissionError, ConnectionError), so code written for local files catches
them unchanged."""

from __future__ import annotations

from olmo_data.errors import DataError


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

"""Exceptions of olmo_data: every data problem is a `DataError` (a `ValueError`) whose
one-line message names the file, the field or tensor, and the fix."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data input: a missing file, an empty glob, a wrong dtype, an id outside the vocab."""


class ShardCorruptError(DataError):
    """A zstd shard whose bytes do not match its manifest (corrupt chunk, truncated file)."""

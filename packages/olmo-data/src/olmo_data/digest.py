"""The additive batch digest: one number per global batch that any set of processes can
compute from its own rows and combine without sending rows to each other.

A row's digest is the sha256 of (step, global row index, as int64 little-endian) followed by
the row's input_ids, labels, doc_ids and positions as int32 little-endian. A set of rows'
digest is the sum of its rows' digests modulo 2**256, in hex. It is order-sensitive (the row
index is hashed) and additive: the digests of disjoint row sets add up (``combine_digests``)
to the digest of their union, so the digests R ranks compute for a step combine to the global
batch's digest, the one ``olmo-data batches --digest`` prints and both trainers log.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from olmo_data.order import BATCH_KEYS

DIGEST_MODULUS = 1 << 256


def batch_digest(batch: dict[str, np.ndarray], step: int, first_row: int) -> str:
    """The digest of rows ``first_row, first_row + 1, ...`` of global batch ``step`` (0-based),
    ``batch`` holding those rows in order."""
    return rows_digest(batch, step, range(first_row, first_row + batch["input_ids"].shape[0]))


def rows_digest(batch: dict[str, np.ndarray], step: int, rows: Iterable[int]) -> str:
    """The digest of ``batch``'s rows, row r of ``batch`` being global row ``rows[r]``."""
    total = 0
    for r, index in enumerate(rows):
        h = hashlib.sha256(np.array([step, index], "<i8").tobytes())
        for k in BATCH_KEYS:
            h.update(np.ascontiguousarray(batch[k][r], "<i4").tobytes())
        total += int.from_bytes(h.digest(), "big")
    return f"{total % DIGEST_MODULUS:064x}"


def loader_rows(dp_ranks: Sequence[int], global_batch_size: int, dp_size: int) -> list[int]:
    """The global row indices a loader of ``dp_ranks`` yields, in its order (each rank's
    contiguous slice of ``global_batch_size / dp_size`` rows, ranks in the given order)."""
    per = global_batch_size // dp_size
    return [r * per + i for r in dp_ranks for i in range(per)]


def combine_digests(digests: Iterable[str]) -> str:
    """The digest of the union of disjoint row sets (e.g. all ranks of one step)."""
    return f"{sum(int(d, 16) for d in digests) % DIGEST_MODULUS:064x}"

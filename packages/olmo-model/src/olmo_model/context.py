"""Context parallelism's layout, written once for both trainers: which positions of a sequence
each rank of a context group holds, and which keys a rank needs from the others.

The split is the load-balanced ("zigzag") one of Llama 3 and torchtitan: a sequence of ``S``
tokens is cut into ``2 * C`` chunks of ``S / (2C)`` tokens for a context degree ``C``; rank ``r``
holds chunks ``r`` and ``2C - 1 - r``. Under causal attention chunk ``j`` attends to ``j + 1``
chunks' worth of keys, so every rank does the same attention work (``r + 1`` plus ``2C - r``).

A rank's shard is ``layout.positions(r)``: its tokens in sequence order within each chunk, the
early chunk first. Token ids, labels, document ids and RoPE positions are all indexed with it,
so the model sees exactly the tokens, positions and targets it would at ``C = 1``; only the
order of the rows' columns differs, which the loss (a sum over tokens, divided by the global
count) does not see.

Keys: a global layer's query needs every earlier key, so each rank gathers all of K and V
(``C`` x its own, the Llama 3 choice: with grouped-query attention K/V are ``n_kv_heads /
n_heads`` of Q's size, and one all-gather per layer overlaps better than ``C - 1`` ring steps
on hardware whose collectives run beside compute). A sliding layer with window ``W`` needs only
the ``W - 1`` keys before each of its chunks: ``halo(window)`` says how many chunks back that
reaches, and ``halo_sources`` from which rank each of those chunks comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


class ContextLayoutError(ValueError):
    """A context degree the sequence cannot be split by."""


@dataclass(frozen=True)
class ContextLayout:
    """The zigzag split of a ``sequence_length``-token sequence over ``degree`` ranks."""

    sequence_length: int
    degree: int

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ContextLayoutError(f"context degree {self.degree} must be at least 1")
        if self.degree > 1 and self.sequence_length % (2 * self.degree):
            raise ContextLayoutError(
                f"sequence_length={self.sequence_length} does not split into 2 x {self.degree} equal chunks "
                f"for context degree {self.degree}; use a degree whose double divides the sequence length"
            )

    @property
    def n_chunks(self) -> int:
        return 2 * self.degree if self.degree > 1 else 1

    @property
    def chunk(self) -> int:
        """Tokens per chunk (a rank holds two)."""
        return self.sequence_length // self.n_chunks

    @property
    def shard_length(self) -> int:
        """Tokens per rank."""
        return self.sequence_length // self.degree

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunk indices rank ``rank`` holds, in the order it holds them."""
        if not 0 <= rank < self.degree:
            raise ContextLayoutError(f"context rank {rank} outside 0..{self.degree - 1}")
        if self.degree == 1:
            return (0,)
        return (rank, self.n_chunks - 1 - rank)

    def positions(self, rank: int) -> np.ndarray:
        """The sequence positions rank ``rank`` holds ([shard_length] int64, in its order)."""
        c = self.chunk
        return np.concatenate([np.arange(j * c, (j + 1) * c, dtype=np.int64) for j in self.chunks_of(rank)])

    @cached_property
    def order(self) -> np.ndarray:
        """All ranks' positions concatenated in rank order ([sequence_length]): the permutation
        that takes a sequence to the layout a context-sharded array holds (rank r owns columns
        ``r * shard_length`` to ``(r + 1) * shard_length``)."""
        return np.concatenate([self.positions(r) for r in range(self.degree)])

    @cached_property
    def inverse(self) -> np.ndarray:
        """The permutation back: ``x_in_sequence_order = x_sharded[..., inverse]``."""
        inv = np.empty_like(self.order)
        inv[self.order] = np.arange(self.sequence_length)
        return inv

    def shard(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        """``x`` with its sequence ``axis`` reordered to the sharded layout (numpy; for tests
        and for the loader side, which hands whole rows)."""
        return np.take(x, self.order, axis=axis)

    def unshard(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.take(x, self.inverse, axis=axis)

    def halo(self, window: int) -> int:
        """How many chunks before a chunk a sliding window of ``window`` keys (itself included)
        reaches: ceil((window - 1) / chunk). Zero at degree 1."""
        if self.degree == 1 or window <= 1:
            return 0
        return -(-(window - 1) // self.chunk)

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, slot) holding chunk ``chunk``: slot 0 is a rank's early chunk, 1 its late one."""
        if chunk < self.degree:
            return chunk, 0
        return self.n_chunks - 1 - chunk, 1

    def halo_sources(self, rank: int, window: int) -> list[tuple[int, int, int]]:
        """For each chunk ``rank`` holds and each of the ``halo(window)`` chunks before it that
        exists: (own slot, source rank, source slot), nearest first. A sliding layer needs
        exactly these chunks (their last ``window - 1`` keys) from the other ranks."""
        out = []
        for slot, j in enumerate(self.chunks_of(rank)):
            for back in range(1, self.halo(window) + 1):
                if j - back >= 0:
                    src, src_slot = self.owner(j - back)
                    out.append((slot, src, src_slot))
        return out

"""The global data order: which instance of which source sits at global index i, and the
global batch at step b, as pure functions of (mixture fingerprint, seed, index).

Instances. Source s with N_s tokens is cut into I_s = N_s // S fixed windows of
S = sequence_length tokens, window k = tokens [k*S, (k+1)*S); the tail is dropped. (A
source with `windowing: olmo-core` cuts each of its files on its own, as OLMo-core does:
`olmo_data.sources.PerFileWindows`; I_s is then the sum over its files.)
Documents may span windows; per window, `doc_ids` number the documents from 0 and
`positions` count from 0 at each document start (and at the window start), which is the
packed-sequence convention (a position reset marks a document boundary).

Mixture epoch. One mixture epoch is P = sum_s slots_s slots; source s owns slots_s of them
(its ratio share of P = sum_s I_s by largest-remainder rounding, or tokens_s // S when the
mixture gives token counts). The epoch is cut into M = max(1, P // 1024) blocks; block m
holds floor((m+1) slots_s / M) - floor(m slots_s / M) slots of each source s, i.e. the
ratios hold to +-1 instance per source in every block of ~1-2k instances, and source s's
stream elements are handed out block by block. Inside a block, the order is a seeded
permutation (a Feistel network with cycle-walking, keyed by (fingerprint, seed, epoch,
block)), so the epoch as a whole is a seeded block-local permutation of its slots.
Rollover: epoch e+1 starts again at block 0 with fresh keys, and the per-source streams
simply continue (element e*slots_s + ...), so a source's consumption never resets.

Source streams. Element j of source s is instance perm_{s,r}(j mod I_s), r = j // I_s: each
repeat of a source is its own seeded permutation. Repetition cap: element j is allowed
only if j < floor(max_repetition * I_s); asking for a batch that would take any later
element raises `RepetitionLimitError` (a clear stop, never a silent extra epoch). As streams
advance block by block, that stop comes within one block (~1-2k instances) of the budget.

Everything is integer arithmetic on numpy uint64 (no RNG state), O(K log M) per index for K
sources and M blocks, and nothing bigger than the list of sources is materialised.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from olmo_data.errors import DataError
from olmo_data.sources import PerFileWindows, TokenSource, locate, num_windows, window_spans

BATCH_KEYS = ("input_ids", "labels", "doc_ids", "positions")
IGNORE_INDEX = -100  # label of the last token of a source: nothing follows it (PyTorch's ignore_index)

# Feistel rounds. Luby-Rackoff: 4 rounds of a random round function already give a strong
# pseudo-random permutation; 6 keeps small domains (a few bits per half) well mixed.
_FEISTEL_ROUNDS = 6
# Slots per block (see the module docstring): small enough that realised ratios hold
# within every ~1-2k instances and a source's stream is read in order up to one block.
_BLOCK_SLOTS = 1024


class RepetitionLimitError(DataError):
    """A batch would read a source beyond its `max_repetition` epochs."""


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea, Flood 2014; constants from Stafford's "Mix13"):
    a bijective avalanche of uint64 values; wraps modulo 2**64 by design."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def derive_key(*parts: object) -> int:
    """A 64-bit key from any printable parts (fingerprint, seed, purpose, ...)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def round_keys(key: int | np.ndarray, tweak: np.ndarray) -> np.ndarray:
    """Feistel round keys, shape (rounds, n), for base key(s) `key` and per-element tweaks
    (an epoch or a repeat number): a different permutation for every (key, tweak)."""
    base = np.asarray(key, dtype=np.uint64) ^ _mix64(np.asarray(tweak, dtype=np.uint64) + np.uint64(1))
    rounds = np.arange(1, _FEISTEL_ROUNDS + 1, dtype=np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15)
    return _mix64(np.atleast_1d(base)[None, :] + rounds)


def feistel_permute(x: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of [0, n) applied to x (int array, values in [0, n)).

    A balanced Feistel network over the smallest even-bit power-of-two domain >= n (at
    most 4n), with cycle-walking: re-encrypt until the value lands back inside [0, n).
    Since the network permutes the power-of-two domain, walking from x < n reaches another
    value < n on x's own cycle, so the restriction is itself a bijection of [0, n).
    `keys` is (rounds, len(x)) or (rounds, 1).
    """
    x = np.asarray(x, dtype=np.int64)
    if n <= 1:
        return np.zeros_like(x)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = np.broadcast_to(keys, (keys.shape[0], x.size))

    def encrypt(v: np.ndarray, k: np.ndarray) -> np.ndarray:
        left, right = v >> shift, v & mask
        for r in range(k.shape[0]):
            left, right = right, left ^ (_mix64(right ^ k[r]) & mask)
        return (left << shift) | right

    y = encrypt(x.reshape(-1).astype(np.uint64), keys)
    todo = np.flatnonzero(y >= np.uint64(n))
    while todo.size:
        y[todo] = encrypt(y[todo], keys[:, todo])
        todo = todo[y[todo] >= np.uint64(n)]
    return y.astype(np.int64).reshape(x.shape)


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Integer shares of `total` proportional to `weights` that sum exactly to `total`
    (Hamilton's method: floor, then hand the remainder to the largest fractions)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    shares = np.floor(exact).astype(np.int64)
    short = total - int(shares.sum())
    # Stable order on ties so the result never depends on float noise in argsort.
    for i in np.argsort(-(exact - shares), kind="stable")[:short]:
        shares[i] += 1
    return [int(v) for v in shares]


def check_token_ids(source: TokenSource, tokens: np.ndarray, first: np.ndarray, vocab_size: int) -> None:
    """DataError unless every id in `tokens` ([n, L] int32 read from `source`, row i from
    token first[i] on) is < vocab_size. One max over the batch: the open-time check trusts a
    shard manifest's max_token_id, and a forged or stale one must not reach the model."""
    ids = tokens.view(np.uint32)  # an id >= 2**31 would pass as a negative int32
    if ids.size == 0 or int(ids.max()) < vocab_size:
        return
    row, col = np.unravel_index(int(np.argmax(ids)), ids.shape)
    part, offset = locate(source, int(first[row]) + int(col))
    declared = getattr(part, "max_token_id", None)
    raise DataError(
        f"{part.path}: token id {int(ids[row, col])} at token {offset} >= vocab_size {vocab_size}"
        f"{'' if declared is None else f', though the file declares max_token_id {declared}'}: its manifest or "
        "dtype misdescribes its data; re-create the file (olmo-data tokenize, or re-export) or fix vocab_size"
    )


def read_instances(
    source: TokenSource, within: np.ndarray, sequence_length: int, vocab_size: int | None = None
) -> dict[str, np.ndarray]:
    """input_ids, labels, doc_ids, positions ([n, S] int32) of windows `within` of `source`.

    labels[t] = input_ids[t+1]; the last label is the token after the window, or
    IGNORE_INDEX when the window ends the source (with `windowing: olmo-core`, its file).
    With vocab_size, an id >= vocab_size read here is a DataError (`check_token_ids`).
    """
    seq = sequence_length
    within = np.asarray(within, dtype=np.int64)
    n = len(within)
    first, limit = window_spans(source, within, seq)
    # tokens[row] = the window plus the token after it (IGNORE_INDEX at the end of the
    # source, set after the id check: the check reads the array as uint32)
    tokens = np.zeros((n, seq + 1), np.int32)  # the outputs are int32 anyway
    cut: list[tuple[int, int]] = []  # (row, tokens read) of windows that end the source
    # Read in window order: compressed shards decompress whole chunks, and a batch's
    # windows that share a chunk then hit the chunk cache one after another.
    for row in np.argsort(within, kind="stable").tolist():
        start = int(first[row])
        stop = min(start + seq + 1, int(limit[row]))
        tokens[row, : stop - start] = source.read(start, stop)
        if stop - start <= seq:
            cut.append((row, stop - start))
    if vocab_size is not None:
        check_token_ids(source, tokens, first, vocab_size)
    for row, length in cut:
        tokens[row, length:] = IGNORE_INDEX
    # document starts strictly inside each window, as (row, column) pairs
    doc_starts = source.doc_starts()
    lo = np.searchsorted(doc_starts, first + 1, side="left")
    hi = np.searchsorted(doc_starts, first + seq, side="left")
    counts = hi - lo
    rows = np.repeat(np.arange(n), counts)
    ranks = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    cols = doc_starts[np.repeat(lo, counts) + ranks] - first[rows]
    marks = np.zeros((n, seq), np.int32)
    marks[rows, cols] = 1
    segment_start = np.zeros((n, seq), np.int32)
    segment_start[rows, cols] = cols
    return {
        "input_ids": np.ascontiguousarray(tokens[:, :seq]),
        "labels": np.ascontiguousarray(tokens[:, 1:]),
        "doc_ids": np.cumsum(marks, axis=1, dtype=np.int32),
        "positions": np.arange(seq, dtype=np.int32) - np.maximum.accumulate(segment_start, axis=1),
    }


class GlobalOrder:
    """The instance order and the batches of a mixture (see the module docstring).

    `sources` are the training TokenSources; `slots_per_epoch[s]` their share of a mixture
    epoch; `max_instances[s]` the stream length allowed by max_repetition (None: no cap);
    with `vocab_size`, every batch read is checked to hold only ids below it.
    """

    def __init__(
        self,
        sources: Sequence[TokenSource],
        names: Sequence[str],
        slots_per_epoch: Sequence[int],
        max_instances: Sequence[int | None],
        sequence_length: int,
        key: int,
        vocab_size: int | None = None,
    ) -> None:
        if sequence_length <= 0:
            raise DataError(f"sequence_length must be > 0, got {sequence_length}")
        self.sources = list(sources)
        self.names = list(names)
        self.sequence_length = int(sequence_length)
        self.num_instances = np.array([num_windows(s, self.sequence_length) for s in self.sources], np.int64)
        for name, src, n in zip(self.names, self.sources, self.num_instances):
            if n == 0:
                raise DataError(
                    f"{src.path}: source {name!r} holds no window of sequence_length {self.sequence_length} "
                    f"({src.num_tokens} tokens{', no file that long' if isinstance(src, PerFileWindows) else ''}); "
                    "add data or lower sequence_length"
                )
        self.slots = np.asarray(slots_per_epoch, dtype=np.int64)
        if self.slots.sum() <= 0:
            raise DataError("mixture epoch has no slots: every source has a zero share; give one a ratio > 0")
        self.epoch_size = int(self.slots.sum())
        self.num_blocks = max(1, self.epoch_size // _BLOCK_SLOTS)
        self.max_instances = list(max_instances)
        self.key = key
        self.vocab_size = vocab_size
        self._source_keys = np.array([derive_key(key, "source", i) for i in range(len(self.sources))], np.uint64)
        self._epoch_key = derive_key(key, "epoch")

    def _block_start(self, block: np.ndarray) -> np.ndarray:
        """First epoch position of each block: sum over sources of their earlier slots."""
        return (block[:, None] * self.slots[None, :] // self.num_blocks).sum(axis=1)

    def stream_positions(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source id, element of that source's stream) for global instance indices."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        if index.size and index.min() < 0:
            raise ValueError(f"global instance index must be >= 0, got {int(index.min())}")
        epoch, k = np.divmod(index, self.epoch_size)
        # the block holding k: the last m with block_start(m) <= k (vectorised bisection)
        lo, hi = np.zeros_like(k), np.full_like(k, self.num_blocks)
        while np.any(hi - lo > 1):
            mid = (lo + hi) // 2
            below = self._block_start(mid) <= k
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        block = lo
        before = block[:, None] * self.slots[None, :] // self.num_blocks  # [n, K] slots in earlier blocks
        counts = (block[:, None] + 1) * self.slots[None, :] // self.num_blocks - before
        offset = k - before.sum(axis=1)
        sizes = counts.sum(axis=1)
        q = np.empty_like(offset)
        keys = round_keys(self._epoch_key, epoch * self.num_blocks + block)
        for size in np.unique(sizes):
            at = np.flatnonzero(sizes == size)
            q[at] = feistel_permute(offset[at], int(size), keys[:, at])
        # the block's slots are laid out source by source; q picks one of them
        ends = np.cumsum(counts, axis=1)
        source = (q[:, None] >= ends).sum(axis=1)
        rows = np.arange(len(q))
        stream = epoch * self.slots[source] + before[rows, source] + q - (ends[rows, source] - counts[rows, source])
        return source, stream

    def instances_at(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source id, instance within source) for an array of global instance indices;
        raises RepetitionLimitError if any would exceed its source's max_repetition."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        source, stream = self.stream_positions(index)
        within = np.empty_like(stream)
        for s in np.unique(source):
            at = np.flatnonzero(source == s)
            cap = self.max_instances[s]
            if cap is not None and stream[at].max() >= cap:
                worst = at[np.argmax(stream[at])]
                raise RepetitionLimitError(
                    f"global instance {int(index[worst])} would read source {self.names[s]!r} "
                    f"({self.sources[s].path}) beyond max_repetition: {cap} instances = "
                    f"{cap / self.num_instances[s]:.3g} epochs of it are allowed; raise max_repetition or add data"
                )
            repeat, r = np.divmod(stream[at], self.num_instances[s])
            within[at] = feistel_permute(r, int(self.num_instances[s]), round_keys(self._source_keys[s], repeat))
        return source, within

    def instance_at(self, index: int) -> tuple[int, int]:
        """(source id, instance within source) of global instance `index`."""
        source, within = self.instances_at(np.array([index]))
        return int(source[0]), int(within[0])

    def read_instances(self, source_ids: np.ndarray, within: np.ndarray) -> dict[str, np.ndarray]:
        """The batch arrays for rows (source id, instance within source), in row order."""
        out = {k: np.empty((len(source_ids), self.sequence_length), np.int32) for k in BATCH_KEYS}
        for s in np.unique(source_ids):
            rows = np.flatnonzero(source_ids == s)
            part = read_instances(self.sources[s], within[rows], self.sequence_length, self.vocab_size)
            for k in BATCH_KEYS:
                out[k][rows] = part[k]
        return out

    def global_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The global batch at `step`: instances [step*B, (step+1)*B) of the order."""
        return self.rank_slice(step, batch_size, 0, 1)

    def rank_instances(self, step: int, batch_size: int, dp_rank: int, dp_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(source id, instance within source) of rows [r*B/R, (r+1)*B/R) of global batch `step`;
        raises RepetitionLimitError naming the batch if a row is beyond its source's max_repetition."""
        if step < 0 or batch_size <= 0:
            raise ValueError(f"need step >= 0 and global batch size > 0, got step={step}, batch={batch_size}")
        if dp_size <= 0 or batch_size % dp_size:
            raise ValueError(
                f"global batch size {batch_size} is not divisible by the data-parallel size {dp_size}; "
                "choose a batch size that is a multiple of the dp size"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        rows = batch_size // dp_size
        first = step * batch_size + dp_rank * rows
        try:
            return self.instances_at(np.arange(first, first + rows, dtype=np.int64))
        except RepetitionLimitError as e:
            raise RepetitionLimitError(f"global batch {step}: {e}") from None

    def rank_slice(self, step: int, batch_size: int, dp_rank: int, dp_size: int) -> dict[str, np.ndarray]:
        """Rows [r*B/R, (r+1)*B/R) of global batch `step` (only those rows are read)."""
        return self.read_instances(*self.rank_instances(step, batch_size, dp_rank, dp_size))

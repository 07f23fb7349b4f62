"""Held-out leakage check: does any held-out document, or any n-gram of one, occur in the
training sources? Run before training (`assert_no_leakage`); the report is cached as a
small JSON keyed by the mixture fingerprint, so a trainer restart does not rescan.

Method (numpy, no Python loop over tokens):
- every n-gram (default 13) lying inside one held-out document is hashed
  (`olmo_data.ngrams.ngram_hashes`), giving a sorted table hash -> held-out documents;
- every training source is scanned in chunks of `_CHUNK_TOKENS` (overlapping by n-1 so no
  window is missed; memory stays bounded): all its n-gram hashes are looked up in the
  table with `searchsorted`;
- exact document copies: a training document is a candidate when its length and its first
  n-gram hash (or, for documents shorter than n, the hash of all of it) equal a held-out
  document's; candidates are confirmed with `doc_hash` (sha256 of the tokens).
A held-out document is contaminated if it has an exact copy or any n-gram hit. Hash
collisions of the 64-bit n-gram hash could only add false alarms, never hide a leak.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from olmo_data.content_hash import cache_root
from olmo_data.errors import DataError
from olmo_data.mixture import Mixture, load_mixture
from olmo_data.ngrams import doc_hash, ngram_hashes
from olmo_data.sources import TokenSource

log = logging.getLogger(__name__)

# Training tokens hashed per step: 4M tokens keep the uint64 temporaries near 100 MB.
_CHUNK_TOKENS = 1 << 22
_CACHE_VERSION = 1  # bump when the method changes so old cached reports are ignored


class LeakageError(DataError):
    """Held-out data occurs in a training source."""


@dataclasses.dataclass
class HeldOutLeakage:
    """The result for one held-out source. Each match is a dict: held-out `doc`,
    `training_source`, `training_doc` (index within that source) and `training_offset`."""

    source: str
    docs_checked: int
    exact_matches: list[dict[str, Any]]
    ngram_hits: list[dict[str, Any]]

    @property
    def contaminated_docs(self) -> list[int]:
        return sorted({m["doc"] for m in self.exact_matches} | {m["doc"] for m in self.ngram_hits})

    @property
    def fraction(self) -> float:
        return len(self.contaminated_docs) / max(1, self.docs_checked)


@dataclasses.dataclass
class LeakageReport:
    fingerprint: str
    ngram: int
    training_tokens: int
    seconds: float
    held_out: list[HeldOutLeakage]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for item, h in zip(out["held_out"], self.held_out):
            item["contaminated_docs"] = len(h.contaminated_docs)
            item["fraction"] = h.fraction
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeakageReport:
        held = [
            HeldOutLeakage(h["source"], h["docs_checked"], h["exact_matches"], h["ngram_hits"]) for h in d["held_out"]
        ]
        return cls(d["fingerprint"], d["ngram"], d["training_tokens"], d["seconds"], held)


def cache_path(mixture: Mixture) -> Path:
    return cache_root() / "leakage" / f"v{_CACHE_VERSION}-{mixture.fingerprint()}.json"


class _HeldOutIndex:
    """Every held-out document's n-gram hashes, lengths, prefix keys and sha256, over all
    held-out sources (document ids are global here; `owner` maps them back)."""

    def __init__(self, sources: dict[str, TokenSource], n: int) -> None:
        self.n = n
        self.owner: list[tuple[str, int]] = []  # global held-out doc id -> (source name, doc index)
        hashes, docs, lengths, firsts, self.sha = [], [], [], [], []
        for name, src in sources.items():
            tokens = src.read(0, src.num_tokens)
            starts = src.doc_starts()
            ends = np.append(starts[1:], src.num_tokens)
            base = len(self.owner)
            self.owner += [(name, i) for i in range(len(starts))]
            h = ngram_hashes(tokens, n)
            doc_of = np.searchsorted(starts, np.arange(h.size), side="right") - 1
            inside = np.arange(h.size) + n <= ends[doc_of]  # drop windows crossing into the next doc
            hashes.append(h[inside])
            docs.append(doc_of[inside] + base)
            lengths.append(ends - starts)
            firsts.append(np.array([self._key(tokens[a:b]) for a, b in zip(starts, ends)], np.uint64))
            self.sha += [doc_hash(tokens[a:b]) for a, b in zip(starts, ends)]
        order = np.argsort(np.concatenate(hashes), kind="stable")
        self.hashes = np.concatenate(hashes)[order]
        self.docs = np.concatenate(docs)[order]
        # A bitmap over the top hash bits, >= 64 bits per held-out n-gram, screens out ~98% of
        # training windows with one cache-friendly gather before the costly binary search.
        bits = int(np.clip(np.ceil(np.log2(max(1, self.hashes.size) * 64)), 16, 32))
        self.bitmap_shift = np.uint64(64 - bits)
        self.bitmap = np.zeros(1 << bits, dtype=bool)
        self.bitmap[self.hashes >> self.bitmap_shift] = True
        self.lengths = np.concatenate(lengths)
        self.first_keys = np.concatenate(firsts)
        # (length, prefix key) -> held-out docs, as a sorted combined key for searchsorted
        combined = self._combine(self.lengths, self.first_keys)
        self.by_key_order = np.argsort(combined, kind="stable")
        self.by_key = combined[self.by_key_order]
        self.short_lengths = np.unique(self.lengths[self.lengths < n])

    def _key(self, doc: np.ndarray) -> int:
        return int(ngram_hashes(doc[: self.n], min(self.n, len(doc)))[0])

    @staticmethod
    def _combine(lengths: np.ndarray, keys: np.ndarray) -> np.ndarray:
        return keys ^ (lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))

    def ngram_owners(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(window index, held-out doc) for every window hash that occurs in a held-out doc."""
        maybe = np.flatnonzero(self.bitmap[h >> self.bitmap_shift])
        pos = np.searchsorted(self.hashes, h[maybe], side="left")
        end = np.searchsorted(self.hashes, h[maybe], side="right")
        hit = np.flatnonzero(end > pos)
        counts = (end - pos)[hit]
        windows = np.repeat(maybe[hit], counts)
        # every index in [pos, end) of each hit, flattened
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return windows, self.docs[np.repeat(pos[hit], counts) + offsets]

    def candidates(self, lengths: np.ndarray, keys: np.ndarray) -> list[tuple[int, int]]:
        """(row, held-out doc) pairs whose length and prefix key match."""
        combined = self._combine(lengths, keys)
        lo = np.searchsorted(self.by_key, combined, side="left")
        hi = np.searchsorted(self.by_key, combined, side="right")
        return [(int(r), int(self.by_key_order[j])) for r in np.flatnonzero(hi > lo) for j in range(lo[r], hi[r])]


def _scan_source(index: _HeldOutIndex, name: str, src: TokenSource, found: dict[str, dict[int, dict]]) -> None:
    """Record in `found` ("exact"/"ngram": held-out doc -> first match) every hit in `src`."""
    n = index.n
    starts = src.doc_starts()
    ends = np.append(starts[1:], src.num_tokens)
    for lo in range(0, src.num_tokens, _CHUNK_TOKENS):
        hi = min(lo + _CHUNK_TOKENS, src.num_tokens)
        chunk = src.read(lo, min(hi + n - 1, src.num_tokens))
        h = ngram_hashes(chunk, n)[: hi - lo]
        windows, owners = index.ngram_owners(h)
        if owners.size:
            first_docs, first = np.unique(owners, return_index=True)
            for doc, w in zip(first_docs.tolist(), windows[first].tolist()):
                offset = lo + w
                found["ngram"].setdefault(doc, _match(index, doc, name, starts, offset))
        # exact copies: training docs starting in [lo, hi) with a held-out length and prefix
        a, b = np.searchsorted(starts, [lo, hi], side="left")
        doc_ids = np.arange(a, b)
        lengths = ends[a:b] - starts[a:b]
        pairs = []
        long = lengths >= n
        pairs += [(doc_ids[long][r], d) for r, d in index.candidates(lengths[long], h[starts[a:b][long] - lo])]
        for short in index.short_lengths:
            sel = lengths == short
            if sel.any():
                hs = ngram_hashes(chunk, int(short))
                pairs += [(doc_ids[sel][r], d) for r, d in index.candidates(lengths[sel], hs[starts[a:b][sel] - lo])]
        for tdoc, doc in pairs:
            tokens = src.read(int(starts[tdoc]), int(ends[tdoc]))
            if doc not in found["exact"] and doc_hash(tokens) == index.sha[doc]:
                found["exact"][doc] = _match(index, doc, name, starts, int(starts[tdoc]))


def _match(index: _HeldOutIndex, doc: int, training_source: str, starts: np.ndarray, offset: int) -> dict[str, Any]:
    return {
        "doc": index.owner[doc][1],
        "training_source": training_source,
        "training_doc": int(np.searchsorted(starts, offset, side="right") - 1),
        "training_offset": int(offset),
    }


def check_leakage(mixture: Mixture, use_cache: bool = True) -> LeakageReport:
    """Scan every training source for every held-out source's documents and n-grams."""
    path = cache_path(mixture)
    if use_cache and path.is_file():
        return LeakageReport.from_json(json.loads(path.read_text()))
    t0 = time.perf_counter()
    n = mixture.config.leakage.ngram
    held = mixture.held_out_sources
    reports = []
    if held:
        index = _HeldOutIndex(held, n)
        found: dict[str, dict[int, dict]] = {"exact": {}, "ngram": {}}
        for name, src in zip(mixture.source_names, mixture.training_sources):
            _scan_source(index, name, src, found)
        for name, src in held.items():
            mine = {kind: [m for d, m in sorted(found[kind].items()) if index.owner[d][0] == name] for kind in found}
            reports.append(HeldOutLeakage(name, src.num_docs, mine["exact"], mine["ngram"]))
    report = LeakageReport(
        fingerprint=mixture.fingerprint(),
        ngram=n,
        training_tokens=sum(s.num_tokens for s in mixture.training_sources),
        seconds=time.perf_counter() - t0,
        held_out=reports,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(report.to_json(), indent=1))
    os.replace(tmp, path)
    return report


def assert_no_leakage(mixture: Mixture, allow: bool = False) -> LeakageReport:
    """Refuse (LeakageError) when more than leakage.max_doc_overlap_fraction of any held-out
    source's documents occur in training; with allow=True log a loud warning instead."""
    report = check_leakage(mixture)
    limit = mixture.config.leakage.max_doc_overlap_fraction
    for h in report.held_out:
        if h.fraction <= limit:
            continue
        # Exact copies first (the stronger evidence), then documents with only n-gram hits.
        firsts = {m["doc"]: (1, f"{report.ngram}-gram", m) for m in h.ngram_hits}
        firsts.update({m["doc"]: (0, "exact copy", m) for m in h.exact_matches})
        named = [
            f"doc {doc} ({kind} in {m['training_source']!r} doc {m['training_doc']}, token {m['training_offset']})"
            for doc, (_, kind, m) in sorted(firsts.items(), key=lambda x: (x[1][0], x[0]))[:5]
        ]
        message = (
            f"{mixture.path}: held_out {h.source!r}: {len(h.contaminated_docs)}/{h.docs_checked} documents "
            f"({h.fraction:.2%} > max_doc_overlap_fraction {limit:.2%}) occur in training: {', '.join(named)}"
            f"{' ...' if len(firsts) > 5 else ''}; remove them from the training data (or raise the limit)"
        )
        if not allow:
            raise LeakageError(message)
        log.warning("!!! HELD-OUT LEAKAGE ALLOWED (allow=True): %s !!!", message)
    return report


def open_training_mixture(
    path: str | os.PathLike,
    *,
    sequence_length: int | None = None,
    model_vocab_size: int | None = None,
    max_positions: int | None = None,
    allow_leakage: bool = False,
) -> Mixture:
    """What a trainer does before any step: load the mixture (or "sample"), cut it at the
    recipe's sequence length, check that the model can take its tokens and its length, and
    refuse to start when held-out data leaks into training. Raises DataError / LeakageError
    with a one-line message; writes nothing but the leakage cache."""
    mixture = load_mixture(path)
    if sequence_length is not None:
        mixture = mixture.with_sequence_length(sequence_length)
    if model_vocab_size is not None and mixture.config.vocab_size > model_vocab_size:
        raise DataError(
            f"{mixture.path}: vocab_size {mixture.config.vocab_size} exceeds the model's vocab_size "
            f"{model_vocab_size}; use a model whose vocabulary covers the mixture's tokens"
        )
    if max_positions is not None and mixture.sequence_length > max_positions:
        raise DataError(
            f"sequence length {mixture.sequence_length} exceeds the model's max_position_embeddings "
            f"{max_positions}; lower train.sequence_length or raise max_position_embeddings in the model spec"
        )
    assert_no_leakage(mixture, allow=allow_leakage)
    return mixture

"""n-gram and document hashes against hand-computed values and a plain-python loop."""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from olmo_data.ngrams import doc_hash, isin_sorted, ngram_hashes, unique_sorted

BASE = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def _python_hashes(tokens: list[int], n: int) -> list[int]:
    out = []
    for i in range(len(tokens) - n + 1):
        h = 0
        for t in tokens[i : i + n]:
            h = (h * BASE + t + 1) & MASK
        out.append(h)
    return out


def test_hand_example():
    # n=2 over [3, 5, 3]: windows (3,5) and (5,3) -> (3+1)*B + (5+1) and (5+1)*B + (3+1), mod 2**64.
    got = ngram_hashes(np.array([3, 5, 3], dtype=np.uint16), n=2)
    assert got.dtype == np.uint64
    assert [int(x) for x in got] == [(4 * BASE + 6) & MASK, (6 * BASE + 4) & MASK]
    assert int(ngram_hashes(np.array([7]), n=1)[0]) == 8


def test_vectorised_equals_python_loop():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100352, size=300).astype(np.uint32)
    for n in (1, 5, 13):
        assert [int(x) for x in ngram_hashes(tokens, n)] == _python_hashes(tokens.tolist(), n)


def test_equal_windows_hash_equal_and_short_input():
    rng = np.random.default_rng(1)
    span = rng.integers(0, 4096, size=13)
    a = np.concatenate([rng.integers(0, 4096, 40), span, rng.integers(0, 4096, 7)]).astype(np.uint16)
    b = np.concatenate([rng.integers(0, 4096, 3), span]).astype(np.uint32)  # other dtype, other offset
    ha, hb = ngram_hashes(a, 13), ngram_hashes(b, 13)
    assert ha[40] == hb[3]
    assert len(np.intersect1d(ha, hb)) == 1
    assert ngram_hashes(np.arange(12), 13).size == 0


def test_doc_hash_is_sha256_of_uint32_le():
    tokens = [1, 2, 70000]
    expected = hashlib.sha256(struct.pack("<3I", *tokens)).digest()
    assert doc_hash(np.array(tokens, dtype=np.uint32)) == expected
    assert doc_hash(np.array([1, 2], dtype=np.uint16)) == hashlib.sha256(struct.pack("<2I", 1, 2)).digest()


def test_unique_sorted_and_isin_sorted_match_python_sets():
    rng = np.random.default_rng(2)
    table_values = rng.integers(0, 2**64 - 1, size=200, dtype=np.uint64, endpoint=True)
    table_values = np.concatenate([table_values, table_values[:50], [np.uint64(2**64 - 1)]])
    table = unique_sorted(table_values)
    assert [int(x) for x in table] == sorted({int(x) for x in table_values})
    queries = np.concatenate([table_values[::7], rng.integers(0, 2**63, size=100, dtype=np.uint64)])
    expected = [int(q) in {int(x) for x in table_values} for q in queries]
    assert isin_sorted(queries, table).tolist() == expected
    assert not isin_sorted(queries, unique_sorted(np.zeros(0, np.uint64))).any()

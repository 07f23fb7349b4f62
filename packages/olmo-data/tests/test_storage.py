"""Token storage: OLMo raw token files, zstd shards, concatenation and bad-input errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from olmo_data.errors import DataError, ShardCorruptError
from olmo_data.shards import read_manifest
from olmo_data.storage import ConcatSource, RawTokenFile, ShardSource, ShardWriter, open_source

EOS = 0


def _documents(rng: np.random.Generator, n: int, vocab: int, max_len: int = 50) -> list[np.ndarray]:
    """Random documents of ids in [1, vocab), so eos (0) appears only where we put it."""
    return [rng.integers(1, vocab, size=int(rng.integers(1, max_len))) for _ in range(n)]


def _write_olmo_file(path, docs, dtype) -> np.ndarray:
    """Write docs the way OLMo-core / Dolma do: each doc followed by eos, headerless memmap."""
    flat = np.concatenate([np.append(d, EOS) for d in docs]).astype(dtype)
    mm = np.memmap(path, dtype=dtype, mode="w+", shape=flat.shape)
    mm[:] = flat
    mm.flush()
    del mm
    return flat


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_raw_olmo_file_tokens_and_doc_starts(tmp_path, dtype):
    rng = np.random.default_rng(0)
    vocab = 70000 if dtype == np.uint32 else 4096
    docs = _documents(rng, 40, vocab)
    flat = _write_olmo_file(tmp_path / "part-0.npy", docs, dtype)
    src = RawTokenFile(tmp_path / "part-0.npy", dtype=np.dtype(dtype).name, eos_token_id=EOS)
    assert src.num_tokens == sum(len(d) + 1 for d in docs)
    expected_starts = np.cumsum([0] + [len(d) + 1 for d in docs[:-1]])
    np.testing.assert_array_equal(src.doc_starts(), expected_starts)
    assert src.num_docs == 40
    s = int(expected_starts[7])
    np.testing.assert_array_equal(src.read(s, s + len(docs[7])), docs[7])
    out = src.read(3, 120)
    assert out.dtype == np.uint32 and out.shape == (117,)
    np.testing.assert_array_equal(out, flat[3:120])
    assert src.max_token_id == max(int(d.max()) for d in docs)
    clone = pickle.loads(pickle.dumps(src))
    np.testing.assert_array_equal(clone.read(0, 50), flat[:50])


def test_raw_file_without_final_eos_keeps_last_doc(tmp_path):
    np.array([5, 6, EOS, 7, 8, 9], dtype=np.uint16).tofile(tmp_path / "a.npy")
    src = RawTokenFile(tmp_path / "a.npy", "uint16", EOS)
    np.testing.assert_array_equal(src.doc_starts(), [0, 3])


@pytest.mark.parametrize("chunk_tokens", [7, 64, 100000])
def test_shard_round_trip_random_ranges(tmp_path, chunk_tokens):
    rng = np.random.default_rng(1)
    docs = _documents(rng, 60, 4096)
    path = tmp_path / "s.shard"
    with ShardWriter(path, "uint16", chunk_tokens=chunk_tokens) as w:
        for d in docs:
            w.add_document(np.append(d, EOS))
    flat = np.concatenate([np.append(d, EOS) for d in docs])
    src = ShardSource(path)
    assert (src.num_tokens, src.num_docs, src.dtype) == (flat.size, 60, np.uint16)
    np.testing.assert_array_equal(src.doc_starts(), np.cumsum([0] + [len(d) + 1 for d in docs[:-1]]))
    for _ in range(50):
        a, b = sorted(int(x) for x in rng.integers(0, flat.size + 1, size=2))
        got = src.read(a, b)
        assert got.dtype == np.uint32
        np.testing.assert_array_equal(got, flat[a:b])
    np.testing.assert_array_equal(src.read(0, flat.size), flat)
    src.verify()
    clone = pickle.loads(pickle.dumps(src))
    np.testing.assert_array_equal(clone.read(5, 40), flat[5:40])
    with pytest.raises(IndexError, match="s.shard"):
        src.read(0, flat.size + 1)


def test_shard_uint32_ids_above_uint16(tmp_path):
    path = tmp_path / "big.shard"
    with ShardWriter(path, "uint32", chunk_tokens=3) as w:
        w.add_document([100000, 70000, 1, 0])
    np.testing.assert_array_equal(ShardSource(path).read(0, 4), [100000, 70000, 1, 0])
    with pytest.raises(DataError, match="uint32"):
        ShardWriter(tmp_path / "x.shard", "uint16").add_document([70000])


def _corrupt_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_chunk_names_file_and_chunk(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "c.shard"
    with ShardWriter(path, "uint16", chunk_tokens=100) as w:
        for d in _documents(rng, 30, 4096):
            w.add_document(d)
    chunk2 = read_manifest(path)["chunks"][2]
    _corrupt_byte(path, chunk2["offset"] + chunk2["compressed_size"] // 2)
    src = ShardSource(path)
    assert src.read(0, 200).size == 200  # chunks 0 and 1 still read
    with pytest.raises(ShardCorruptError, match=r"c\.shard: chunk 2 "):
        src.read(250, 260)
    with pytest.raises(ShardCorruptError, match="chunk 2"):
        src.verify()


def test_truncated_shard(tmp_path):
    path = tmp_path / "t.shard"
    with ShardWriter(path, "uint16", chunk_tokens=10) as w:
        w.add_document(np.arange(1, 100))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 30])
    with pytest.raises(ShardCorruptError, match="t.shard.*truncated"):
        ShardSource(path)
    path.write_bytes(data[:5])
    with pytest.raises(ShardCorruptError, match="t.shard.*truncated"):
        ShardSource(path)


def test_writer_is_atomic(tmp_path):
    path = tmp_path / "a.shard"
    with pytest.raises(RuntimeError):
        with ShardWriter(path, "uint16") as w:
            w.add_document([1, 2, 0])
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_open_source_concatenates_in_sorted_order(tmp_path):
    rng = np.random.default_rng(3)
    per_file = {}
    for name in ["b", "a", "c"]:
        docs = _documents(rng, 5, 4096)
        with ShardWriter(tmp_path / f"{name}.shard", "uint16", chunk_tokens=16) as w:
            for d in docs:
                w.add_document(np.append(d, EOS))
        per_file[name] = [np.append(d, EOS) for d in docs]
    src = open_source(str(tmp_path / "*.shard"), "shards", vocab_size=4096)
    assert isinstance(src, ConcatSource)
    assert [p.rsplit("/", 1)[1] for p in src.paths] == ["a.shard", "b.shard", "c.shard"]
    all_docs = per_file["a"] + per_file["b"] + per_file["c"]
    flat = np.concatenate(all_docs)
    np.testing.assert_array_equal(src.read(0, src.num_tokens), flat)
    np.testing.assert_array_equal(src.read(7, flat.size - 3), flat[7:-3])
    np.testing.assert_array_equal(src.doc_starts(), np.cumsum([0] + [len(d) for d in all_docs[:-1]]))
    assert src.num_docs == 15
    # A directory names the same files.
    np.testing.assert_array_equal(open_source(str(tmp_path), "shards").read(0, 30), flat[:30])


def test_open_source_numpy_files(tmp_path):
    rng = np.random.default_rng(4)
    d1, d2 = _documents(rng, 3, 4096), _documents(rng, 4, 4096)
    f1 = _write_olmo_file(tmp_path / "p1.npy", d1, np.uint16)
    f2 = _write_olmo_file(tmp_path / "p0.npy", d2, np.uint16)
    src = open_source([str(tmp_path / "p1.npy"), str(tmp_path / "p0.npy")], "numpy", dtype="uint16", eos_token_id=EOS)
    np.testing.assert_array_equal(src.read(0, src.num_tokens), np.concatenate([f2, f1]))
    assert src.num_docs == 7


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="nope.shard: file not found"):
        open_source(str(tmp_path / "nope.shard"), "shards")
    with pytest.raises(DataError, match=r"\*.shard: glob matches no file"):
        open_source(str(tmp_path / "*.shard"), "shards")
    np.arange(7, dtype=np.uint16).tofile(tmp_path / "odd.npy")  # 14 bytes: not uint32
    with pytest.raises(DataError, match=r"odd.npy: size 14 bytes is not a multiple of 4 \(uint32\)"):
        open_source(str(tmp_path / "odd.npy"), "numpy", dtype="uint32", eos_token_id=EOS)
    np.array([1, 5000, 0], dtype=np.uint16).tofile(tmp_path / "big.npy")
    with pytest.raises(DataError, match="big.npy: token id 5000 >= vocab_size 4096"):
        open_source(str(tmp_path / "big.npy"), "numpy", dtype="uint16", eos_token_id=EOS, vocab_size=4096)
    with pytest.raises(DataError, match="need a dtype"):
        open_source(str(tmp_path / "big.npy"), "numpy", eos_token_id=EOS)
    with pytest.raises(DataError, match="eos_token_id"):
        open_source(str(tmp_path / "big.npy"), "numpy", dtype="uint16")
    with ShardWriter(tmp_path / "v.shard", "uint16") as w:
        w.add_document([4096, 0])
    with pytest.raises(DataError, match="v.shard: token id 4096 >= vocab_size 4096"):
        open_source(str(tmp_path / "v.shard"), "shards", vocab_size=4096)
    with pytest.raises(DataError, match="v.shard: shard dtype is uint16"):
        open_source(str(tmp_path / "v.shard"), "shards", dtype="uint32")

"""Token sources: OLMo raw token files, zstd shards, concatenation, bad-input errors and the
cached content hash of raw files."""

from __future__ import annotations

import hashlib
import os
import pickle
import time

import numpy as np
import pytest

from olmo_data.content_hash import content_sha256
from olmo_data.errors import DataError, ShardCorruptError
from olmo_data.shards import read_manifest
from olmo_data.sources import ConcatSource, RawTokenFile, ShardSource, ShardWriter, open_source

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


@pytest.mark.parametrize("dtype, cut_tokens", [(np.uint16, 1), (np.uint16, 3), (np.uint32, 1)])
def test_truncated_raw_file_is_refused(tmp_path, dtype, cut_tokens):
    """A file cut short by whole tokens (an even number of bytes) loses its final eos."""
    docs = _documents(np.random.default_rng(5), 30, 4096)
    flat = _write_olmo_file(tmp_path / "t.npy", docs, dtype)
    assert RawTokenFile(tmp_path / "t.npy", np.dtype(dtype).name, EOS).num_docs == 30
    flat[:-cut_tokens].tofile(tmp_path / "t.npy")
    with pytest.raises(DataError) as e:
        RawTokenFile(tmp_path / "t.npy", np.dtype(dtype).name, EOS)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 't.npy'}: last token is {int(flat[-cut_tokens - 1])}, not eos_token_id 0")
    assert "looks truncated" in message and "re-export or re-tokenize" in message
    # the same cut through open_source (what a mixture does) is refused the same way
    with pytest.raises(DataError, match="t.npy: last token .* looks truncated"):
        open_source(str(tmp_path / "t.npy"), "numpy", dtype=np.dtype(dtype).name, eos_token_id=EOS)


@pytest.mark.parametrize("vocab", [4096, 100278])  # 100278: Olmo 3's dolma2 tokenizer, ids above 65535
def test_uint32_file_declared_uint16_is_refused(tmp_path, vocab):
    docs = _documents(np.random.default_rng(6), 200, vocab)
    flat = _write_olmo_file(tmp_path / "u32.npy", docs, np.uint32)
    words = flat.size  # 4-byte words; the probe samples 16 blocks of 256 once there are more than 4096
    assert words > 4096
    with pytest.raises(DataError) as e:
        open_source(str(tmp_path / "u32.npy"), "numpy", dtype="uint16", eos_token_id=EOS, vocab_size=vocab)
    assert "\n" not in str(e.value)
    assert str(e.value) == (
        f"{tmp_path / 'u32.npy'}: dtype uint16 does not fit this file: all 4096 sampled odd positions hold ids "
        "< 16, as the high halves of uint32 ids do; set dtype: uint32"
    )
    src = open_source(str(tmp_path / "u32.npy"), "numpy", dtype="uint32", eos_token_id=EOS, vocab_size=vocab)
    np.testing.assert_array_equal(src.read(0, src.num_tokens), flat)


def test_uint16_file_declared_uint32_is_refused(tmp_path):
    docs = _documents(np.random.default_rng(7), 100, 4096)
    flat = _write_olmo_file(tmp_path / "u16.npy", docs, np.uint16)
    if flat.size % 2:  # an odd count is refused by the size check; make it a whole number of uint32
        flat = _write_olmo_file(tmp_path / "u16.npy", docs[:-1], np.uint16)
    pairs = flat.astype(np.int64).reshape(-1, 2)
    assert pairs.shape[0] <= 4096  # small enough that the probe reads every word
    fused = int((pairs[:, 0] + 65536 * pairs[:, 1]).max())  # the ids a uint32 reader sees
    assert fused >= 1 << 20
    with pytest.raises(DataError) as e:
        open_source(str(tmp_path / "u16.npy"), "numpy", dtype="uint32", eos_token_id=EOS, vocab_size=4096)
    assert str(e.value) == (
        f"{tmp_path / 'u16.npy'}: dtype uint32 does not fit this file: sampled id {fused} is beyond any "
        "vocabulary (>= 1048576), as two uint16 ids read as one uint32 are; set dtype: uint16"
    )


def test_genuine_uint16_files_with_small_ids_pass_the_dtype_probe(tmp_path):
    """Zipf-distributed ids (most of them tiny) and an all-small-id file are not taken for uint32."""
    rng = np.random.default_rng(8)
    zipf = [np.minimum(rng.zipf(1.3, size=int(n)) + 1, 4095) for n in rng.integers(20, 200, size=300)]
    _write_olmo_file(tmp_path / "zipf.npy", zipf, np.uint16)
    assert RawTokenFile(tmp_path / "zipf.npy", "uint16", EOS).num_docs == 300
    tiny = [rng.integers(1, 16, size=9) for _ in range(100)]  # both halves < 16: undecidable, accepted
    _write_olmo_file(tmp_path / "tiny.npy", tiny, np.uint16)
    assert RawTokenFile(tmp_path / "tiny.npy", "uint16", EOS).num_tokens == 1000


def test_content_sha256_is_cached_by_stat(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "data.npy"
    data = np.arange(1, 5001, dtype=np.uint16)
    data.tofile(path)
    entries = lambda: sorted((tmp_path / "cache" / "file-sha256").glob("*.json"))  # noqa: E731
    # A file written just now is hashed but not cached: a write in the same timestamp tick
    # could not be told apart.
    assert content_sha256(path) == hashlib.sha256(data.tobytes()).hexdigest()
    assert entries() == []
    old = time.time_ns() - 86_400 * 10**9
    os.utime(path, ns=(old, old))
    assert content_sha256(path) == hashlib.sha256(data.tobytes()).hexdigest()
    assert len(entries()) == 1
    real_digest = hashlib.file_digest

    def no_hashing(*a, **k):
        raise AssertionError("re-hashed a file whose stat is unchanged")

    monkeypatch.setattr(hashlib, "file_digest", no_hashing)
    assert content_sha256(path) == hashlib.sha256(data.tobytes()).hexdigest()
    monkeypatch.setattr(hashlib, "file_digest", real_digest)
    # A same-size edit in place moves mtime.
    edited = data.copy()
    edited[2500] = 7
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(edited[2500:2501].tobytes())
    assert content_sha256(path) == hashlib.sha256(edited.tobytes()).hexdigest()
    # A new file of the same size renamed into place, with the cached mtime restored: a new inode.
    os.utime(path, ns=(old, old))
    assert content_sha256(path) == hashlib.sha256(edited.tobytes()).hexdigest()
    replaced = data.copy()
    replaced[100] = 9
    replaced.tofile(tmp_path / "new.npy")
    os.replace(tmp_path / "new.npy", path)
    os.utime(path, ns=(old, old))
    assert content_sha256(path) == hashlib.sha256(replaced.tobytes()).hexdigest()


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


def test_shard_chunk_cache_is_bounded_per_shard_and_in_all(tmp_path, monkeypatch):
    """Decompressed chunks are kept least recently used first out, at most _CACHE_CHUNKS of one
    shard and _CACHE_BYTES over all of them; `remote_ranges` of a local shard names nothing,
    `_ChunkCache.missing` says what a read would fetch. Counts derived by hand below."""
    import gc

    from olmo_data import shards

    # 100-token chunks of uint16 ids: 200 bytes each decompressed; room for 5 chunks in all.
    cache = shards._ChunkCache(per_source=4, max_bytes=1000)
    monkeypatch.setattr(shards, "_CHUNKS", cache)
    rng = np.random.default_rng(3)
    docs = [np.append(d, EOS) for d in _documents(rng, 60, 4096)]
    flat = np.concatenate(docs).astype(np.uint32)
    paths = []
    for name in ("a", "b"):
        with ShardWriter(tmp_path / f"{name}.shard", "uint16", chunk_tokens=100) as w:
            for d in docs:
                w.add_document(d)
        paths.append(tmp_path / f"{name}.shard")
    a, b = ShardSource(paths[0]), ShardSource(paths[1])
    assert a.remote_ranges(0, 1000) == []  # local: nothing to fetch ahead
    for i in range(6):  # chunks 0..5 of a: the first two are pushed out by the per-shard limit
        np.testing.assert_array_equal(a.read(100 * i, 100 * i + 100), flat[100 * i : 100 * i + 100])
    assert cache.missing(a._owner, range(6)) == [0, 1] and cache.nbytes == 800
    b.read(0, 100)  # 1000 bytes: at the limit
    assert cache.missing(a._owner, range(6)) == [0, 1] and cache.nbytes == 1000
    a.read(500, 510)  # a hit: chunk 5 of a becomes the most recently used
    b.read(100, 200)  # 1200 bytes: the least recently used chunk of any shard goes, a's chunk 2
    assert cache.missing(a._owner, range(6)) == [0, 1, 2] and cache.missing(b._owner, range(2)) == []
    assert cache.nbytes == 1000
    owner = b._owner
    del b
    gc.collect()  # a collected shard's chunks are freed with it
    assert cache.missing(owner, range(2)) == [0, 1] and cache.nbytes == 600

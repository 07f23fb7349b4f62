"""Mixture loading: validation errors (one line: file, field, fix) and the fingerprint."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_mixture_support import random_docs, two_source_mixture, write_mixture, write_raw, write_shard

from olmo_data import DataError, MixtureLoader, ShardCorruptError, load_mixture


def edit(path: Path, fn) -> Path:
    config = yaml.safe_load(path.read_text())
    fn(config)
    path.write_text(yaml.safe_dump(config))
    return path


def test_loads_and_resolves_relative_paths(tmp_path):
    m = load_mixture(two_source_mixture(tmp_path))
    assert m.source_names == ["code", "prose"]
    assert [Path(f).name for f in m.training_files[1]] == ["p0.shard", "p1.shard"]  # glob, sorted
    code_tokens = sum(len(d) for d in random_docs(1, 100))
    assert m.training_sources[0].num_tokens == code_tokens
    assert m.num_instances()[0] == code_tokens // 16
    total = sum(m.num_instances())
    assert m.slots_per_epoch() == [round(0.3 * total), total - round(0.3 * total)]
    assert list(m.held_out_sources) == ["heldout"]


def one_line_error(exc: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(exc.value)
    assert "\n" not in message
    for f in fragments:
        assert f in message, (f, message)


def test_unknown_key(tmp_path):
    path = edit(two_source_mixture(tmp_path), lambda c: c["sources"][0].update(ratoi=1))
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, str(path), "sources.0.ratoi", "unknown key")


def test_missing_file(tmp_path):
    path = edit(two_source_mixture(tmp_path), lambda c: c["sources"][0].update(paths=["code/nope.npy"]))
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, str(path), "sources.0.paths", "nope.npy", "not found")


def test_empty_glob(tmp_path):
    path = edit(two_source_mixture(tmp_path), lambda c: c["sources"][1].update(paths=["prose/*.zzz"]))
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, "sources.1.paths", "matches no file")


def test_wrong_dtype_raw(tmp_path):
    path = two_source_mixture(tmp_path)
    # 3 uint16 tokens = 6 bytes is not a whole number of uint32 ids
    write_raw(tmp_path / "code" / "a.npy", [np.array([5, 6, 0], np.uint32)])
    edit(path, lambda c: c["sources"][0].update(dtype="uint32"))
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, "a.npy", "not a multiple of 4", "uint16")


def test_wrong_dtype_shards(tmp_path):
    path = edit(two_source_mixture(tmp_path), lambda c: c["sources"][1].update(dtype="uint32"))
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, "p0.shard", "uint16", "uint32")


def test_id_beyond_vocab(tmp_path):
    path = edit(two_source_mixture(tmp_path), lambda c: c.update(vocab_size=1000))
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, ">= vocab_size 1000")


def test_all_zero_ratios(tmp_path):
    path = edit(two_source_mixture(tmp_path), lambda c: [s.update(ratio=0) for s in c["sources"]])
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, str(path), "all ratios are zero")


def test_ratio_and_tokens_not_mixed(tmp_path):
    path = edit(two_source_mixture(tmp_path), lambda c: c["sources"][0].update(ratio=None, tokens=99))
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, "every source a ratio, or every source a tokens target")


def test_sequence_longer_than_a_source(tmp_path):
    path = two_source_mixture(tmp_path, seq=7000)  # code has ~6.3k tokens
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, str(path), "sequence_length 7000 is longer than sources 'code'", "lower sequence_length")


def test_held_out_is_a_training_source(tmp_path):
    path = edit(two_source_mixture(tmp_path), lambda c: c["held_out"][0].update(paths=["prose/p1.shard"]))
    with pytest.raises(DataError) as e:
        load_mixture(path)
    one_line_error(e, "held_out 'heldout'", "p1.shard", "training source 'prose'")


def test_corrupt_zstd_chunk_is_named_when_read(tmp_path):
    path = two_source_mixture(tmp_path)
    shard = tmp_path / "prose" / "p0.shard"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF  # inside chunk 0 (the 8-byte magic, then the first zstd frame)
    shard.write_bytes(bytes(data))
    loader = MixtureLoader(load_mixture(path), 8)  # the manifest is intact: loading works
    with pytest.raises(ShardCorruptError) as e:
        for step in range(200):  # ~1600 instances: every window of the 1179-slot epoch
            loader.batch_at(step)
    one_line_error(e, "p0.shard", "chunk 0", "re-create")


def test_fingerprint_identity(tmp_path):
    a = two_source_mixture(tmp_path / "a")
    fp = load_mixture(a).fingerprint()
    # location, mtimes, name and seed do not change it
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert load_mixture(tmp_path / "b" / "mixture.yaml").fingerprint() == fp
    edit(tmp_path / "b" / "mixture.yaml", lambda c: c.update(name="renamed", seed=99))
    assert load_mixture(tmp_path / "b" / "mixture.yaml").fingerprint() == fp
    # a ratio, or shard content of the same size, does
    edit(a, lambda c: c["sources"][0].update(ratio=0.31))
    fp_ratio = load_mixture(a).fingerprint()
    assert fp_ratio != fp
    docs = random_docs(3, 100)
    docs[0] = docs[0].copy()
    docs[0][0] = 7 if docs[0][0] != 7 else 8
    write_shard(tmp_path / "a" / "prose" / "p1.shard", docs)
    assert load_mixture(a).fingerprint() != fp_ratio


def test_tokens_targets(tmp_path):
    write_raw(tmp_path / "x.npy", random_docs(1, 50))
    write_raw(tmp_path / "y.npy", random_docs(2, 50))
    sources = [
        {"name": "x", "paths": ["x.npy"], "format": "numpy", "dtype": "uint16", "tokens": 1600},
        {"name": "y", "paths": ["y.npy"], "format": "numpy", "dtype": "uint16", "tokens": 480},
    ]
    m = load_mixture(write_mixture(tmp_path, sources))
    assert m.slots_per_epoch() == [100, 30]  # tokens / sequence_length 16


def test_the_word_sample_names_the_embedded_sample(tmp_path, monkeypatch):
    path = two_source_mixture(tmp_path)
    monkeypatch.setattr("olmo_data.sample.sample_mixture_path", lambda: path)
    assert load_mixture("sample").path == path.resolve()

"""The embedded sample: builds, is cached, is well-formed, deterministic, and its held-out
split shares no 13-gram with training (checked with Python bytes sets, not ngrams.py)."""

from __future__ import annotations

import ast
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer

from olmo_data import sample
from olmo_data.sources import open_source


@pytest.fixture(scope="module")
def sample_path():
    # The shared cache (what load_mixture("sample") uses): built here on first use, else a hit.
    return sample.sample_mixture_path()


def _docs(source) -> list[np.ndarray]:
    bounds = [*source.doc_starts().tolist(), source.num_tokens]
    tokens = source.read(0, source.num_tokens)
    return [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def test_sample_mixture_and_tokenizer(sample_path):
    root = sample_path.parent
    mix = yaml.safe_load(sample_path.read_text())
    assert (mix["sequence_length"], mix["eos_token_id"], mix["vocab_size"]) == (512, 0, 4096)
    assert [s["name"] for s in mix["sources"]] == ["code", "prose"] == [s["name"] for s in mix["held_out"]]
    build = json.loads((root / "build.json").read_text())
    assert build["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert f"# content_fingerprint: {build['content_fingerprint']}" in sample_path.read_text()
    assert sample.content_fingerprint(root) == build["content_fingerprint"]

    tok = Tokenizer.from_file(str(root / mix["tokenizer"]))
    assert tok.get_vocab_size() == 4096
    assert (tok.id_to_token(0), tok.id_to_token(1)) == ("<|endoftext|>", "<|pad|>")

    for entry in mix["sources"] + mix["held_out"]:
        src = open_source([str(root / p) for p in entry["paths"]], entry["format"], vocab_size=4096)
        docs = _docs(src)
        # Every document ends with eos and holds no other eos.
        assert all(d[-1] == 0 and not (d[:-1] == 0).any() for d in docs), entry
    code = open_source(str(root / "code" / "*.shard"), "shards")
    assert code.num_tokens > 500_000
    first = tok.decode(_docs(code)[0][:-1].tolist())
    ast.parse(first)  # a code document decodes back to Python source


def test_sample_cache_hit(sample_path):
    before = (sample_path.parent / "build.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert sample.sample_mixture_path() == sample_path
    assert time.perf_counter() - t0 < 2.0
    assert (sample_path.parent / "build.json").stat().st_mtime_ns == before


def _windows(tokens: np.ndarray, n: int = 13) -> set[bytes]:
    raw = tokens.astype("<u4").tobytes()
    return {raw[4 * i : 4 * (i + n)] for i in range(len(tokens) - n + 1)}


def test_held_out_shares_no_13gram_with_training(sample_path):
    root = sample_path.parent
    training: set[bytes] = set()
    for name in ("code", "prose"):
        src = open_source(str(root / name / "*.shard"), "shards")
        training |= _windows(src.read(0, src.num_tokens))
    held_docs = 0
    for name in ("code", "prose"):
        for doc in _docs(open_source(str(root / "heldout" / name / "*.shard"), "shards")):
            held_docs += 1
            assert not _windows(doc) & training, f"held-out {name} doc shares a 13-gram with training"
    assert held_docs >= 10


def test_clean_fragments_cut_exactly_the_covered_tokens():
    n = sample.NGRAM
    train = np.arange(100, 100 + 2 * n, dtype=np.uint16)  # the training stream
    train_hashes = sample.unique_sorted(sample.ngram_hashes(train, n))
    left = np.arange(1000, 1000 + 80, dtype=np.uint16)
    right = np.arange(2000, 2000 + 70, dtype=np.uint16)
    copied = train[3 : 3 + n + 2]  # 15 training tokens: windows at offsets 0..2 are hits
    doc = np.concatenate([left, copied, right, [0]]).astype(np.uint16)
    fragments = sample._clean_fragments(doc, train_hashes)
    # Only the 15 copied tokens are covered; both sides survive with an eos each.
    assert [f.tolist() for f in fragments] == [left.tolist() + [0], right.tolist() + [0]]
    short = np.concatenate([left[:20], copied, right, [0]]).astype(np.uint16)
    assert [f.tolist() for f in sample._clean_fragments(short, train_hashes)] == [right.tolist() + [0]]


def test_tokenizer_training_is_deterministic():
    # A full rebuild into a second cache gives the same content fingerprint (checked by hand:
    # ~40 s on a loaded 2-core machine, too slow here); the part that could differ between
    # builds is the multi-threaded BPE training, so train twice on a slice of the sample text.
    texts = [path.read_text(encoding="utf-8") for _, path in sample._stdlib_modules()[:60]]
    first = sample.train_tokenizer(texts, vocab_size=1024).to_str()
    assert sample.train_tokenizer(texts, vocab_size=1024).to_str() == first


def test_cache_builds_once_under_concurrency_and_rebuilds_when_stale(tmp_path, monkeypatch):
    # The real build is exercised above; here a stand-in builder counts builds, so the
    # locking / rename / staleness logic can be checked in well under a second.
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path))
    builds = []

    def fake_build(target):
        builds.append(target)
        time.sleep(0.2)  # long enough for the other threads to reach the lock
        (target / "mixture.yaml").write_text("name: sample\n")
        record = {
            "version": sample.SAMPLE_VERSION,
            "python_version": sample.python_version(),
            "recipe": sample.recipe_hash(),
        }
        (target / "build.json").write_text(json.dumps(record))

    monkeypatch.setattr(sample, "build_sample", fake_build)
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: sample.sample_mixture_path(), range(4)))
    assert len(builds) == 1 and len(set(paths)) == 1
    assert paths[0] == tmp_path / sample.SAMPLE_VERSION / f"python-{sample.python_version()}" / "mixture.yaml"
    assert sorted(p.name for p in paths[0].parent.parent.iterdir()) == [".lock", paths[0].parent.name]

    record = json.loads((paths[0].parent / "build.json").read_text())
    (paths[0].parent / "build.json").write_text(json.dumps({**record, "python_version": "3.0.0"}))
    assert sample.sample_mixture_path() == paths[0]
    assert len(builds) == 2
    assert json.loads((paths[0].parent / "build.json").read_text())["python_version"] == sample.python_version()

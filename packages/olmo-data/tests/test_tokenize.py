"""`olmo-data tokenize` on local files: shards hold tokenizer(text) + eos per document, several
processes, resume skips finished shards, --shard-index/--num-shards jobs partition the docs."""

from __future__ import annotations

import gzip
import json
import sys

import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer

from olmo_data.errors import DataError
from olmo_data.sample import train_tokenizer
from olmo_data.shards import read_manifest
from olmo_data.sources import ShardSource
from olmo_data.tokenize import tokenize_main

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for i in range(n)]


@pytest.fixture
def corpus(tmp_path):
    """Three jsonl files (11, 6 and 9 documents) and a small tokenizer trained on them."""
    files = {}
    for name, n, seed in [("b.jsonl", 11, 1), ("a.jsonl", 6, 2), ("c.jsonl", 9, 3)]:
        texts = _texts(n, seed)
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / name).write_text(
            "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))
        )
        files[name] = texts
    tok = train_tokenizer([t for texts in files.values() for t in texts], vocab_size=300)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path, files


def _shard_docs(paths) -> dict[str, list[list[int]]]:
    """Documents of every shard, keyed by shard file name."""
    out = {}
    for p in sorted(paths):
        src = ShardSource(p)
        bounds = [*src.doc_starts().tolist(), src.num_tokens]
        out[p.name] = [src.read(a, b).tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    return out


def test_tokenize_jsonl_two_processes_and_resume(corpus):
    root, files = corpus
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    args = [
        "--input",
        str(root / "in" / "*.jsonl"),
        "--tokenizer",
        str(root / "tokenizer.json"),
        "--output",
        str(root / "out"),
        "--num-proc",
        "2",
        "--docs-per-shard",
        "4",
    ]
    assert tokenize_main(args) == 0
    shards = sorted((root / "out").glob("*.shard"))
    # 6, 11, 9 docs in parts of 4 -> 2 + 3 + 3 shards, named after their input file.
    assert [p.name for p in shards] == [
        "a.jsonl-00000.shard",
        "a.jsonl-00001.shard",
        "b.jsonl-00000.shard",
        "b.jsonl-00001.shard",
        "b.jsonl-00002.shard",
        "c.jsonl-00000.shard",
        "c.jsonl-00001.shard",
        "c.jsonl-00002.shard",
    ]
    docs = _shard_docs(shards)
    for p in shards:
        unit, part = p.stem.split("-")
        texts = files[unit][int(part) * 4 : int(part) * 4 + 4]
        expected = [tok.encode(t).ids + [0] for t in texts]  # eos = <|endoftext|> = 0
        assert docs[p.name] == expected
        assert read_manifest(p)["dtype"] == "uint16"

    mtimes = {p.name: p.stat().st_mtime_ns for p in shards}
    (root / "out" / "b.jsonl-00001.shard").unlink()
    assert tokenize_main(args) == 0
    again = sorted((root / "out").glob("*.shard"))
    assert [p.name for p in again] == [p.name for p in shards]
    for p in again:
        if p.name == "b.jsonl-00001.shard":
            assert _shard_docs([p])[p.name] == docs[p.name]
        else:
            assert p.stat().st_mtime_ns == mtimes[p.name], f"{p.name} was rewritten on resume"


def test_jobs_partition_the_documents(corpus):
    root, files = corpus
    jobs = []
    for i in range(2):
        out = root / f"job{i}"
        tokenize_main(
            [
                "--input",
                str(root / "in"),
                "--tokenizer",
                str(root / "tokenizer.json"),
                "--output",
                str(out),
                "--shard-index",
                str(i),
                "--num-shards",
                "2",
            ]
        )
        jobs.append([d for ds in _shard_docs(out.glob("*.shard")).values() for d in ds])
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    every = sorted(tok.encode(t).ids + [0] for texts in files.values() for t in texts)
    assert sorted(jobs[0] + jobs[1]) == every
    assert jobs[0] and jobs[1]
    assert not {tuple(d) for d in jobs[0]} & {tuple(d) for d in jobs[1]}


def test_txt_and_compressed_inputs(tmp_path, corpus):
    root, files = corpus
    texts = files["a.jsonl"]
    jsonl = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "a.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (tmp_path / "zst").mkdir()
    (tmp_path / "zst" / "a.json.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(t)
    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "all.txt").write_text("\n".join(texts) + "\n")
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    expected = [tok.encode(t).ids + [0] for t in texts]
    for src, extra in [("txt", []), ("lines", ["--txt-per-line"]), ("gz", []), ("zst", [])]:
        out = tmp_path / f"out-{src}"
        tokenize_main(
            ["--input", str(tmp_path / src), "--tokenizer", str(root / "tokenizer.json"), "--output", str(out), *extra]
        )
        got = [d for ds in _shard_docs(out.glob("*.shard")).values() for d in ds]
        assert got == expected


def test_bad_inputs(tmp_path, corpus, monkeypatch):
    root, _ = corpus
    tok = str(root / "tokenizer.json")
    for missing in [str(tmp_path / "nothing-here/x.jsonl"), "x.jsonl"]:
        with pytest.raises(DataError, match=f"--input {missing}: no such file"):
            tokenize_main(["--input", missing, "--tokenizer", tok, "--output", str(tmp_path / "o")])
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: no field 'text'; pass --text-field"):
        tokenize_main(["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", tok, "--output", str(tmp_path / "o")])
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the [tokenize] extra were not installed
    with pytest.raises(DataError, match="needs `datasets`.*--extra tokenize"):
        tokenize_main(["--input", "allenai/some-dataset", "--tokenizer", tok, "--output", str(tmp_path / "o")])
    with pytest.raises(DataError, match="--shard-index 2 is outside"):
        tokenize_main(
            [
                "--input",
                str(root / "in"),
                "--tokenizer",
                tok,
                "--output",
                str(tmp_path / "o"),
                "--shard-index",
                "2",
                "--num-shards",
                "2",
            ]
        )

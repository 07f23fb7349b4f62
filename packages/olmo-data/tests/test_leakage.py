"""Leakage check: planted held-out documents and a planted 13-token span are found and
named; clean data passes; allow=True logs; the report is cached by fingerprint."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from test_mixture_support import EOS, random_docs, write_mixture, write_raw, write_shard

from olmo_data import (
    LeakageError,
    assert_no_leakage,
    check_leakage,
    load_mixture,
    open_training_mixture,
)
from olmo_data.leakage import cache_path


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))


HELD = random_docs(40, 30, min_len=20, max_len=80)


def build(folder: Path, code_docs, prose_docs=None, max_fraction=0.0) -> Path:
    write_raw(folder / "code.npy", code_docs)
    write_shard(folder / "prose.shard", prose_docs or random_docs(2, 60))
    write_shard(folder / "held.shard", HELD)
    sources = [
        {"name": "code", "paths": ["code.npy"], "format": "numpy", "dtype": "uint16", "ratio": 0.5},
        {"name": "prose", "paths": ["prose.shard"], "format": "shards", "ratio": 0.5},
    ]
    held = [{"name": "wiki", "paths": ["held.shard"], "format": "shards"}]
    return write_mixture(folder, sources, held, leakage={"ngram": 13, "max_doc_overlap_fraction": max_fraction})


def test_clean_data_passes(tmp_path):
    m = load_mixture(build(tmp_path, random_docs(1, 60)))
    report = assert_no_leakage(m)
    (h,) = report.held_out
    assert (h.source, h.docs_checked, h.contaminated_docs, h.fraction) == ("wiki", 30, [], 0.0)
    assert report.training_tokens == m.training_sources[0].num_tokens + m.training_sources[1].num_tokens


def test_planted_documents_are_refused_and_named(tmp_path):
    code = random_docs(1, 60)
    code.insert(17, HELD[5])  # exact copies, as whole training documents
    prose = random_docs(2, 60)
    prose.insert(3, HELD[22])
    m = load_mixture(build(tmp_path, code, prose))
    report = check_leakage(m)
    (h,) = report.held_out
    assert [(x["doc"], x["training_source"], x["training_doc"]) for x in h.exact_matches] == [
        (5, "code", 17),
        (22, "prose", 3),
    ]
    assert h.contaminated_docs == [5, 22] and h.fraction == pytest.approx(2 / 30)
    offset = sum(len(d) for d in code[:17])
    assert h.exact_matches[0]["training_offset"] == offset
    with pytest.raises(LeakageError) as e:
        assert_no_leakage(m)
    msg = str(e.value)
    assert "held_out 'wiki'" in msg
    assert "doc 5 (exact copy in 'code' doc 17" in msg and "doc 22 (exact copy in 'prose' doc 3" in msg


def test_a_single_13_token_span_is_found(tmp_path):
    code = random_docs(1, 60)
    span = HELD[9][30:43]  # 13 tokens from the middle of held-out doc 9
    code[40] = np.concatenate([code[40][:4], span, code[40][4:]])
    m = load_mixture(build(tmp_path, code))
    (h,) = check_leakage(m).held_out
    assert h.exact_matches == []
    assert [(x["doc"], x["training_source"], x["training_doc"]) for x in h.ngram_hits] == [(9, "code", 40)]
    assert h.ngram_hits[0]["training_offset"] == sum(len(d) for d in code[:40]) + 4
    with pytest.raises(LeakageError, match=r"doc 9 \(13-gram in 'code' doc 40"):
        assert_no_leakage(m)


def test_twelve_tokens_are_not_a_hit(tmp_path):
    code = random_docs(1, 60)
    code[40] = np.concatenate([code[40][:4], HELD[9][30:42], code[40][4:]])
    assert check_leakage(load_mixture(build(tmp_path, code))).held_out[0].contaminated_docs == []


def test_exact_copy_of_a_short_document(tmp_path, monkeypatch):
    short = np.array([77, 78, 79, EOS], np.uint32)  # shorter than 13 tokens: no n-gram at all
    monkeypatch.setattr(sys.modules[__name__], "HELD", [*HELD, short])
    code = random_docs(1, 60)
    code.insert(8, short)
    (h,) = check_leakage(load_mixture(build(tmp_path, code))).held_out
    assert [(x["doc"], x["training_doc"]) for x in h.exact_matches] == [(30, 8)]


def test_allow_logs_and_threshold(tmp_path, caplog):
    code = random_docs(1, 60)
    code.insert(17, HELD[5])
    m = load_mixture(build(tmp_path / "a", code))
    with caplog.at_level(logging.WARNING, logger="olmo_data.leakage"):
        assert_no_leakage(m, allow=True)
    assert any("LEAKAGE ALLOWED" in r.message and "doc 5" in r.message for r in caplog.records)
    # 1/30 contaminated is within a 5% budget
    m = load_mixture(build(tmp_path / "b", code, max_fraction=0.05))
    assert assert_no_leakage(m).held_out[0].fraction == pytest.approx(1 / 30)


def test_report_is_cached_by_fingerprint(tmp_path, monkeypatch):
    m = load_mixture(build(tmp_path, random_docs(1, 60)))
    report = check_leakage(m)
    path = cache_path(m)
    assert path.is_file() and m.fingerprint() in path.name
    assert json.loads(path.read_text())["fingerprint"] == m.fingerprint()

    def fail(*a, **k):
        raise AssertionError("rescanned despite the cache")

    monkeypatch.setattr("olmo_data.leakage._scan_source", fail)
    assert check_leakage(m) == report


def test_same_size_edit_in_the_middle_of_a_raw_file_is_caught_on_the_next_run(tmp_path):
    # ~93k uint16 tokens (~186 KB): the middle lies beyond the first and last 64 KiB.
    code = random_docs(1, 1500)
    path = build(tmp_path, code)
    first = load_mixture(path)
    open_training_mixture(path)  # clean: passes, and caches the verdict under the fingerprint
    assert cache_path(first).is_file()
    # Plant held-out doc 5 in the middle of code.npy, overwriting as many tokens (size and
    # both ends unchanged), in place as an editor or a bad merge would.
    tokens = np.fromfile(tmp_path / "code.npy", np.uint16)
    at = tokens.size // 2
    assert 2 * at >= 1 << 16 and 2 * (tokens.size - at - len(HELD[5])) >= 1 << 16
    with open(tmp_path / "code.npy", "r+b") as f:
        f.seek(2 * at)
        f.write(HELD[5].astype(np.uint16).tobytes())
    second = load_mixture(path)
    assert second.training_sources[0].num_tokens == tokens.size
    assert second.fingerprint() != first.fingerprint()
    with pytest.raises(LeakageError, match=r"held_out 'wiki': 1/30 documents .* doc 5 \(13-gram in 'code'"):
        open_training_mixture(path)
    (h,) = check_leakage(second).held_out
    assert h.contaminated_docs == [5]
    assert h.ngram_hits[0]["training_offset"] == at  # its first 13-gram starts where it was planted

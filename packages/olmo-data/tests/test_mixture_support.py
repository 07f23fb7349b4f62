"""Builders shared by the mixture/order/loader/leakage/cli tests: random EOS-terminated
documents written as raw OLMo token files or zstd shards, and a mixture YAML over them.
(Other test modules import this file by path: pytest runs with --import-mode=importlib.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from olmo_data.shards import ShardWriter

EOS = 0
VOCAB = 4096


def random_docs(seed: int, num_docs: int, min_len: int = 5, max_len: int = 120) -> list[np.ndarray]:
    """Documents of ids in [2, VOCAB), each ending with EOS (as Dolma writes them)."""
    rng = np.random.default_rng(seed)
    docs = []
    for length in rng.integers(min_len, max_len, size=num_docs):
        docs.append(np.append(rng.integers(2, VOCAB, size=length - 1), EOS).astype(np.uint32))
    return docs


def write_raw(path: Path, docs: list[np.ndarray], dtype: str = "uint16") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.concatenate(docs).astype(dtype).tofile(path)
    return path


def write_shard(path: Path, docs: list[np.ndarray], chunk_tokens: int = 1000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with ShardWriter(path, "uint16", chunk_tokens=chunk_tokens) as w:
        for d in docs:
            w.add_document(d)
    return path


def write_mixture(folder: Path, sources: list[dict], held_out: list[dict] | None = None, **top) -> Path:
    """A mixture YAML in `folder` with defaults for everything but the sources."""
    config = {
        "name": "test",
        "sequence_length": 16,
        "seed": 1234,
        "eos_token_id": EOS,
        "vocab_size": VOCAB,
        "sources": sources,
        "held_out": held_out or [],
        "eval": {"sequences_per_source": 4},
        **top,
    }
    path = folder / "mixture.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def two_source_mixture(folder: Path, ratios=(0.3, 0.7), seq: int = 16, **top) -> Path:
    """Raw-file source 'code' (~6k tokens) and shard source 'prose' (~12k tokens, 2 files)
    plus a held-out shard 'heldout'."""
    write_raw(folder / "code" / "a.npy", random_docs(1, 100))
    write_shard(folder / "prose" / "p0.shard", random_docs(2, 100))
    write_shard(folder / "prose" / "p1.shard", random_docs(3, 100))
    write_shard(folder / "heldout" / "h.shard", random_docs(4, 40))
    sources = [
        {"name": "code", "paths": ["code/a.npy"], "format": "numpy", "dtype": "uint16", "ratio": ratios[0]},
        {"name": "prose", "paths": ["prose/*.shard"], "format": "shards", "ratio": ratios[1]},
    ]
    held = [{"name": "heldout", "paths": ["heldout/h.shard"], "format": "shards"}]
    return write_mixture(folder, sources, held, sequence_length=seq, **top)

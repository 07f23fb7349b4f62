"""Neither trainer trains on an id outside the vocabulary, whatever a shard's manifest claims.

A shard whose manifest understates its largest id (written here by rewriting the manifest in
the layout ``olmo_data.shards`` documents, so every chunk checksum still matches) passes the
up-front vocab check; its first batch is refused by the loader's per-batch id check, before
that step runs: one line, exit 2, no step logged and no checkpoint written. Before that check,
JAX trained on NaN (its embedding gather fills out-of-range rows with NaN) and torch crashed.
"""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from olmo_data.shards import ShardWriter, read_manifest
from olmo_run.checkpoints import complete_checkpoints

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 4096
FOOTER = struct.Struct("<Q8s")  # u64 manifest length, b"OLMOSHDE" (olmo_data.shards' docstring)


def _docs(rng: np.random.Generator, n: int, out_of_vocab: bool) -> list[np.ndarray]:
    docs = []
    for _ in range(n):
        d = rng.integers(1, VOCAB, int(rng.integers(30, 120))).astype(np.uint16)
        if out_of_vocab:
            d[::8] = 5000  # any window of 8 tokens of these documents holds one
        docs.append(np.append(d, 0))
    return docs


def _write(path: Path, docs: list[np.ndarray]) -> Path:
    with ShardWriter(path, "uint16") as w:
        for d in docs:
            w.add_document(d)
    return path


def _forge_max_token_id(shard: Path, max_token_id: int) -> None:
    data = shard.read_bytes()
    length, magic = FOOTER.unpack(data[-FOOTER.size :])
    manifest = read_manifest(shard)
    manifest["max_token_id"] = max_token_id
    blob = json.dumps(manifest, sort_keys=True).encode()
    shard.write_bytes(data[: len(data) - FOOTER.size - length] + blob + FOOTER.pack(len(blob), magic))


@pytest.fixture(scope="module")
def forged_mixture(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("forged")
    rng = np.random.default_rng(0)
    _write(root / "clean.shard", _docs(rng, 300, False))
    _forge_max_token_id(_write(root / "forged.shard", _docs(rng, 300, True)), VOCAB - 1)
    _write(root / "held.shard", _docs(rng, 40, False))
    assert read_manifest(root / "forged.shard")["max_token_id"] == VOCAB - 1
    (root / "mixture.yaml").write_text(
        f"name: forged\nsequence_length: 64\nseed: 1\neos_token_id: 0\nvocab_size: {VOCAB}\n"
        "sources:\n  - {name: clean, paths: [clean.shard], format: shards, ratio: 0.5}\n"
        "  - {name: forged, paths: [forged.shard], format: shards, ratio: 0.5}\n"
        "held_out:\n  - {name: held, paths: [held.shard], format: shards}\n"
        "eval: {sequences_per_source: 4}\n"
    )
    return root / "mixture.yaml"


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_forged_manifest_is_refused_before_the_step_that_reads_it(framework, forged_mixture, tmp_path, capsys):
    main = importlib.import_module(f"olmo_train_{framework}.cli").main
    run_dir = tmp_path / "run"
    args = [
        "--model=tiny",
        "--train.global_batch_tokens=1024",
        "--train.steps=4",
        "--train.precision=fp32",
        "--log.progress=false",
        "--torch.parallel=none",
        f"--data.mixture={forged_mixture}",
        f"--run_dir={run_dir}",
    ]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{forged_mixture.parent / 'forged.shard'}: token id 5000" in err and "vocab_size 4096" in err, err
    # Half the mixture is the forged source, so global batch 0 reads it: step 1 never ran.
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not [line for line in metrics.read_text().splitlines() if '"train"' in line]
    assert complete_checkpoints(run_dir) == []

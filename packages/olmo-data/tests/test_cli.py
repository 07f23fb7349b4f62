"""The olmo-data CLI: inspect numbers, batch digests (ranks add up to the global digest),
check-leakage exit codes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from test_mixture_support import random_docs, two_source_mixture, write_shard

from olmo_data import load_mixture
from olmo_data.cli import main
from olmo_data.digest import combine_digests


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))


def run(capsys, *argv) -> tuple[int, str]:
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().out


def reference_digest(batch, step, first_row):
    """The documented digest, from its definition: sum of per-row sha256 mod 2**256."""
    total = 0
    for r in range(batch["input_ids"].shape[0]):
        data = np.array([step, first_row + r], "<i8").tobytes()
        for k in ("input_ids", "labels", "doc_ids", "positions"):
            data += batch[k][r].astype("<i4").tobytes()
        total += int(hashlib.sha256(data).hexdigest(), 16)
    return format(total % 2**256, "064x")


def test_batch_digests_of_two_ranks_combine_to_the_global_digest(tmp_path, capsys):
    path = two_source_mixture(tmp_path)
    status, out = run(capsys, "batches", path, "--start", 3, "--count", 4, "--global-batch", 8, "--digest")
    assert status == 0
    lines = [line.split() for line in out.splitlines()]
    assert [int(s) for s, _ in lines] == [3, 4, 5, 6]
    order = load_mixture(path).order
    for step, digest in lines:
        assert digest == reference_digest(order.global_batch(int(step), 8), int(step), 0)
    per_rank = []
    for rank in (0, 1):
        _, out = run(
            capsys,
            "batches",
            path,
            "--start",
            3,
            "--count",
            4,
            "--global-batch",
            8,
            "--dp-size",
            2,
            "--dp-rank",
            rank,
            "--digest",
        )
        per_rank.append([line.split()[1] for line in out.splitlines()])
    assert [combine_digests([a, b]) for a, b in zip(*per_rank)] == [d for _, d in lines]
    assert per_rank[0] != per_rank[1]


def test_inspect_json(tmp_path, capsys):
    path = two_source_mixture(tmp_path)
    status, out = run(capsys, "inspect", path, "--json")
    info = json.loads(out)
    code_tokens = sum(len(d) for d in random_docs(1, 100))
    prose_tokens = sum(len(d) for d in random_docs(2, 100)) + sum(len(d) for d in random_docs(3, 100))
    assert status == 0 and info["fingerprint"] == load_mixture(path).fingerprint()
    code, prose = info["sources"]
    assert (code["tokens"], code["docs"], code["instances"]) == (code_tokens, 100, code_tokens // 16)
    assert (prose["tokens"], prose["files"], prose["instances"]) == (prose_tokens, 2, prose_tokens // 16)
    total = code_tokens // 16 + prose_tokens // 16
    assert info["instances_per_mixture_epoch"] == total
    assert code["target_ratio"] == pytest.approx(0.3)
    assert code["realised_ratio"] == pytest.approx(round(0.3 * total) / total)
    assert code["source_epochs_per_mixture_epoch"] == pytest.approx(round(0.3 * total) / (code_tokens // 16))
    assert info["held_out"][0]["name"] == "heldout"


def test_check_leakage_exit_codes(tmp_path, capsys):
    path = two_source_mixture(tmp_path)
    assert run(capsys, "check-leakage", path)[0] == 0
    held = random_docs(4, 40)
    write_shard(tmp_path / "prose" / "p2.shard", [held[3]])  # plant a held-out document
    status, out = run(capsys, "check-leakage", path, "--json")
    assert status == 1
    assert [m["doc"] for m in json.loads(out)["held_out"][0]["exact_matches"]] == [3]
    assert run(capsys, "check-leakage", path, "--allow")[0] == 0


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    status = main(["inspect", str(tmp_path / "missing.yaml")])
    err = capsys.readouterr().err
    assert status == 2 and "missing.yaml: mixture file not found" in err


def test_console_script_runs(tmp_path):
    path = two_source_mixture(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "olmo_data.cli", "batches", str(path), "--count", "2", "--digest"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert len(out.splitlines()) == 2

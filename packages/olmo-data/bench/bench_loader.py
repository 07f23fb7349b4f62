"""Loader throughput: MixtureLoader vs a plain Grain pipeline and OLMo-core's numpy loader over
the same files, from zstd shards (two chunk sizes) and from raw OLMo token files; plus the
leakage check's tokens/s per core.

    uv run --frozen python packages/olmo-data/bench/bench_loader.py [--tokens 33554432] [--batches 40]
        [--chunk-tokens 1048576 65536] [--threads 2]

Sequence 4096, 64 sequences per global batch (one rank), 2 training sources mixed 50/50,
uint16 ids drawn at random in [2, 4096) with ~1k-token documents (random ids barely
compress, so the shards are close to the raw size: a pessimistic case for zstd). Every
contender hands out whole batches of token arrays and nothing else is done with them (no
training); each is timed over ``--batches`` batches after one warm-up batch, one after the
other. Reader configuration, each the natural one for a 2-core host:

- MixtureLoader: Grain under the hood, ``prefetch=--threads`` reader threads.
- plain Grain: ``MapDataset.source -> shuffle -> mix -> batch`` over the same windows,
  ``ReadOptions(num_threads=--threads)``; builds no labels/doc ids/positions, checks nothing:
  the floor our order + document bookkeeping sits on.
- OLMo-core (ai2-olmo-core from PyPI, raw files only: it has no compressed format):
  ``NumpyFSLDatasetConfig`` + ``NumpyDataLoaderConfig(num_workers=0, num_threads=--threads)``,
  run by tools/bench/olmo_core/loader_peer.py in its own isolated uv env (it pins torch 2.13,
  so it cannot join this workspace) and read back as one JSON line. It concatenates the two
  files and shuffles instances globally (its plain path has no per-source ratios); with
  equal-size sources that is the same 50/50 mix in expectation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import grain
import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from olmo_data import MixtureLoader, check_leakage, load_mixture
from olmo_data.shards import ShardWriter

REPO = Path(__file__).resolve().parents[3]
OLMO_CORE_PEER = REPO / "tools" / "bench" / "olmo_core" / "loader_peer.py"
SEQ = 4096  # sequence length of every figure
BATCH = 64  # sequences per global batch
EOS = 0


def write_data(root: Path, tokens: int, chunk_sizes: list[int]) -> None:
    """Two training sources (raw + one shard copy per chunk size of each) and a small held-out shard."""
    rng = np.random.default_rng(0)
    for name in ("code", "prose"):
        ids = rng.integers(2, 4096, size=tokens // 2, dtype=np.uint16)
        ids[rng.random(ids.size) < 1 / 1000] = EOS  # ~1k-token documents
        ids[-1] = EOS
        ids.tofile(root / f"{name}.npy")
        starts = np.concatenate([[0], np.flatnonzero(ids == EOS)[:-1] + 1])
        for chunk in chunk_sizes:
            with ShardWriter(root / f"{name}-{chunk}.shard", "uint16", chunk_tokens=chunk) as w:
                for a, b in zip(starts, np.append(starts[1:], ids.size)):
                    w.add_document(ids[a:b])
    held = rng.integers(2, 4096, size=SEQ * 20, dtype=np.uint16)
    held[rng.random(held.size) < 1 / 1000] = EOS
    held[-1] = EOS
    with ShardWriter(root / "held.shard", "uint16") as w:
        w.add_document(held)
    layouts = [(f"shards-{c}", "shards", f"-{c}.shard") for c in chunk_sizes] + [("numpy", "numpy", ".npy")]
    for label, fmt, suffix in layouts:
        extra = {"dtype": "uint16"} if fmt == "numpy" else {}
        config = {
            "name": f"bench-{label}",
            "sequence_length": SEQ,
            "seed": 0,
            "eos_token_id": EOS,
            "vocab_size": 4096,
            "sources": [
                {"name": n, "paths": [f"{n}{suffix}"], "format": fmt, "ratio": 0.5, **extra} for n in ("code", "prose")
            ],
            "held_out": [{"name": "held", "paths": ["held.shard"], "format": "shards"}],
            "eval": {"sequences_per_source": 4},
        }
        (root / f"{label}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def time_batches(iterator, batches: int) -> float:
    """Tokens per second over `batches` batches, after one warm-up batch."""
    next(iterator)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH * SEQ / (time.perf_counter() - t0)


class _Windows:
    """Grain random-access source: window i of a TokenSource as int32."""

    def __init__(self, source) -> None:
        self.source = source

    def __len__(self) -> int:
        return self.source.num_tokens // SEQ

    def __getitem__(self, i: int) -> np.ndarray:
        return self.source.read(i * SEQ, (i + 1) * SEQ).astype(np.int32)


def plain_grain(mixture, threads: int):
    parts = [grain.MapDataset.source(_Windows(s)).shuffle(seed=0) for s in mixture.training_sources]
    ds = grain.MapDataset.mix(parts, [0.5, 0.5]).batch(BATCH)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * threads)))


def olmo_core_peer(root: Path, batches: int, threads: int) -> dict | str:
    """OLMo-core's tokens/s over the raw files, from its own env; a string saying why on failure."""
    uv = shutil.which("uv")
    if uv is None:
        return "not measured: `uv` is not on PATH (it builds the isolated OLMo-core env)"
    cmd = [
        uv,
        "run",
        "--isolated",
        "--no-project",
        "--python",
        "3.11",
        "--with",
        "ai2-olmo-core",
        "python",
        str(OLMO_CORE_PEER),
        "--paths",
        str(root / "code.npy"),
        str(root / "prose.npy"),
        "--dtype",
        "uint16",
        "--sequence-length",
        str(SEQ),
        "--batch",
        str(BATCH),
        "--batches",
        str(batches),
        "--threads",
        str(threads),
        "--vocab-size",
        "4096",
        "--eos",
        str(EOS),
        "--work-dir",
        str(root / "olmo-core"),
    ]
    # Our own venv must not leak into the peer's interpreter.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    except subprocess.TimeoutExpired:
        return "not measured: the OLMo-core peer ran past 30 minutes"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode in (137, -9):
        return "not measured: the OLMo-core process was killed (SIGKILL: out of memory?)"
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"not measured: the OLMo-core env failed (exit {proc.returncode}: {why[:160]})"
    return json.loads(lines[-1])


def _chunk_label(chunk: int) -> str:
    return f"{chunk >> 20}M" if chunk % (1 << 20) == 0 else f"{chunk >> 10}k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 25, help="training tokens written (two sources)")
    parser.add_argument("--batches", type=int, default=40, help="timed global batches per row")
    parser.add_argument("--threads", type=int, default=2, help="reader threads of every contender")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        nargs="+",
        default=[1 << 20, 1 << 16],
        help="zstd shard chunk sizes to compare (tokens per chunk)",
    )
    args = parser.parse_args()
    console = Console(width=120)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_data(root, args.tokens, args.chunk_tokens)
        console.print(
            f"wrote {args.tokens:,} tokens as raw files + {len(args.chunk_tokens)} shard sets "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        for chunk in args.chunk_tokens:
            mixture = load_mixture(root / f"shards-{chunk}.yaml")
            ours = time_batches(iter(MixtureLoader(mixture, BATCH, prefetch=args.threads)), args.batches)
            plain = time_batches(plain_grain(mixture, args.threads), args.batches)
            rows.append((f"zstd shards, {_chunk_label(chunk)}-token chunks", ours, plain, "n/a (no compressed format)"))
        mixture = load_mixture(root / "numpy.yaml")
        ours = time_batches(iter(MixtureLoader(mixture, BATCH, prefetch=args.threads)), args.batches)
        plain = time_batches(plain_grain(mixture, args.threads), args.batches)
        peer = olmo_core_peer(root, args.batches, args.threads)
        rows.append(("raw token files (memmap)", ours, plain, peer))
        mixture = load_mixture(root / f"shards-{args.chunk_tokens[0]}.yaml")
        os.environ["OLMO_CACHE"] = str(root / "cache")
        t0 = time.perf_counter()
        report = check_leakage(mixture, use_cache=False)
        leak_seconds = time.perf_counter() - t0
    table = Table(
        "source format",
        "MixtureLoader tok/s",
        "plain Grain tok/s",
        "OLMo-core tok/s",
        "ours / Grain",
        "ours / OLMo-core",
        title=f"loader throughput: seq {SEQ}, {BATCH} seq/batch, {args.threads} reader threads each, 1 rank",
    )
    for label, ours, plain, peer in rows:
        if isinstance(peer, dict):
            peer_cells = (f"{peer['tokens_per_second']:,.0f}", f"{ours / peer['tokens_per_second']:.2f}")
        else:
            peer_cells = (peer, "")
        table.add_row(label, f"{ours:,.0f}", f"{plain:,.0f}", peer_cells[0], f"{ours / plain:.2f}", peer_cells[1])
    console.print(table)
    peer = rows[-1][3]
    if isinstance(peer, dict):
        console.print(
            f"OLMo-core {peer['olmo_core']} (torch {peer['torch']}): num_workers={peer['num_workers']}, "
            f"num_threads={peer['num_threads']}, {peer['instances']:,} instances, "
            f"index build {peer['setup_s']:.2f} s (not timed)"
        )
    console.print(
        f"leakage check ({report.ngram}-grams, {report.training_tokens:,} training tokens from shards, "
        f"single-threaded numpy): {report.training_tokens / leak_seconds:,.0f} tokens/s per core"
    )


if __name__ == "__main__":
    main()

"""Loader throughput: MixtureLoader vs a plain Grain pipeline over the same files, from zstd
shards and from raw OLMo token files; plus the leakage check's tokens/s per core.

    uv run --frozen python packages/olmo-data/bench/bench_loader.py [--tokens 33554432] [--batches 40]

Sequence 4096, 64 sequences per global batch (one rank), 2 training sources mixed 50/50,
uint16 ids drawn at random in [2, 4096) with ~1k-token documents (random ids barely
compress, so the shards are close to the raw size: a pessimistic case for zstd). The
plain Grain pipeline reads the same windows (MapDataset.source -> shuffle -> mix ->
batch, same thread count) but builds no labels/doc ids/positions and checks nothing: it
is the floor our order + document bookkeeping sits on. ai2-olmo-core's numpy loader is
measured only if `import olmo_core` works (it is not a dependency of this workspace).
"""

from __future__ import annotations

import argparse
import os
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

SEQ = 4096  # sequence length of every figure
BATCH = 64  # sequences per global batch
EOS = 0


def write_data(root: Path, tokens: int) -> None:
    """Two training sources (raw + shard copies of each) and a small held-out shard."""
    rng = np.random.default_rng(0)
    for name in ("code", "prose"):
        ids = rng.integers(2, 4096, size=tokens // 2, dtype=np.uint16)
        ids[rng.random(ids.size) < 1 / 1000] = EOS  # ~1k-token documents
        ids[-1] = EOS
        ids.tofile(root / f"{name}.npy")
        with ShardWriter(root / f"{name}.shard", "uint16") as w:
            starts = np.concatenate([[0], np.flatnonzero(ids == EOS)[:-1] + 1])
            for a, b in zip(starts, np.append(starts[1:], ids.size)):
                w.add_document(ids[a:b])
    held = rng.integers(2, 4096, size=SEQ * 20, dtype=np.uint16)
    held[rng.random(held.size) < 1 / 1000] = EOS
    held[-1] = EOS
    with ShardWriter(root / "held.shard", "uint16") as w:
        w.add_document(held)
    for fmt, ext in (("shards", "shard"), ("numpy", "npy")):
        extra = {"dtype": "uint16"} if fmt == "numpy" else {}
        config = {
            "name": f"bench-{fmt}", "sequence_length": SEQ, "seed": 0, "eos_token_id": EOS, "vocab_size": 4096,
            "sources": [{"name": n, "paths": [f"{n}.{ext}"], "format": fmt, "ratio": 0.5, **extra}
                        for n in ("code", "prose")],
            "held_out": [{"name": "held", "paths": ["held.shard"], "format": "shards"}],
            "eval": {"sequences_per_source": 4},
        }
        (root / f"{fmt}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 25, help="training tokens written (two sources)")
    parser.add_argument("--batches", type=int, default=40, help="timed global batches per row")
    parser.add_argument("--threads", type=int, default=2, help="Grain reader threads (both pipelines)")
    args = parser.parse_args()
    console = Console(width=120)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_data(root, args.tokens)
        console.print(f"wrote {args.tokens:,} tokens x 2 formats in {time.perf_counter() - t0:.1f} s")
        for fmt in ("shards", "numpy"):
            mixture = load_mixture(root / f"{fmt}.yaml")
            ours = time_batches(iter(MixtureLoader(mixture, BATCH, prefetch=args.threads)), args.batches)
            plain = time_batches(plain_grain(mixture, args.threads), args.batches)
            rows.append((fmt, ours, plain))
        try:
            import olmo_core  # noqa: F401

            olmo_core_note = "olmo_core is importable, but this script has no adapter for it yet"
        except ImportError:
            olmo_core_note = "ai2-olmo-core's numpy loader: not measured (`import olmo_core` fails: not installed)"
        mixture = load_mixture(root / "shards.yaml")
        os.environ["OLMO_CACHE"] = str(root / "cache")
        t0 = time.perf_counter()
        report = check_leakage(mixture, use_cache=False)
        leak_seconds = time.perf_counter() - t0
    table = Table("source format", "MixtureLoader tok/s", "plain Grain tok/s", "ratio ours/plain",
                  title=f"loader throughput: seq {SEQ}, {BATCH} seq/batch, {args.threads} threads, 1 rank")
    for fmt, ours, plain in rows:
        table.add_row(fmt, f"{ours:,.0f}", f"{plain:,.0f}", f"{ours / plain:.2f}")
    console.print(table)
    console.print(olmo_core_note)
    console.print(
        f"leakage check ({report.ngram}-grams, {report.training_tokens:,} training tokens from shards, "
        f"single-threaded numpy): {report.training_tokens / leak_seconds:,.0f} tokens/s per core"
    )


if __name__ == "__main__":
    main()

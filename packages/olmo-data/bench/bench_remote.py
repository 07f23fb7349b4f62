"""Training batches from object storage against the same files on local disk, side by side in one
run: tokens/s of each and the bytes fetched per batch against the bytes of the tokens used.

    uv run --frozen python packages/olmo-data/bench/bench_remote.py [--tokens 8388608] [--batches 20]
        [--chunk-tokens 1048576 65536 8192] [--threads 2] [--out FILE]

The data are bench_loader.py's (two sources mixed 50/50, random uint16 ids, ~1k-token
documents, sequence 4096), here 16 sequences per global batch (65,536 tokens, 128 KiB of
uint16 ids). The remote copy sits in moto's S3 server, started as its own process on 127.0.0.1
behind the byte-counting relay of tests/support/object_store.py; the loader reads it through
``olmo_data.fileio`` (s3fs) with ``AWS_ENDPOINT_URL`` pointing at the relay, exactly as a run
reads a real bucket. What is counted is every byte the server sends back, HTTP headers
included, from opening the mixture (the YAML, shard indexes) to the last batch, divided by the
batches read.

What the figures can and cannot say: the emulator (a Python web server) shares the host's
cores with the reader, and there is no network latency, so the remote rate here is a floor on
the client's own cost (request handling, one ranged GET per read), not a cloud figure. The
bytes per batch do carry over: they are set by the reads the loader asks for. A zstd shard is
read a whole chunk at a time (a chunk is the unit of compression), so a window costs its
chunk's compressed size unless the chunk is still in the reader's cache; raw token files are
read by the window's exact byte range.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from datetime import date
from pathlib import Path

from bench_loader import EOS, SEQ, write_data  # noqa: F401  (same data as the loader bench)

from olmo_data import MixtureLoader, load_mixture

REPO = Path(__file__).resolve().parents[3]
BATCH = 16  # sequences per global batch


def object_store_support():
    """tests/support/object_store.py: the emulator and the counting relay the tests use."""
    spec = importlib.util.spec_from_file_location("object_store", REPO / "tests" / "support" / "object_store.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["object_store"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def read_batches(mixture_path: str, batches: int, threads: int, served=lambda: 0) -> tuple[float, float, int, int]:
    """(tokens/s over `batches` batches after one warm-up batch, seconds to open the mixture and
    read the warm-up batch, bytes `served()` counted by then, and during the timed batches)."""
    t0 = time.perf_counter()
    loader = MixtureLoader(load_mixture(mixture_path), BATCH, prefetch=threads)
    it = iter(loader)
    next(it)
    opened, open_bytes = time.perf_counter() - t0, served()
    t1 = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches * BATCH * SEQ / (time.perf_counter() - t1)
    it.close()
    return rate, opened, open_bytes, served() - open_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 2**20, help="tokens per training source")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[2**20, 2**16, 2**13])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / f"{date.today()}-remote.md")
    args = ap.parse_args()

    support = object_store_support()
    # moto's server in a process of its own, so its request handling does not hold this
    # process's GIL while the loader's threads wait on it.
    port = support.free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    emulator = support.S3Emulator.__new__(support.S3Emulator)  # its client helpers, not its thread
    emulator.port, emulator.direct_endpoint = port, f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(emulator.direct_endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    proxy = support.CountingProxy(emulator.port)
    home = Path(tempfile.mkdtemp())
    for name in list(os.environ):
        if name.startswith(support.CLOUD_ENV_PREFIXES):
            del os.environ[name]
    os.environ.update(emulator.environment(proxy.endpoint, home))
    bucket = f"olmo-bench-{uuid.uuid4().hex[:8]}"
    emulator.create_bucket(bucket)
    store = support.ObjectStore(emulator, bucket, proxy)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_data(root, 2 * args.tokens, args.chunk_tokens)
        prefix = store.upload_tree(root, "bench")
        used_bytes = BATCH * SEQ * 2  # uint16 ids of one batch
        for label in [f"shards-{c}" for c in args.chunk_tokens] + ["numpy"]:
            local_rate, *_ = read_batches(str(root / f"{label}.yaml"), args.batches, args.threads)
            proxy.reset()
            remote_rate, opened, open_bytes, timed_bytes = read_batches(
                f"{prefix}/{label}.yaml", args.batches, args.threads, lambda: proxy.bytes_served
            )
            # Prefetch threads may have fetched ahead of the last timed batch: counted, as a run pays them too.
            rows.append((label, local_rate, remote_rate, opened, open_bytes, timed_bytes / args.batches / used_bytes))
            print(rows[-1], flush=True)
    proxy.stop()
    server.terminate()
    server.wait()

    command = " ".join(["python packages/olmo-data/bench/bench_remote.py", *sys.argv[1:]])
    lines = [
        f"# Remote (S3 emulator) vs local batches, {date.today()}",
        "",
        f"`{command}`; sequence {SEQ}, "
        f"{BATCH} sequences per batch ({BATCH * SEQ:,} tokens), {args.tokens:,} tokens per source, "
        f"{args.batches} timed batches after one warm-up, {args.threads} loader threads. See the script's docstring "
        "for what an in-process emulator can and cannot say.",
        "",
        "| source format | local tok/s | remote tok/s | remote / local | remote open + first batch: s, MB | "
        "bytes fetched per batch / bytes used |",
        "|---|---|---|---|---|---|",
    ]
    for label, local, remote, opened, open_bytes, amp in rows:
        lines.append(
            f"| {label} | {local:,.0f} | {remote:,.0f} | {remote / local:.2f} | {opened:.2f}, {open_bytes / 1e6:.1f} "
            f"| {amp:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

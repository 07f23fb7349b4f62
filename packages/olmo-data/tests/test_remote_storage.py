"""Mixtures, leakage checks and tokenize on object storage (issue 19, the data side), against
real local emulators started by the tests (tests/support/object_store.py): moto's S3 server
and fake-gcs-server. The independent reference is always the same data read from local
disk by the local code path (np.memmap, os.pread), or uploaded and downloaded by boto3 /
plain HTTP rather than by the layer under test."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
from test_mixture_support import random_docs, write_mixture, write_raw, write_shard

from olmo_data import (
    DataError,
    LeakageError,
    MixtureLoader,
    assert_no_leakage,
    check_leakage,
    fileio,
    load_mixture,
)
from olmo_data.cli import main as cli_main
from olmo_data.order import BATCH_KEYS, GlobalOrder, derive_key
from olmo_data.sample import train_tokenizer
from olmo_data.tokenize import tokenize_main

ROOT = Path(__file__).resolve().parents[3]

# Fixtures s3_emulator, s3_store, gcs_store, object_store (parametrized: s3, gs) and
# no_gcs_retry_wait; the stores are tests/support/object_store.py's ObjectStore.
pytest_plugins = ["object_store"]

SEQ = 64
GLOBAL_BATCH = 8
CHUNK_TOKENS = 1024  # small zstd chunks, so one window touches 1-2 of a shard's ~90 chunks


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh olmo cache per test: every remote scan, hash and leakage report starts cold."""
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))


def build_mixture(folder: Path, code: list[np.ndarray] | None = None, prose_docs: int = 1500) -> Path:
    """Raw uint16 token files (code: 2 files, by default ~125k tokens) and zstd shards (prose:
    2 files, by default ~185k tokens in 1024-token chunks), held-out shards; returns the YAML.
    Tests that need no large files pass smaller sizes: each chunk is one request to read."""
    code = code if code is not None else random_docs(1, 2000)
    write_raw(folder / "code" / "a.npy", code[: len(code) * 2 // 3])
    write_raw(folder / "code" / "b.npy", code[len(code) * 2 // 3 :])
    write_shard(folder / "prose" / "p0.shard", random_docs(2, prose_docs), chunk_tokens=CHUNK_TOKENS)
    write_shard(folder / "prose" / "p1.shard", random_docs(3, prose_docs), chunk_tokens=CHUNK_TOKENS)
    write_shard(folder / "heldout" / "h.shard", HELD, chunk_tokens=CHUNK_TOKENS)
    sources = [
        {"name": "code", "paths": ["code/*.npy"], "format": "numpy", "dtype": "uint16", "ratio": 0.4},
        {"name": "prose", "paths": ["prose"], "format": "shards", "ratio": 0.6},
    ]
    held = [{"name": "heldout", "paths": ["heldout/h.shard"], "format": "shards"}]
    return write_mixture(folder, sources, held, sequence_length=SEQ)


HELD = random_docs(4, 60, min_len=20)


def small_mixture(folder: Path) -> Path:
    """The same layout with ~20k tokens per source: enough for the error paths."""
    return build_mixture(folder, random_docs(1, 300), prose_docs=300)


def assert_same_batches(remote, reference_order: GlobalOrder, steps: int = 4) -> None:
    loader = MixtureLoader(remote, GLOBAL_BATCH, prefetch=0)
    for step in range(steps):
        got, want = loader.batch_at(step), reference_order.global_batch(step, GLOBAL_BATCH)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"step {step} {k}")


def assert_same_sources(remote, local) -> None:
    for got, want in zip(
        [*remote.training_sources, *remote.held_out_sources.values()],
        [*local.training_sources, *local.held_out_sources.values()],
    ):
        assert got.num_tokens == want.num_tokens
        np.testing.assert_array_equal(got.read(0, got.num_tokens), want.read(0, want.num_tokens))
        np.testing.assert_array_equal(got.doc_starts(), want.doc_starts())


def test_mixture_folder_in_a_bucket_reads_as_on_disk(object_store, tmp_path):
    """The mixture folder, YAML included, copied to a bucket: same fingerprint, same tokens,
    same batches and eval batches, for raw token files and zstd shards."""
    local = load_mixture(build_mixture(tmp_path / "local"))
    url = object_store.upload_tree(tmp_path / "local", "corpus/v1") + "/mixture.yaml"
    remote = load_mixture(url)
    assert remote.path == url and remote.root == object_store.url("corpus/v1")
    assert remote.training_files[0] == [
        object_store.url("corpus/v1/code/a.npy"),
        object_store.url("corpus/v1/code/b.npy"),
    ]
    assert remote.fingerprint() == local.fingerprint()
    assert_same_sources(remote, local)
    assert_same_batches(remote, local.order)
    for got, want in zip(remote.training_sources, local.training_sources):  # as a worker process gets them
        clone = pickle.loads(pickle.dumps(got))
        np.testing.assert_array_equal(clone.read(1000, 1500), want.read(1000, 1500))
    for got, want in zip(
        MixtureLoader(remote, GLOBAL_BATCH, prefetch=0).eval_batches("heldout", 3),
        MixtureLoader(local, GLOBAL_BATCH, prefetch=0).eval_batches("heldout", 3),
    ):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(got[k], want[k])
    # The CLI reads it too, and prints the same fingerprint.
    assert cli_main(["inspect", url, "--json"]) == 0


def test_local_yaml_naming_bucket_sources(object_store, tmp_path):
    """A local YAML whose sources are URLs: the files are named by URL in the fingerprint (they
    do not lie below the YAML), and the batches are those of the same order over the local files."""
    build_mixture(tmp_path / "data", prose_docs=300)
    local = load_mixture(tmp_path / "data" / "mixture.yaml")
    prefix = object_store.upload_tree(tmp_path / "data", "data")
    sources = [
        {"name": "code", "paths": [f"{prefix}/code/*.npy"], "format": "numpy", "dtype": "uint16", "ratio": 0.4},
        {"name": "prose", "paths": [f"{prefix}/prose"], "format": "shards", "ratio": 0.6},
    ]
    held = [{"name": "heldout", "paths": [f"{prefix}/heldout/h.shard"], "format": "shards"}]
    (tmp_path / "recipes").mkdir()
    remote = load_mixture(write_mixture(tmp_path / "recipes", sources, held, sequence_length=SEQ))
    assert [i["file"] for i in remote.source_identity(remote.training_sources[0])] == [
        f"{prefix}/code/a.npy",
        f"{prefix}/code/b.npy",
    ]
    assert_same_sources(remote, local)
    reference = GlobalOrder(
        local.training_sources,
        local.source_names,
        local.slots_per_epoch(),
        local.max_instances(),
        SEQ,
        derive_key(remote.fingerprint(), remote.seed, "train-order"),
        vocab_size=local.config.vocab_size,
    )
    assert_same_batches(remote, reference)


def test_a_window_read_fetches_the_window_not_the_file(object_store, tmp_path):
    local = load_mixture(build_mixture(tmp_path / "local"))
    url = object_store.upload_tree(tmp_path / "local", "m") + "/mixture.yaml"
    object_store.proxy.reset()
    remote = load_mixture(url)
    first_open = object_store.bytes_served
    (raw, _), (shard, _) = (src.sources for src in remote.training_sources)
    (local_raw, _), (local_shard, _) = (src.sources for src in local.training_sources)
    for name, src, ref in (("raw", raw, local_raw), ("shard", shard, local_shard)):
        start = src.num_tokens // 2 + 5
        object_store.proxy.reset()
        np.testing.assert_array_equal(src.read(start, start + SEQ + 1), ref.read(start, start + SEQ + 1))
        served = object_store.bytes_served
        if name == "raw":
            payload, responses = (SEQ + 1) * 2, 1  # the window and the token after it, uint16
        else:
            bounds = np.cumsum([c["num_tokens"] for c in src.manifest["chunks"]])
            touched = np.unique(np.searchsorted(bounds, [start, start + SEQ], side="right"))
            payload, responses = sum(src.manifest["chunks"][i]["compressed_size"] for i in touched), len(touched)
        # At least the payload went over the wire (so the count is real), and beyond it only
        # HTTP response headers (< 1 KiB per response), nothing of the rest of the file.
        assert payload <= served <= payload + 1024 * responses, (name, served, payload)
        assert served * 50 < fileio.size(src.path), (name, served)
    # Opening streamed each raw file once (document index and sha256); a second open finds
    # both in the local cache, so it fetches at least the raw files' bytes less.
    raw_bytes = sum(fileio.size(p.path) for p in remote.training_sources[0].sources)
    object_store.proxy.reset()
    again = load_mixture(url)
    second_open = object_store.bytes_served
    assert first_open - second_open >= raw_bytes, (first_open, second_open, raw_bytes)
    # The fingerprint then reads only object metadata (sizes, versions: ~0.3 KiB per file on
    # S3, ~1.5 KiB of JSON on GCS), as the raw files' sha256 came from that same stream.
    object_store.proxy.reset()
    assert again.fingerprint() == local.fingerprint()
    assert object_store.bytes_served < 2048 * 6, object_store.bytes_served  # 5 data files + the YAML


def data_reads(store) -> list[str]:
    """The targets of the GETs of object bytes that went through the store's relay (not the
    listings and metadata requests, which gcsfs may still be sending from an earlier call)."""
    is_read = (lambda t: "alt=media" in t) if store.scheme == "gs" else (lambda t: "?" not in t)
    return [target for method, target in store.proxy.requests if method == "GET" and is_read(target)]


def test_staged_reads_coalesce_and_fetch_once(object_store, tmp_path):
    """fileio.staged_reads on hand-picked ranges: overlapping and touching ranges of one object
    are one GET, the fetched bytes serve every read inside them, a read outside is its own GET."""
    data_a, data_b = bytes(range(256)) * 8, bytes(reversed(range(256))) * 4  # 2048 and 1024 bytes
    (tmp_path / "a.bin").write_bytes(data_a)
    (tmp_path / "b.bin").write_bytes(data_b)
    a, b = object_store.upload(tmp_path / "a.bin", "a.bin"), object_store.upload(tmp_path / "b.bin", "b.bin")
    ranges = [(a, 0, 100), (a, 100, 50), (a, 120, 10), (a, 500, 10), (a, 1000, 5), (b, 0, 10), (a, 1002, 0)]
    # By hand: a's [0, 100) + [100, 150) touch and [120, 130) lies inside: one span [0, 150);
    # [500, 510) and [1000, 1005) stand alone; b's [0, 10); the empty range asks nothing.
    assert fileio.coalesce([(o, n) for u, o, n in ranges if u == a]) == [(0, 150), (500, 10), (1000, 5)]
    ra, rb = fileio.RangeReader(a), fileio.RangeReader(b)
    object_store.proxy.reset()
    with fileio.staged_reads(ranges) as requests:
        assert requests == 4 and len(data_reads(object_store)) == 4
        for url, offset, length in ranges:
            reader, data = (ra, data_a) if url == a else (rb, data_b)
            assert reader.pread(offset, length) == data[offset : offset + length]
        assert ra.pread(130, 20) == data_a[130:150]  # inside a staged span: no request
        payload = 150 + 10 + 5 + 10
        # The payload and beyond it only HTTP response headers (< 1 KiB per response).
        assert payload <= object_store.bytes_served <= payload + 1024 * 4, object_store.bytes_served
        assert len(data_reads(object_store)) == 4
        assert ra.pread(140, 20) == data_a[140:160]  # runs past the span: fetched on its own
        assert len(data_reads(object_store)) == 5
    assert ra.pread(0, 10) == data_a[:10]  # the block has ended: nothing is staged any more
    assert len(data_reads(object_store)) == 6
    # pread_many coalesces too: two touching ranges, one GET.
    object_store.proxy.reset()
    assert ra.pread_many([(10, 10), (20, 5)]) == [data_a[10:20], data_a[20:25]]
    assert len(data_reads(object_store)) == 1


def runs(values) -> int:
    """Runs of consecutive integers among the distinct `values` ([2, 3, 5] holds two)."""
    v = np.unique(np.asarray(values))
    return int(v.size and 1 + np.count_nonzero(np.diff(v) > 1))


def test_a_batch_is_fetched_at_once_and_is_the_local_batch(object_store, tmp_path):
    """A batch's windows are fetched before it is built, coalesced: a raw file's windows k and
    k+1 touch (window k reads one token past its end, k+1's first) and a shard's consecutive
    chunks lie back to back, so each run of consecutive windows or chunks is one GET. The
    count is derived from the batch's windows, the batches are the local ones, with any
    read_concurrency and in Grain's reader threads."""
    folder = tmp_path / "m"
    write_raw(folder / "code.npy", random_docs(1, 12))  # 800 tokens: 12 windows of 64
    write_shard(folder / "prose.shard", random_docs(2, 30), chunk_tokens=100)  # 1831 tokens, 19 chunks
    sources = [
        {"name": "code", "paths": ["code.npy"], "format": "numpy", "dtype": "uint16", "ratio": 0.5},
        {"name": "prose", "paths": ["prose.shard"], "format": "shards", "ratio": 0.5},
    ]
    local = load_mixture(write_mixture(folder, sources, sequence_length=SEQ))
    url = object_store.upload_tree(folder, "m") + "/mixture.yaml"
    counts = {}
    for concurrency in (fileio.DEFAULT_CONCURRENT_READS, 0):
        remote = load_mixture(url)  # a fresh open: no chunk cached, the doc-start block not read
        loader = MixtureLoader(remote, GLOBAL_BATCH, prefetch=0, read_concurrency=concurrency)
        object_store.proxy.reset()
        got, want = loader.batch_at(0), local.order.global_batch(0, GLOBAL_BATCH)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"read_concurrency {concurrency} {k}")
        counts[concurrency] = len(data_reads(object_store))
    source, within = local.order.instances_at(np.arange(GLOBAL_BATCH))
    code, prose = within[source == 0], within[source == 1]
    shard = local.training_sources[1]
    bounds = np.cumsum([c["num_tokens"] for c in shard.manifest["chunks"]])
    first_chunk = np.searchsorted(bounds, prose * SEQ, side="right")  # a window's tokens [k*S, k*S + S]
    last_chunk = np.searchsorted(bounds, prose * SEQ + SEQ, side="right")
    chunks = np.concatenate([np.arange(f, t + 1) for f, t in zip(first_chunk, last_chunk)])
    # + 1: the shard's doc-start block, read once on first use.
    assert counts[fileio.DEFAULT_CONCURRENT_READS] == runs(code) + runs(chunks) + 1, (counts, code, chunks)
    # One at a time: a GET per raw window read, a GET per chunk not already decompressed
    # (windows are read in order, so a chunk two windows share is fetched once).
    assert counts[0] == len(code) + len(np.unique(chunks)) + 1, (counts, code, chunks)
    assert counts[fileio.DEFAULT_CONCURRENT_READS] < counts[0]  # this batch has runs to coalesce
    # Grain's reader threads each stage their own batch.
    loader = MixtureLoader(load_mixture(url), GLOBAL_BATCH, prefetch=2)
    it = iter(loader)
    for step in range(4):
        got, want = next(it), local.order.global_batch(step, GLOBAL_BATCH)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"threads, step {step} {k}")
    it.close()
    settle(object_store)


def settle(store, quiet_s: float = 0.5, limit_s: float = 10.0) -> None:
    """Wait until no request has gone through the store's relay for `quiet_s`: batches the
    reader threads were prefetching when the iterator closed finish their reads before the
    fixture cuts the relay (they would otherwise retry against it, and log each retry)."""
    seen, since, t0 = -1, time.perf_counter(), time.perf_counter()
    while time.perf_counter() - since < quiet_s and time.perf_counter() - t0 < limit_s:
        if (n := len(store.proxy.requests)) != seen:
            seen, since = n, time.perf_counter()
        time.sleep(0.05)


def test_leakage_check_finds_a_leak_planted_in_a_remote_raw_file(object_store, tmp_path):
    code = random_docs(1, 600)
    code.insert(500, HELD[7])  # lands in code/b.npy (the last third of the documents)
    local = load_mixture(build_mixture(tmp_path / "local", code, prose_docs=300))
    remote = load_mixture(object_store.upload_tree(tmp_path / "local", "leaky") + "/mixture.yaml")
    (want,) = check_leakage(local, use_cache=False).held_out
    (got,) = check_leakage(remote, use_cache=False).held_out
    assert got.contaminated_docs == want.contaminated_docs == [7]
    assert got.exact_matches == want.exact_matches
    assert got.exact_matches[0]["training_source"] == "code"
    assert got.exact_matches[0]["training_offset"] == sum(len(d) for d in code[:500])
    with pytest.raises(LeakageError, match=r"held_out 'heldout': 1/60 documents .* doc 7 \(exact copy in 'code'"):
        assert_no_leakage(remote)


def test_tokenize_to_a_bucket_writes_the_local_shards(object_store, tmp_path):
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    texts = {
        name: [f"{name} {i}: " + " ".join(rng.choice(words, size=int(rng.integers(3, 40)))) for i in range(n)]
        for name, n in (("a", 9), ("b", 5))
    }
    (tmp_path / "in").mkdir()
    for name, docs in texts.items():
        (tmp_path / "in" / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    train_tokenizer([t for docs in texts.values() for t in docs], vocab_size=300).save(str(tmp_path / "tokenizer.json"))
    tokenizer_url = object_store.upload(tmp_path / "tokenizer.json", "tok/tokenizer.json")
    common = ["--input", str(tmp_path / "in" / "*.jsonl"), "--docs-per-shard", "4", "--chunk-tokens", "16"]
    assert (
        tokenize_main([*common, "--tokenizer", str(tmp_path / "tokenizer.json"), "--output", str(tmp_path / "out")])
        == 0
    )
    out = object_store.url("shards/run1")
    assert tokenize_main([*common, "--tokenizer", tokenizer_url, "--output", out]) == 0
    local = sorted(p.name for p in (tmp_path / "out").glob("*.shard"))
    assert len(local) == 5  # 9 and 5 documents in parts of 4
    assert fileio.listdir(out) == local
    for name in local:
        key = f"shards/run1/{name}"
        assert object_store.download(key) == (tmp_path / "out" / name).read_bytes(), name
    # A re-run finds every shard complete and uploads nothing.
    versions = {name: fileio.stat(f"{out}/{name}").version for name in local}
    assert tokenize_main([*common, "--tokenizer", tokenizer_url, "--output", out]) == 0
    assert {name: fileio.stat(f"{out}/{name}").version for name in local} == versions


# ---- errors: one line, naming the URL and the fix ---------------------------------------------


def one_line(exc: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def test_missing_s3_credentials(s3_store, tmp_path, monkeypatch, capsys):
    url = s3_store.upload_tree(small_mixture(tmp_path / "m").parent, "m") + "/mixture.yaml"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(fileio.StorageCredentialsError) as e:
        load_mixture(url)
    one_line(e, url, "no AWS credentials", "AWS_ACCESS_KEY_ID")
    assert cli_main(["inspect", url]) == 2
    assert "no AWS credentials" in capsys.readouterr().err


def test_unknown_bucket(object_store, tmp_path):
    missing = f"{object_store.scheme}://no-such-bucket-{object_store.bucket}/m/mixture.yaml"
    with pytest.raises(fileio.BucketNotFoundError) as e:
        load_mixture(missing)
    one_line(e, missing, "does not exist", "check the bucket name")
    # Named as a source by a local mixture: the mixture, the field and the URL.
    source = f"{object_store.scheme}://no-such-bucket-{object_store.bucket}/code/*.npy"
    yaml_path = write_mixture(
        tmp_path, [{"name": "code", "paths": [source], "format": "numpy", "dtype": "uint16", "ratio": 1}]
    )
    with pytest.raises(fileio.BucketNotFoundError) as e:
        load_mixture(yaml_path)
    one_line(e, str(yaml_path), "sources.0.paths (code)", source, "does not exist")


def test_s3_permission_denied(s3_store, tmp_path, monkeypatch, s3_emulator):
    url = s3_store.upload_tree(small_mixture(tmp_path / "m").parent, "m") + "/mixture.yaml"
    with s3_emulator.restricted_credentials(["s3:ListBucket"]) as (key_id, secret):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        assert fileio.listdir(s3_store.url("m")) == ["code", "heldout", "mixture.yaml", "prose"]
        with pytest.raises(fileio.StoragePermissionError) as e:
            load_mixture(url)
        one_line(e, url, "permission denied", "s3:GetObject", s3_store.bucket)
        assert isinstance(e.value, PermissionError)
        # Keys the server does not know, while it checks them: rejected credentials.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        with pytest.raises(fileio.StorageCredentialsError) as e:
            load_mixture(url)
        one_line(e, url, "rejected the credentials", "InvalidAccessKeyId", "AWS_ACCESS_KEY_ID")


def test_object_not_found(object_store, tmp_path):
    prefix = object_store.upload_tree(small_mixture(tmp_path / "m").parent, "m")
    with pytest.raises(DataError) as e:
        load_mixture(f"{prefix}/nope.yaml")
    one_line(e, f"{prefix}/nope.yaml", "mixture file not found")
    with pytest.raises(fileio.StorageNotFoundError) as e:
        fileio.read_bytes(f"{prefix}/code/nope.npy")
    one_line(e, f"{prefix}/code/nope.npy", "no such object")
    assert isinstance(e.value, FileNotFoundError)
    source = f"{prefix}/code/c.npy"
    yaml_path = write_mixture(
        tmp_path, [{"name": "code", "paths": [source], "format": "numpy", "dtype": "uint16", "ratio": 1}]
    )
    with pytest.raises(DataError) as e:
        load_mixture(yaml_path)
    one_line(e, str(yaml_path), "sources.0.paths (code)", source, "not found")


def test_network_failure_mid_run(object_store, tmp_path, monkeypatch, request):
    """The store goes away after the mixture opened: the next read is one clear line."""
    if object_store.scheme == "s3":
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retry knob: fail at once
    else:
        request.getfixturevalue("no_gcs_retry_wait")
    remote = load_mixture(object_store.upload_tree(small_mixture(tmp_path / "m").parent, "m") + "/mixture.yaml")
    loader = MixtureLoader(remote, GLOBAL_BATCH, prefetch=0)
    loader.batch_at(0)
    object_store.proxy.stop()
    t0 = time.perf_counter()
    for src in remote.training_sources:
        part = src.sources[-1]
        with pytest.raises(fileio.StorageNetworkError) as e:
            part.read(part.num_tokens - SEQ, part.num_tokens)  # a range not read before (no chunk cached)
        one_line(e, part.path, "cannot reach", object_store.proxy.endpoint, "check the network")
        assert isinstance(e.value, ConnectionError)
    # A batch fetched at once (the loader's default): the same kind of line, naming one of its files.
    with pytest.raises(fileio.StorageNetworkError) as e:
        loader.batch_at(1)
    one_line(e, object_store.url("m/"), "cannot reach", object_store.proxy.endpoint, "check the network")
    # Bounded by the clients' retries: S3 one attempt, gcsfs six without their sleeps.
    assert time.perf_counter() - t0 < 20


def test_a_failed_read_in_a_staged_batch_is_the_serial_error(object_store, tmp_path):
    """Objects deleted after the mixture opened: a batch fetched at once fails with the very
    one-line error the same batch read one window at a time gives, naming the URL."""
    url = object_store.upload_tree(small_mixture(tmp_path / "m").parent, "m") + "/mixture.yaml"
    staged, serial = (
        MixtureLoader(load_mixture(url), GLOBAL_BATCH, prefetch=0, read_concurrency=c)
        for c in (fileio.DEFAULT_CONCURRENT_READS, 0)
    )
    for name in ("code/a.npy", "code/b.npy", "heldout/h.shard"):
        fileio.delete(object_store.url(f"m/{name}"))
    errors = []
    for loader in (staged, serial):
        with pytest.raises(fileio.StorageNotFoundError) as e:
            loader.batch_at(0)  # batch 0 holds windows of the raw source "code"
        errors.append(one_line(e, object_store.url("m/code/"), "no such object; check the path"))
    assert errors[0] == errors[1]
    errors = []
    for loader in (staged, serial):
        with pytest.raises(DataError) as e:
            loader.eval_batches("heldout", 3)
        errors.append(one_line(e, object_store.url("m/heldout/h.shard"), "shard file vanished after opening"))
    assert errors[0] == errors[1]


# ---- the layer itself, as checkpoints and run dirs will use it --------------------------------


def check_layer(root: str) -> None:
    a, b = fileio.join(root, "run", "a.bin"), fileio.join(root, "run", "sub", "b.txt")
    assert not fileio.exists(a) and fileio.listdir(fileio.join(root, "run")) == []
    data = bytes(range(256)) * 40
    fileio.write_bytes(a, data)
    fileio.write_text(b, "hello")
    assert fileio.read_bytes(a) == data and fileio.read_text(b) == "hello"
    assert fileio.size(a) == len(data) and fileio.isfile(a) and not fileio.isdir(a)
    assert fileio.isdir(fileio.join(root, "run")) and fileio.exists(fileio.join(root, "run", "sub"))
    reader = fileio.RangeReader(a)
    assert reader.pread(1000, 300) == data[1000:1300] and reader.pread(len(data) - 5, 50) == data[-5:]
    assert reader.pread_many([(0, 4), (9000, 10)]) == [data[:4], data[9000:9010]]
    assert fileio.listdir(fileio.join(root, "run")) == ["a.bin", "sub"]
    assert fileio.glob(fileio.join(root, "run", "**", "*.txt")) == [b]
    assert fileio.find(fileio.join(root, "run"), ".bin") == [a]
    assert b"".join(fileio.iter_blocks(a, 1000)) == data
    before = fileio.stat(a)
    # An interrupted write leaves the old content; a completed one replaces it and its version.
    with pytest.raises(RuntimeError):
        with fileio.open_write(a) as f:
            f.write(b"partial")
            raise RuntimeError("killed mid-write")
    assert fileio.read_bytes(a) == data and fileio.stat(a) == before
    with fileio.open_write(a) as f:
        f.write(b"new")
    assert fileio.read_bytes(a) == b"new" and fileio.stat(a).version != before.version
    fileio.delete(a)
    assert not fileio.exists(a)
    fileio.delete(a)  # nothing there: not an error
    fileio.delete(fileio.join(root, "run"), recursive=True)
    assert fileio.listdir(root) == []


def test_storage_layer_on_object_storage(object_store):
    check_layer(object_store.url().rstrip("/"))


def test_storage_layer_on_local_disk(tmp_path):
    check_layer(f"file://{tmp_path / 'root'}")
    assert fileio.listdir(tmp_path / "root") == []


def test_url_names():
    assert fileio.join("s3://b/corpus/v1", "code/*.npy") == "s3://b/corpus/v1/code/*.npy"
    assert fileio.join("gs://b/m", "../shared/x.shard") == "gs://b/shared/x.shard"
    assert fileio.join("/data/m", "gs://b/x") == "gs://b/x"
    assert fileio.dirname("s3://b/mixture.yaml") == "s3://b" and fileio.dirname("s3://b/a/m.yaml") == "s3://b/a"
    assert fileio.relpath("s3://b/m/code/a.npy", "s3://b/m") == "code/a.npy"
    assert fileio.relpath("s3://other/code/a.npy", "s3://b/m") == "s3://other/code/a.npy"
    assert fileio.normalize("file:///tmp/x%20y") == "/tmp/x y"
    for bad, fragment in (("hdfs://n/x", "not supported"), ("s3:///x", "names no bucket"), ("gs://b/m", None)):
        if fragment is None:
            with pytest.raises(fileio.StorageError, match="leaves bucket"):
                fileio.join(bad, "../../other/x")
            continue
        with pytest.raises(fileio.StorageError, match=fragment):
            fileio.normalize(bad)

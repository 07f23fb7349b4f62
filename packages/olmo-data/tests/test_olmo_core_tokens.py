"""OLMo-core token files both ways (issue 22, item 5).

The reference is OLMo-core 3.0.0 itself: data/olmo_core_tokens holds what our `olmo-data
tokenize --format numpy` wrote (tokens/) and what OLMo-core read from those files
(olmo_core.npz: NumpyFSLDataset's instances for a listed, unsorted file order and for a glob,
its doc lengths, the document spans it reads from our .csv.gz, its dtype rule), written by
tools/bench/olmo_core/make_token_fixture.py in OLMo-core's isolated env (it pins torch 2.13,
so it is no dependency of this workspace). The first test re-tokenizes the committed inputs
and requires the committed files byte for byte, so the fixture is what our writer writes now.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_mixture_support import random_docs, write_shard

from olmo_data import DataError, fileio, load_mixture, read_instances
from olmo_data.sources import PerFileWindows, RawTokenFile, open_source
from olmo_data.tokenize import default_dtype, tokenize_main

# object_store: moto's S3 server and the GCS emulator, as in test_remote_storage.py.
pytest_plugins = ["object_store"]

FIXTURE = Path(__file__).parent / "data" / "olmo_core_tokens"
SEQ = 32  # the fixture's sequence_length (provenance.json)


@pytest.fixture(scope="module")
def olmo_core():
    return dict(np.load(FIXTURE / "olmo_core.npz"))


@pytest.fixture
def tokens(tmp_path, monkeypatch):
    """A copy of the fixture's token files, so caches and mixtures live in tmp_path."""
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))
    shutil.copytree(FIXTURE / "tokens", tmp_path / "tokens")
    return tmp_path / "tokens"


def mixture_yaml(folder: Path, paths: list[str], **source) -> Path:
    config = {
        "name": "olmo-core",
        "sequence_length": SEQ,
        "seed": 7,
        "eos_token_id": 0,
        "vocab_size": 300,
        "sources": [{"name": "web", "paths": paths, "format": "numpy", "dtype": "uint16", "ratio": 1.0, **source}],
    }
    path = folder / "mixture.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_tokenize_numpy_writes_the_files_olmo_core_read(tmp_path):
    out = tmp_path / "out"
    args = ["--input", str(FIXTURE / "input"), "--tokenizer", str(FIXTURE / "tokenizer.json"), "--output", str(out)]
    assert tokenize_main([*args, "--format", "numpy", "--docs-per-shard", "4"]) == 0
    expected = sorted(p.name for p in (FIXTURE / "tokens").iterdir())
    assert sorted(p.name for p in out.iterdir()) == expected
    for name in expected:
        assert (out / name).read_bytes() == (FIXTURE / "tokens" / name).read_bytes(), name
    recorded = json.loads((FIXTURE / "tokenize.json").read_text())
    assert recorded == {"vocab_size": 300, "eos_token_id": 0, "dtype": "uint16"}
    assert json.loads((FIXTURE / "provenance.json").read_text())["inferred_dtype"] == recorded["dtype"]


def test_olmo_core_windowing_gives_olmo_core_instances(tokens, olmo_core):
    listed = [str(n) for n in olmo_core["listed_order"]]
    assert listed != sorted(listed)  # the order given is not the sorted one
    mixture = load_mixture(mixture_yaml(tokens.parent, [f"tokens/{n}" for n in listed], windowing="olmo-core"))
    source = mixture.training_sources[0]
    assert isinstance(source, PerFileWindows)
    assert [Path(p).name for p in source.paths] == listed
    expected = olmo_core["listed_input_ids"]
    assert mixture.num_instances() == [len(expected)] == [26]
    ours = read_instances(source, np.arange(len(expected)), SEQ, 300)
    np.testing.assert_array_equal(ours["input_ids"], expected)

    # Document boundaries: OLMo-core's doc_lens (eos-terminated runs of each instance) are
    # where our positions restart.
    lens = np.split(olmo_core["listed_doc_lens"], np.cumsum(olmo_core["listed_doc_counts"])[:-1])
    for row, doc_lens in enumerate(lens):
        starts = np.concatenate([[0], np.cumsum(doc_lens)[:-1]])
        np.testing.assert_array_equal(np.flatnonzero(ours["positions"][row] == 0), starts, err_msg=f"row {row}")
        assert ours["doc_ids"][row, -1] == len(doc_lens) - 1

    # Labels: the next token within the window's own file, -100 where that file ends.
    files = [np.fromfile(tokens / n, dtype="<u2").astype(np.int64) for n in listed]
    row = 0
    for data in files:
        for k in range(len(data) // SEQ):
            np.testing.assert_array_equal(ours["labels"][row, :-1], data[k * SEQ + 1 : (k + 1) * SEQ])
            last = data[(k + 1) * SEQ] if (k + 1) * SEQ < len(data) else -100
            assert ours["labels"][row, -1] == last, (row, k)
            row += 1
    assert row == len(expected)


def test_the_mixture_order_serves_olmo_core_instances(tokens, olmo_core):
    """Through the loader's own order: every global instance of a mixture epoch is OLMo-core's
    instance of the same number, each exactly once."""
    listed = [f"tokens/{n}" for n in olmo_core["listed_order"]]
    mixture = load_mixture(mixture_yaml(tokens.parent, listed, windowing="olmo-core"))
    epoch = mixture.order.epoch_size
    assert epoch == 26
    _, within = mixture.order.instances_at(np.arange(epoch))
    assert sorted(within.tolist()) == list(range(epoch))
    batch = mixture.order.global_batch(0, epoch)
    np.testing.assert_array_equal(batch["input_ids"], olmo_core["listed_input_ids"][within])


def test_a_glob_keeps_olmo_core_order(tokens, olmo_core):
    mixture = load_mixture(mixture_yaml(tokens.parent, ["tokens/*.npy"], windowing="olmo-core"))
    source = mixture.training_sources[0]
    assert [Path(p).name for p in source.paths] == [str(n) for n in olmo_core["glob_order"]]
    expected = olmo_core["glob_input_ids"]
    np.testing.assert_array_equal(read_instances(source, np.arange(len(expected)), SEQ)["input_ids"], expected)
    # A file listed again is read again, as OLMo-core reads its paths as given.
    twice = load_mixture(
        mixture_yaml(tokens.parent, ["tokens/*.npy", "tokens/a.jsonl-00000.npy"], windowing="olmo-core")
    )
    assert twice.num_instances() == [len(expected) + 198 // SEQ]
    np.testing.assert_array_equal(
        read_instances(twice.training_sources[0], np.arange(len(expected), len(expected) + 6), SEQ)["input_ids"],
        expected[:6],  # a.jsonl-00000.npy is first in glob order and holds 198 tokens: 6 windows
    )


def test_default_windowing_differs_from_olmo_core(tokens, olmo_core):
    """Why the option exists: our default sorts the files and lets windows cross file ends."""
    listed = [f"tokens/{n}" for n in olmo_core["listed_order"]]
    mixture = load_mixture(mixture_yaml(tokens.parent, listed))
    source = mixture.training_sources[0]
    assert not isinstance(source, PerFileWindows)
    assert mixture.num_instances() == [941 // SEQ]  # 29: the 7 files' 941 tokens as one stream
    ours = read_instances(source, np.arange(26), SEQ)["input_ids"]
    assert not np.array_equal(ours, olmo_core["listed_input_ids"])
    assert not np.array_equal(ours, olmo_core["glob_input_ids"])


def test_olmo_core_reads_our_document_offsets(tokens, olmo_core):
    """OLMo-core's iter_document_indices, reading our .csv.gz, finds the documents we find."""
    for name in olmo_core["listed_order"]:
        spans = olmo_core[f"doc_spans_{name}"]
        raw = RawTokenFile(tokens / str(name), "uint16", eos_token_id=0)
        np.testing.assert_array_equal(spans[:, 0], raw.doc_starts())
        assert spans[-1, 1] == raw.num_tokens
        ours = gzip.decompress((tokens / str(name).replace(".npy", ".csv.gz")).read_bytes()).decode()
        assert ours == "".join(f"{a},{b}\n" for a, b in spans)


def test_dtype_rule_is_olmo_core_s(olmo_core):
    for vocab, name in zip(olmo_core["dtype_vocab"].tolist(), olmo_core["dtype_name"].tolist()):
        if vocab <= 256:
            # OLMo-core infers uint8 there; we store no uint8 (documented: give it dtype uint16)
            assert (name, default_dtype(vocab)) == ("uint8", "uint16")
        else:
            assert default_dtype(vocab) == name, vocab


def test_file_order_is_part_of_the_fingerprint(tokens, olmo_core):
    listed = [f"tokens/{n}" for n in olmo_core["listed_order"]]
    per_file = load_mixture(mixture_yaml(tokens.parent, listed, windowing="olmo-core")).fingerprint()
    reordered = load_mixture(mixture_yaml(tokens.parent, listed[::-1], windowing="olmo-core")).fingerprint()
    concat = load_mixture(mixture_yaml(tokens.parent, listed)).fingerprint()
    explicit = load_mixture(mixture_yaml(tokens.parent, listed, windowing="concat")).fingerprint()
    assert len({per_file, reordered, concat}) == 3
    assert concat == explicit  # naming the default changes nothing: older mixtures keep their order


def test_numpy_resume_skips_complete_parts(tmp_path):
    out = tmp_path / "out"
    args = ["--input", str(FIXTURE / "input"), "--tokenizer", str(FIXTURE / "tokenizer.json"), "--output", str(out)]
    args += ["--format", "numpy", "--docs-per-shard", "4"]
    assert tokenize_main(args) == 0
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    (out / "b.jsonl-00001.npy.json").unlink()  # as if killed before the record: the part is redone
    assert tokenize_main(args) == 0
    for p in out.iterdir():
        if p.name.startswith("b.jsonl-00001"):
            assert p.read_bytes() == (FIXTURE / "tokens" / p.name).read_bytes()
        else:
            assert p.stat().st_mtime_ns == mtimes[p.name], f"{p.name} was rewritten on resume"


def test_bad_olmo_core_inputs_are_one_line_errors(tmp_path, tokens):
    shard = write_shard(tmp_path / "s" / "x.shard", random_docs(1, 20))
    named = tmp_path / "s" / "x.npy"  # a shard renamed as OLMo-core files are named
    shutil.copy(shard, named)
    for path in (shard, named):
        with pytest.raises(DataError) as err:
            open_source(str(path), "numpy", dtype="uint16", eos_token_id=0)
        assert str(err.value) == (
            f"{path}: this is an olmo-data zstd shard, not raw tokens; read it with format: shards "
            "(or write raw token files with olmo-data tokenize --format numpy)"
        )
    with pytest.raises(DataError, match=r"sources.0: source 'web': windowing olmo-core .*; set format: numpy"):
        load_mixture(mixture_yaml(tokens.parent, ["tokens/*.npy"], windowing="olmo-core", format="shards", dtype=None))
    with pytest.raises(DataError, match=r"sequence_length 256 is longer than every file of sources 'web'"):
        path = mixture_yaml(tokens.parent, ["tokens/*.npy"], windowing="olmo-core")
        path.write_text(path.read_text().replace(f"sequence_length: {SEQ}", "sequence_length: 256"))
        load_mixture(path)


def test_numpy_tokenize_and_olmo_core_windowing_on_object_storage(object_store, tmp_path, monkeypatch, olmo_core):
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))
    out = object_store.url("olmo-core/tokens")
    args = ["--input", str(FIXTURE / "input"), "--tokenizer", str(FIXTURE / "tokenizer.json"), "--output", out]
    args += ["--format", "numpy", "--docs-per-shard", "4"]
    assert tokenize_main(args) == 0
    names = sorted(p.name for p in (FIXTURE / "tokens").iterdir())
    assert fileio.listdir(out) == names
    for name in names:
        assert object_store.download(f"olmo-core/tokens/{name}") == (FIXTURE / "tokens" / name).read_bytes(), name
    versions = {name: fileio.stat(f"{out}/{name}").version for name in names}
    assert tokenize_main(args) == 0  # every part complete: nothing uploaded again
    assert {name: fileio.stat(f"{out}/{name}").version for name in names} == versions

    listed = [f"{out}/{n}" for n in olmo_core["listed_order"]]
    mixture = load_mixture(mixture_yaml(tmp_path, listed, windowing="olmo-core"))
    got = read_instances(mixture.training_sources[0], np.arange(26), SEQ, 300)["input_ids"]
    np.testing.assert_array_equal(got, olmo_core["listed_input_ids"])

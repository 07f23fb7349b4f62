"""`olmo-data tokenize` on HF `datasets` inputs (issue 22, item 6): a save_to_disk folder, a
DatasetDict folder with --split, .arrow files (the stream format `datasets` writes and the
Arrow file format) give the same documents as the same rows from jsonl; the Python API
`olmo_data.tokenize`; one-line errors from the CLI.

The datasets tests need the `tokenize` extra (`datasets`, which brings pyarrow) and skip
without it; the folder logic and the errors are tested either way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import olmo_data
from olmo_data.cli import main
from olmo_data.errors import DataError
from olmo_data.sample import train_tokenizer
from olmo_data.sources import ShardSource

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"row {seed}-{i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(_texts(40, 0) + _texts(40, 1), vocab_size=300).save(str(path))
    return str(path)


def documents(folder: Path) -> list[list[int]]:
    """Every document of every shard in `folder`, shards in name order (= unit, part order)."""
    docs = []
    for p in sorted(folder.glob("*.shard")):
        src = ShardSource(p)
        bounds = [*src.doc_starts().tolist(), src.num_tokens]
        docs += [src.read(a, b).tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    return docs


def jsonl_documents(tmp_path: Path, name: str, texts: list[str], tokenizer: str) -> list[list[int]]:
    """The reference: the same rows written as jsonl, through the jsonl reader."""
    (tmp_path / f"{name}-jsonl").mkdir()
    (tmp_path / f"{name}-jsonl" / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    olmo_data.tokenize(str(tmp_path / f"{name}-jsonl"), tokenizer, str(tmp_path / f"{name}-jsonl-out"))
    return documents(tmp_path / f"{name}-jsonl-out")


def test_save_to_disk_folders_give_the_jsonl_tokens(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    train, validation = _texts(23, 2), _texts(9, 3)

    def table(texts):
        # Other columns before and after the text, as real datasets have: only "text" is read.
        n = len(texts)
        return {
            "id": list(range(n)),
            "meta": [{"src": "x", "n": [i]} for i in range(n)],
            "text": texts,
            "score": [0.5] * n,
        }

    one = datasets.Dataset.from_dict(table(train))
    one.save_to_disk(str(tmp_path / "one"), num_shards=2)  # two .arrow files: their order is the row order
    datasets.DatasetDict({"train": one, "validation": datasets.Dataset.from_dict(table(validation))}).save_to_disk(
        str(tmp_path / "dict")
    )
    expected_train = jsonl_documents(tmp_path, "train", train, tokenizer)
    expected_validation = jsonl_documents(tmp_path, "validation", validation, tokenizer)
    assert len(expected_train) == 23 and len(expected_validation) == 9

    stats = olmo_data.tokenize(str(tmp_path / "one"), tokenizer, str(tmp_path / "one-out"))
    assert [Path(f).name for f in stats["files"]] == [
        "data-00000-of-00002.arrow-00000.shard",
        "data-00001-of-00002.arrow-00000.shard",
    ]
    assert (stats["docs"], stats["dtype"], stats["eos_token_id"]) == (23, "uint16", 0)
    assert documents(tmp_path / "one-out") == expected_train

    olmo_data.tokenize(str(tmp_path / "dict"), tokenizer, str(tmp_path / "dict-train"))  # split defaults to train
    assert documents(tmp_path / "dict-train") == expected_train
    args = ["--input", str(tmp_path / "dict"), "--split", "validation", "--tokenizer", tokenizer]
    assert main(["tokenize", *args, "--output", str(tmp_path / "dict-validation")]) == 0
    assert documents(tmp_path / "dict-validation") == expected_validation


def test_arrow_and_parquet_files_give_the_jsonl_tokens(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    ipc = pytest.importorskip("pyarrow.ipc")
    pq = pytest.importorskip("pyarrow.parquet")

    texts = _texts(17, 4)
    expected = jsonl_documents(tmp_path, "rows", texts, tokenizer)
    table = pa.table({"id": list(range(17)), "text": texts})
    (tmp_path / "in").mkdir()
    with ipc.new_stream(str(tmp_path / "in" / "stream.arrow"), table.schema) as w:  # what datasets writes
        for batch in table.to_batches(max_chunksize=5):
            w.write_batch(batch)
    with ipc.new_file(str(tmp_path / "in" / "file.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=6)
    large = table.cast(pa.schema([("id", pa.int64()), ("text", pa.large_string())]))  # the other string type
    pq.write_table(large, str(tmp_path / "in" / "t.parquet"))
    for name in ("stream.arrow", "file.arrow", "t.parquet"):
        olmo_data.tokenize(str(tmp_path / "in" / name), tokenizer, str(tmp_path / f"out-{name}"))
        assert documents(tmp_path / f"out-{name}") == expected, name
    with pytest.raises(DataError, match=r"stream.arrow: column 'id' holds int64, not text; pass --text-field"):
        olmo_data.tokenize(str(tmp_path / "in" / "stream.arrow"), tokenizer, str(tmp_path / "o"), text_field="id")


def _fake_dataset(folder: Path, files: list[str]) -> None:
    """The JSON a save_to_disk folder holds (no datasets needed to write it)."""
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": f} for f in files]}))
    (folder / "dataset_info.json").write_text("{}")
    for f in files:
        (folder / f).write_bytes(b"not read")


def test_datasets_folder_errors(tmp_path, tokenizer, monkeypatch):
    out = str(tmp_path / "out")
    root = tmp_path / "dd"
    _fake_dataset(root / "train", ["data-00000-of-00001.arrow"])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(DataError, match=r"dd: this DatasetDict has no split 'test' \(has \['train'\]\); pass --split"):
        olmo_data.tokenize(str(root), tokenizer, out, split="test")
    # A folder above a dataset would read its state.json as documents and every split as text.
    with pytest.raises(DataError, match=r"holds a HF datasets folder, .*dd; pass that folder as --input"):
        olmo_data.tokenize(str(tmp_path), tokenizer, out)
    _fake_dataset(tmp_path / "gone", ["data-00000-of-00002.arrow"])
    state = json.loads((tmp_path / "gone" / "state.json").read_text())
    state["_data_files"].append({"filename": "data-00001-of-00002.arrow"})
    (tmp_path / "gone" / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataError, match=r"gone/state.json: lists data-00001-of-00002.arrow, which is missing"):
        olmo_data.tokenize(str(tmp_path / "gone"), tokenizer, out)
    # Without pyarrow (the tokenize extra) the error says what to install.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DataError) as err:
        olmo_data.tokenize(str(root), tokenizer, out)
    assert str(err.value) == (
        f"{root / 'train' / 'data-00000-of-00001.arrow'}: reading .arrow files needs pyarrow; install the tokenize "
        "extra: pip install 'olmo-data[tokenize]' (in this workspace: uv sync --extra tokenize), or convert it to jsonl"
    )
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"t.parquet: reading parquet needs pyarrow; install the tokenize extra"):
        olmo_data.tokenize(str(tmp_path / "t.parquet"), tokenizer, out)


def test_tokenize_errors_are_one_line(tmp_path, tokenizer, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["tokenize", "--input", str(missing), "--tokenizer", tokenizer, "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == f"error --input {missing}: no such file, directory or glob; check the path\n"
    (tmp_path / "bad.json").write_text("{")
    assert main(["tokenize", "--input", str(missing), "--tokenizer", str(tmp_path / "bad.json"), "--output", "o"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error --tokenizer {tmp_path / 'bad.json'}: not a tokenizers JSON")

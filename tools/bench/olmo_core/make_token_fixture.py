"""Writes the OLMo-core token-file fixture: our `olmo-data tokenize --format numpy` output, and
what OLMo-core 3.0.0 itself reads from it (packages/olmo-data/tests/test_olmo_core_tokens.py
compares the two). Two steps, from the repository root:

    uv run --frozen python tools/bench/olmo_core/make_token_fixture.py write \
        packages/olmo-data/tests/data/olmo_core_tokens
    uv run --isolated --no-project --python 3.11 --with ai2-olmo-core==3.0.0 \
        python tools/bench/olmo_core/make_token_fixture.py read packages/olmo-data/tests/data/olmo_core_tokens

`write` (this workspace's env) makes the inputs: three jsonl files of seeded random text
(input/), a byte-level BPE trained on them (tokenizer.json, 300 ids, eos 0), and tokenizes
them with `olmo_data.tokenize(format="numpy", docs_per_shard=4)` into tokens/ (7 parts:
`.npy`, `.csv.gz`, `.npy.json` each); tokenize.json records the vocab size, eos and dtype.

`read` runs inside OLMo-core's isolated env (ai2-olmo-core pins torch 2.13, so it is not a
dependency of this workspace) and writes, from OLMo-core's own code only:

- ``olmo_core.npz``:
  - ``listed_order`` / ``listed_input_ids`` / ``listed_doc_lens`` (+ ``listed_doc_counts``):
    ``NumpyFSLDatasetConfig(paths=LISTED, dtype=None, sequence_length=32,
    generate_doc_lengths=True)``: every instance, in OLMo-core's index order, with the file
    list in a deliberately unsorted order (LISTED) and the dtype OLMo-core infers from the
    vocab size;
  - ``glob_order`` / ``glob_input_ids``: the same through ``NumpyFSLDatasetConfig.glob``
    over ``tokens/*.npy`` (OLMo-core sorts a glob's matches);
  - ``doc_spans_<file>``: the (start, end) of every document as OLMo-core's
    ``iter_document_indices(use_array_if_local=False)`` reads them from our ``.csv.gz``;
  - ``dtype_vocab`` / ``dtype_name``: ``NumpyDatasetConfig.get_dtype()`` for a few vocab
    sizes (the rule `--format numpy` follows);
- ``provenance.json``: OLMo-core, torch and numpy versions, and what was asked.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

SEQUENCE_LENGTH = 32
INPUTS = {"b.jsonl": (7, 1), "a.jsonl": (5, 2), "c.jsonl": (9, 3)}  # name: (documents, seed)
DOCS_PER_PART = 4
# The order OLMo-core is given the files in: not sorted, so that keeping it is tested.
LISTED = [
    "c.jsonl-00001.npy",
    "a.jsonl-00000.npy",
    "b.jsonl-00001.npy",
    "c.jsonl-00000.npy",
    "a.jsonl-00001.npy",
    "c.jsonl-00002.npy",
    "b.jsonl-00000.npy",
]
VOCABS = [256, 257, 300, 65536, 65537, 100278]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def write(root: Path) -> None:
    import olmo_data
    from olmo_data.sample import train_tokenizer

    texts = {}
    for name, (n, seed) in INPUTS.items():
        rng = np.random.default_rng(seed)
        texts[name] = [
            f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for i in range(n)
        ]
        (root / "input").mkdir(parents=True, exist_ok=True)
        (root / "input" / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[name]))
    train_tokenizer([t for ts in texts.values() for t in ts], vocab_size=300).save(str(root / "tokenizer.json"))
    stats = olmo_data.tokenize(
        str(root / "input"),
        str(root / "tokenizer.json"),
        str(root / "tokens"),
        format="numpy",
        docs_per_shard=DOCS_PER_PART,
    )
    assert sorted(Path(f).name for f in stats["files"]) == sorted(LISTED), stats["files"]
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(root / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    record = {"vocab_size": vocab, "eos_token_id": stats["eos_token_id"], "dtype": stats["dtype"]}
    (root / "tokenize.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))


def read(root: Path) -> None:
    from importlib.metadata import version

    import torch
    from olmo_core.data import NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.data.utils import iter_document_indices

    tokens = root / "tokens"
    ours = json.loads((root / "tokenize.json").read_text())
    tokenizer = TokenizerConfig(vocab_size=ours["vocab_size"], eos_token_id=ours["eos_token_id"], pad_token_id=1)
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as work:
        listed = NumpyFSLDatasetConfig(
            tokenizer=tokenizer,
            paths=[str(tokens / name) for name in LISTED],
            sequence_length=SEQUENCE_LENGTH,
            generate_doc_lengths=True,
            work_dir=work,
        )
        inferred = listed.get_dtype()
        dataset = listed.build()
        dataset.prepare()
        items = [dataset[i] for i in range(len(dataset))]
        out["listed_order"] = np.array(LISTED)
        out["listed_input_ids"] = np.stack([item["input_ids"].numpy() for item in items])
        out["listed_doc_lens"] = np.concatenate([item["doc_lens"].numpy() for item in items])
        out["listed_doc_counts"] = np.array([len(item["doc_lens"]) for item in items])
        globbed = NumpyFSLDatasetConfig.glob(
            str(tokens / "*.npy"), tokenizer=tokenizer, sequence_length=SEQUENCE_LENGTH, work_dir=work
        ).build()
        globbed.prepare()
        out["glob_order"] = np.array([Path(p).name for p in globbed.paths])
        out["glob_input_ids"] = np.stack([globbed[i]["input_ids"].numpy() for i in range(len(globbed))])
    for name in LISTED:
        spans = list(iter_document_indices(tokens / name, use_array_if_local=False))
        out[f"doc_spans_{name}"] = np.array(spans, dtype=np.int64)
    out["dtype_vocab"] = np.array(VOCABS)
    names = []
    for v in VOCABS:
        config = NumpyFSLDatasetConfig(
            tokenizer=TokenizerConfig(vocab_size=v, eos_token_id=0, pad_token_id=1),
            paths=["unused.npy"],
            sequence_length=SEQUENCE_LENGTH,
        )
        names.append(np.dtype(config.get_dtype()).name)
    out["dtype_name"] = np.array(names)
    np.savez(root / "olmo_core.npz", **out)
    provenance = {
        "ai2-olmo-core": version("ai2-olmo-core"),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "sequence_length": SEQUENCE_LENGTH,
        "vocab_size": ours["vocab_size"],
        "inferred_dtype": np.dtype(inferred).name,
        "listed": LISTED,
        "instances": len(items),
    }
    (root / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    print(json.dumps(provenance))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["write", "read"], help="write: our env; read: OLMo-core's env")
    parser.add_argument("dir", type=Path, help="the fixture folder")
    args = parser.parse_args()
    (write if args.step == "write" else read)(args.dir)


if __name__ == "__main__":
    sys.exit(main())

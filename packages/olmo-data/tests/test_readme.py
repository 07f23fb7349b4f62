"""The README's Python quick start runs as written (its code blocks are read from the README,
so they cannot drift from what the package does), and what it prints is checked against
independent references: the tokenizer itself, the loader's own pure batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

README = Path(__file__).parents[1] / "README.md"


def quick_start_code() -> str:
    text = README.read_text()
    section = text.split("\n## Python quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "the quick start has its numpy block and its torch block"
    return "\n".join(blocks)


def test_the_quick_start_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    exec(compile(quick_start_code(), str(README), "exec"), namespace)
    capsys.readouterr()

    loader, mixture = namespace["loader"], namespace["mixture"]
    # Tokenize: the training shards hold tokenizer(text) + eos for every jsonl line, in order.
    tok = Tokenizer.from_file(namespace["tokenizer"])
    lines = (tmp_path / "quickstart" / "text" / "train" / "docs.jsonl").read_text().splitlines()
    expected = [tok.encode(json.loads(line)["text"]).ids + [0] for line in lines]
    source = mixture.training_sources[0]
    bounds = [*source.doc_starts().tolist(), source.num_tokens]
    assert [source.read(a, b).tolist() for a, b in zip(bounds[:-1], bounds[1:])] == expected
    # Iterate and resume: three batches consumed, state at step 3.
    assert namespace["state"]["step"] == 3 and loader.step == 3
    assert namespace["state"]["tokens_consumed"] == 3 * 8 * 64
    # Held-out: the fixed eval set, 8 sequences in batches of 4, from the held-out source only.
    held = namespace["held_out"]
    assert [b["input_ids"].shape for b in held] == [(4, 64), (4, 64)]
    again = loader.eval_batches("heldout", batch_size=8)[0]["input_ids"]
    np.testing.assert_array_equal(np.concatenate([b["input_ids"] for b in held]), again)
    # torch: the DataLoader's last batch is the loader's own batch_at of that step (3 + 3).
    batch = namespace["batch"]
    np.testing.assert_array_equal(batch["input_ids"].numpy(), loader.batch_at(6)["input_ids"])

"""MixtureLoader: Grain iteration equals batch_at, elastic resume in a new process,
state checks, and the fixed evaluation set."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_mixture_support import VOCAB, random_docs, two_source_mixture, write_shard

from olmo_data import DataError, MixtureLoader, load_mixture
from olmo_data.shards import _FOOTER, _FOOTER_MAGIC, ShardSource, read_manifest

B = 8  # global batch


@pytest.fixture
def mixture(tmp_path):
    return load_mixture(two_source_mixture(tmp_path))


def take(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            return out
    raise AssertionError("loader ended early")


@pytest.mark.parametrize("prefetch", [0, 3])
def test_iteration_equals_batch_at(mixture, prefetch):
    loader = MixtureLoader(mixture, B, dp_rank=1, dp_size=2, start_step=5, prefetch=prefetch)
    batches = take(loader, 20)
    assert loader.step == 25
    order = mixture.order
    for i, batch in enumerate(batches):
        full = order.global_batch(5 + i, B)
        for k in batch:
            assert batch[k].tobytes() == full[k][B // 2 :].tobytes()


_RESUME_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from olmo_data import MixtureLoader, load_mixture
    mixture_path, state_path, dp_size, steps, out = sys.argv[1:]
    dp_size, steps = int(dp_size), int(steps)
    state = json.load(open(state_path))
    mixture = load_mixture(mixture_path)
    ranks = []
    for r in range(dp_size):
        loader = MixtureLoader(mixture, 8, dp_rank=r, dp_size=dp_size, prefetch=2)
        loader.load_state_dict(state)
        got = []
        for batch in loader:
            got.append(batch["input_ids"])
            if len(got) == steps:
                break
        ranks.append(np.stack(got))  # [steps, rows, S]
        assert loader.state_dict()["step"] == state["step"] + steps
    np.save(out, np.concatenate(ranks, axis=1))  # rank slices side by side = global rows
    """
)


@pytest.mark.parametrize("dp_before, dp_after", [(2, 4), (4, 1)])
def test_resume_in_a_new_process_with_another_dp_size(tmp_path, dp_before, dp_after):
    path = two_source_mixture(tmp_path)
    mixture = load_mixture(path)
    # the uninterrupted run, single rank
    reference = np.stack([b["input_ids"] for b in take(MixtureLoader(mixture, B, prefetch=2), 12)])
    # consume 7 global batches with dp_before ranks
    loaders = [MixtureLoader(mixture, B, r, dp_before, prefetch=2) for r in range(dp_before)]
    for ld in loaders:
        take(ld, 7)
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)
    assert states[0]["step"] == 7 and states[0]["tokens_consumed"] == 7 * B * 16
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps(states[0]))
    out = tmp_path / "resumed.npy"
    script = tmp_path / "resume.py"
    script.write_text(_RESUME_SCRIPT)
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # nothing may depend on str hashing
    subprocess.run(
        [sys.executable, str(script), str(path), str(state_path), str(dp_after), "5", str(out)], check=True, env=env
    )
    assert np.load(out).tobytes() == reference[7:12].tobytes()


def test_fingerprint_mismatch(tmp_path, mixture, caplog):
    loader = MixtureLoader(mixture, B)
    state = {**loader.state_dict(), "fingerprint": "0" * 64, "step": 3, "tokens_consumed": 3 * B * 16}
    with pytest.raises(DataError) as e:
        loader.load_state_dict(state)
    # names the recipe key a user sets, as the trainers' command line spells it
    assert "fingerprint" in str(e.value) and " differs " in str(e.value)
    assert str(e.value).endswith(
        "; restore the original data, or resume anyway with --data.allow_fingerprint_mismatch=true "
        "(recipe field data.allow_fingerprint_mismatch)"
    )
    assert loader.step == 0
    with caplog.at_level(logging.WARNING, logger="olmo_data.loader"):
        loader.load_state_dict(state, allow_fingerprint_mismatch=True)
    assert loader.step == 3
    assert any(
        "data.allow_fingerprint_mismatch=true" in r.message and r.levelno == logging.WARNING for r in caplog.records
    )


def test_state_checks_seed_and_batch_size(mixture):
    state = MixtureLoader(mixture, B, start_step=4).state_dict()
    with pytest.raises(DataError, match="seed"):
        MixtureLoader(mixture, B).load_state_dict({**state, "seed": 1})
    with pytest.raises(DataError, match="global batch size or sequence_length changed"):
        MixtureLoader(mixture, 2 * B).load_state_dict(state)
    with pytest.raises(ValueError, match="multiple of dp_size 3"):
        MixtureLoader(mixture, B, dp_size=3)


def test_eval_set_is_fixed(tmp_path, mixture):
    held = mixture.held_out_sources["heldout"]
    a = MixtureLoader(mixture, B, start_step=100).eval_batches("heldout", 3)
    b = MixtureLoader(load_mixture(mixture.path), 2 * B, dp_rank=1, dp_size=2).eval_batches("heldout", 4)
    assert [x["input_ids"].shape[0] for x in a] == [3, 1]  # sequences_per_source 4
    rows_a = np.concatenate([x["input_ids"] for x in a])
    rows_b = np.concatenate([x["input_ids"] for x in b])
    assert rows_a.tobytes() == rows_b.tobytes()
    # each row is a distinct 16-token window of the held-out source
    tokens = held.read(0, held.num_tokens)
    windows = {tokens[i * 16 : (i + 1) * 16].tobytes(): i for i in range(held.num_tokens // 16)}
    found = [windows[r.astype(np.uint32).tobytes()] for r in rows_a]
    assert len(set(found)) == 4
    with pytest.raises(DataError, match="no held_out source named 'nope'"):
        MixtureLoader(mixture, B).eval_batches("nope", 2)


def test_repetition_limit_stops_within_one_block_of_the_budget(tmp_path):
    import yaml

    path = two_source_mixture(tmp_path, ratios=(0.9, 0.1), seq=4)
    config = yaml.safe_load(path.read_text())
    config["sources"][0]["max_repetition"] = 1.0
    path.write_text(yaml.safe_dump(config))
    mixture = load_mixture(path)
    # by hand: code has 6292 // 4 = 1573 windows, prose 3147; an epoch is 4720 slots in
    # 4720 // 1024 = 4 blocks of 1180, of which 0.9 is code (1062 per block). One epoch of
    # code (the cap) lasts ~1573 / 0.9 = 1748 instances = step 218, inside block 1 (1180..2360).
    assert mixture.num_instances() == [1573, 3147] and mixture.order.num_blocks == 4
    loader = MixtureLoader(mixture, B, prefetch=2)
    consumed = 0
    with pytest.raises(
        DataError,
        match="global batch [0-9]+: global instance [0-9]+ would read source 'code' .* beyond max_repetition: 1573 instances = 1 epochs",
    ):
        for _ in loader:
            consumed += 1
    assert 1180 // B <= consumed <= 1748 // B


def out_of_vocab(docs: list[np.ndarray]) -> list[np.ndarray]:
    """Documents whose every 8th token (from each start) is 5000 >= VOCAB: any 17-token
    read inside them holds one, and a read crossing into them holds their token 0."""
    for d in docs:
        d[:-1][::8] = 5000
    return docs


def forge_max_token_id(shard: Path, max_token_id: int) -> None:
    """Rewrite a shard's manifest to claim `max_token_id`. No checksum covers the manifest
    (the footer records only its length, rewritten here), so the forged shard is consistent:
    every chunk and the doc-start index still match their sha256."""
    data = shard.read_bytes()
    length, _ = _FOOTER.unpack(data[-_FOOTER.size :])
    manifest = read_manifest(shard)
    manifest["max_token_id"] = max_token_id
    blob = json.dumps(manifest, sort_keys=True).encode()
    shard.write_bytes(data[: len(data) - _FOOTER.size - length] + blob + _FOOTER.pack(len(blob), _FOOTER_MAGIC))
    ShardSource(shard).verify()


def test_forged_manifest_cannot_smuggle_ids_past_the_vocab(tmp_path):
    path = two_source_mixture(tmp_path)
    docs = random_docs(3, 100)  # the p1 of two_source_mixture, its last 3 documents out of vocab
    shard = write_shard(tmp_path / "prose" / "p1.shard", docs[:97] + out_of_vocab(docs[97:]))
    with pytest.raises(DataError, match="p1.shard: token id 5000 >= vocab_size 4096"):
        load_mixture(path)  # an honest manifest is refused when the mixture opens
    forge_max_token_id(shard, VOCAB - 1)
    mixture = load_mixture(path)  # the up-front check trusts the manifest
    assert mixture.training_sources[1].max_token_id == VOCAB - 1
    bad = mixture.training_sources[1].sources[0].num_tokens + sum(len(d) for d in docs[:97])
    loader = MixtureLoader(mixture, B, prefetch=0)
    # By hand: prose window k reads prose tokens [16k, 16k + 17) (its labels take one more),
    # so a batch reads an out-of-vocab id iff one of its prose rows has 16k + 17 > bad.
    clean = 0
    for step in range(100):
        source, within = mixture.order.instances_at(np.arange(step * B, (step + 1) * B))
        if not np.any((source == 1) & (within * 16 + 17 > bad)):
            batch = loader.batch_at(step)
            assert batch["input_ids"].max() < VOCAB and batch["labels"].max() < VOCAB
            clean += 1
            continue
        with pytest.raises(DataError) as e:
            loader.batch_at(step)
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"{shard}: token id 5000 at token ")
        for part in (">= vocab_size 4096", "declares max_token_id 4095", "re-create the file", "vocab_size"):
            assert part in message, (part, message)
        at = int(re.search(r"at token ([0-9]+) ", message).group(1))  # an offset within p1, holding 5000
        assert at >= bad - mixture.training_sources[1].sources[0].num_tokens
        assert ShardSource(shard).read(at, at + 1).tolist() == [5000]
        break
    else:
        raise AssertionError("no batch in 100 steps read the out-of-vocab documents")
    assert clean == step >= 1  # the in-vocab batches before it were served as usual
    # Grain iteration hands out no batch of that step either.
    with pytest.raises(DataError, match="p1.shard: token id 5000"):
        take(MixtureLoader(mixture, B, start_step=step, prefetch=2), 1)


def test_forged_held_out_manifest_fails_the_eval_batches(tmp_path):
    path = two_source_mixture(tmp_path)
    shard = write_shard(tmp_path / "heldout" / "h.shard", out_of_vocab(random_docs(4, 40)))
    forge_max_token_id(shard, VOCAB - 1)
    loader = MixtureLoader(load_mixture(path), B)
    with pytest.raises(DataError, match=f"^{shard}: token id 5000 at token [0-9]+ >= vocab_size 4096"):
        loader.eval_batches("heldout", 4)

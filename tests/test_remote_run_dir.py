"""Run dirs on object storage for both trainers (issue 19: checkpoints, metrics, errors), against
real local emulators the tests start (tests/support/object_store.py): moto's S3 server and
fake-gcs-server, each behind a relay that can be cut.

The independent reference is always the same run with a local run dir: its losses (compared
bitwise, both runs being one process on the same CPU) and batch digests. What lands in the
bucket is listed with fileio, and the commit rule is read back with the same olmo_run.checkpoints functions
a resume uses.

Each framework writes checkpoints to both schemes: torch (DCP's fsspec writer) on s3:// in the
crash test and gs:// in the resume test; JAX (Orbax) on gs:// directly in the crash test and
s3:// (staged locally, then uploaded) in the resume test.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from ranks import run_cli_forked

import olmo_run  # noqa: F401  (serves gs:// and s3:// paths)
from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_model import layout_loss_tolerance
from olmo_run.checkpoints import complete_checkpoints, read_verified_meta
from olmo_run.metrics import read_metrics
from olmo_run.run_dir import local_copy

pytest_plugins = ["object_store"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 4
ARGS = [
    "--model=tiny",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=512",
    f"--train.steps={STEPS}",
    "--train.precision=fp32",
    "--checkpoint.every=2",
    "--eval.every=1000",
    "--log.progress=false",
    "--torch.parallel=none",
]


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("olmo-cache")


@pytest.fixture(autouse=True)
def cache(module_cache, monkeypatch):
    """Local copies of remote run dirs, and the data cache (the sample mixture's leakage report,
    computed once for the module), under this module's own folder (each test's bucket, hence
    each local copy, is new)."""
    monkeypatch.setenv("OLMO_CACHE", str(module_cache))


def main(framework: str):
    return importlib.import_module(f"olmo_train_{framework}.cli").main


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}


def objects(url: URLPath) -> list[str]:
    return [URLPath(f).relative(url) for f in fileio.find(str(url))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """framework -> the losses of the 4-step run with a local run dir (run once per framework)."""
    done: dict[str, dict[int, float]] = {}

    def get(framework: str) -> dict[int, float]:
        if framework not in done:
            run = tmp_path_factory.mktemp(f"{framework}-local") / "run"
            assert main(framework)([*ARGS, f"--run_dir={run}"]) == 0
            done[framework] = losses(run)
        return done[framework]

    return get


# Two data-parallel ranks: torch processes (DDP), JAX devices.
TWO = {"torch": ["--torch.parallel=ddp"], "jax": ["--jax.mesh.data=2"]}


def trainer_process(
    framework: str, args: list[str], kill_during: int | None = None, ranks: int = 1
) -> subprocess.CompletedProcess:
    """The trainer's CLI in a process of its own (tests/support/ranks.py: forked with the trainer
    imported, its environment this test's, pointing at the store, so its storage clients are
    its own); ``ranks`` gloo processes for torch, simulated CPU devices for JAX. With
    ``kill_during`` it SIGKILLs itself before the step-N checkpoint commits
    (tests/support/kill_during_checkpoint.py)."""
    if framework == "jax":  # this process's XLA_FLAGS (a CPU code path chosen by flags) plus the device count
        env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ranks}".strip()}
        return run_cli_forked("jax", args, env=env, timeout=300, kill_during=kill_during)
    return run_cli_forked("torch", args, ranks, env={"OMP_NUM_THREADS": "1"}, timeout=300, kill_during=kill_during)


@pytest.mark.parametrize("framework, scheme", [("torch", "s3"), ("jax", "gs")])
def test_killed_during_a_checkpoint_write_resumes_bitwise(framework, scheme, request, reference, capsys):
    """SIGKILL while the step-4 checkpoint is written (all its objects uploaded, meta.json not):
    step 2 stays the latest; the rerun resumes from step 2 with the local run's losses, bitwise,
    and its step-4 commit (keep=1) deletes every object of step 2."""
    store = request.getfixturevalue("s3_store" if scheme == "s3" else "gcs_store")
    run = URLPath(store.url("runs/a"))
    args = [*ARGS, f"--run_dir={run}", "--checkpoint.keep=1"]
    killed = trainer_process(framework, args, kill_during=STEPS)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [s for s, _ in complete_checkpoints(run)] == [2]
    names = objects(run / "checkpoints")
    four = [n for n in names if n.startswith("step_00000004/")]
    assert four and "step_00000004/meta.json" not in four  # written, never committed
    assert "step_00000002/meta.json" in names
    want = reference(framework)
    # Uploaded with the step-2 checkpoint (and maybe later by the timed upload: resume drops those).
    got = losses(run)
    assert {1, 2} <= set(got) and got == {s: want[s] for s in got}

    if framework == "torch":  # in this process: cheaper, and fileio's clients follow the environment
        capsys.readouterr()
        # Also a TensorBoard sink and a trace of step 3: written locally, uploaded to the bucket.
        observe = ["--log.sinks=[tensorboard]", "--profile.start_step=3", "--profile.steps=1"]
        assert main(framework)([*args, *observe]) == 0
        said = capsys.readouterr().out
        uploaded = objects(run)
        assert "profile/steps_3-3/trace_rank0.json" in uploaded
        assert [n for n in uploaded if n.startswith("tensorboard/events.out.tfevents.")]
    else:  # the GCS emulator settings TensorStore gets, and etils' gcsfs client, last a process: a fresh one
        resumed = trainer_process(framework, args)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        said = resumed.stdout
    assert f"resumed from {run}/checkpoints/step_00000002 at step 2" in said
    assert losses(run) == want  # steps 3 and 4 bitwise the uninterrupted local run's
    assert [s for s, _ in complete_checkpoints(run)] == [STEPS]
    assert read_verified_meta(run / "checkpoints" / "step_00000004")["step"] == STEPS
    # keep=1: the prune deleted step 2's objects, and the rewritten step 4 replaced the partial one.
    assert not [n for n in objects(run / "checkpoints") if not n.startswith("step_00000004/")]
    # The run's small files: in the bucket, and process 0's local copy.
    for name in ("recipe.yaml", "spec.json", "metrics.jsonl", "loss.png"):
        assert fileio.exists(str(run / name)), name
        assert (local_copy(run) / name).is_file(), name
    assert fileio.read_bytes(str(run / "metrics.jsonl")) == (local_copy(run) / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize("framework, scheme", [("torch", "gs"), ("jax", "s3")])
def test_resume_from_the_bucket_after_an_uncommitted_save(framework, scheme, request, reference):
    """In this process: a 4-step run to the bucket (keep=2), step 4 then made uncommitted (its
    meta.json deleted, as a crash before the commit leaves it), the local copy deleted (a
    fresh host): the rerun resumes from step 2 and matches the local run bitwise. Then the same
    again, resumed on two ranks (elastic)."""
    store = request.getfixturevalue("s3_store" if scheme == "s3" else "gcs_store")
    if scheme == "gs":
        request.getfixturevalue("no_gcs_retry_wait")
    run = URLPath(store.url("runs/b"))
    args = [*ARGS, f"--run_dir={run}", "--checkpoint.keep=2"]
    assert main(framework)(args) == 0
    want = reference(framework)
    assert losses(run) == want
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4]
    fileio.delete(str(run / "checkpoints" / "step_00000004" / "meta.json"))
    fileio.delete(str(run / "loss.png"))
    shutil.rmtree(local_copy(run))
    assert main(framework)(args) == 0
    assert losses(run) == want
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4]
    for step in (2, 4):
        read_verified_meta(run / "checkpoints" / f"step_{step:08d}")

    # Elastic, from the bucket: the same uncommitted step 4 and a fresh host, resumed by two
    # processes (torch: DDP over gloo, with torchrun's environment) or on two devices (JAX: a
    # data axis of 2). Steps 3 and 4 see the same global batches (digests) and follow the local
    # run within layout_loss_tolerance of the step's 8 x 64 token losses, counted from the step-2
    # checkpoint (the reordered fp32 sum at step 3, plus AdamW's drift envelope at step 4).
    records = {r["step"]: r for r in read_metrics(run) if r["kind"] == "train"}
    fileio.delete(str(run / "checkpoints" / "step_00000004" / "meta.json"))
    shutil.rmtree(local_copy(run))
    two = trainer_process(framework, [*args, *TWO[framework]], ranks=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/step_00000002 at step 2" in two.stdout
    assert "x 2 data-parallel" in two.stdout
    again = {r["step"]: r for r in read_metrics(run) if r["kind"] == "train"}
    assert sorted(again) == list(range(1, STEPS + 1))
    for step in (3, 4):
        assert again[step]["batch_digest"] == records[step]["batch_digest"]
        assert abs(again[step]["loss"] - want[step]) <= layout_loss_tolerance(want[step], 8 * 64, step - 2), step


def test_the_store_going_away_mid_run_is_one_line_and_the_last_checkpoint_survives(
    s3_store, s3_emulator, monkeypatch, capsys
):
    """The relay to the store is cut as DCP starts writing the step-4 checkpoint: the run stops
    with one line naming the URL and the fix, and through a new relay step 2 is still the
    verified latest."""
    from object_store import CountingProxy

    import olmo_train_torch.checkpoint as checkpoint

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retry knob: fail at once
    run = URLPath(s3_store.url("runs/c"))
    writer = checkpoint._writer

    def cut_then_write(ckpt):
        if ckpt.name == "step_00000004":
            s3_store.proxy.stop()
        return writer(ckpt)

    monkeypatch.setattr(checkpoint, "_writer", cut_then_write)
    capsys.readouterr()
    assert main("torch")([*ARGS, f"--run_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert str(run) in err[0] and "cannot reach" in err[0] and "AWS_ENDPOINT_URL" in err[0], err[0]
    relay = CountingProxy(s3_emulator.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
    try:
        assert [s for s, _ in complete_checkpoints(run)] == [2]
        assert read_verified_meta(run / "checkpoints" / "step_00000002")["step"] == 2
    finally:
        relay.stop()


def test_an_unknown_bucket_is_one_line(gcs_store, capsys):
    capsys.readouterr()
    missing = f"gs://no-such-bucket-{gcs_store.bucket}/run"
    assert main("torch")([*ARGS, f"--run_dir={missing}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and f"no-such-bucket-{gcs_store.bucket}" in err[0], err


def test_missing_credentials_are_one_line(s3_store, monkeypatch, capsys):
    capsys.readouterr()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert main("torch")([*ARGS, f"--run_dir={s3_store.url('run')}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no AWS credentials" in err[0] and "AWS_ACCESS_KEY_ID" in err[0], err


def tokenized_mixture(folder: Path, output: str, tokenizer: Path, texts: Path) -> None:
    """`olmo-data tokenize` of ``texts`` into ``output`` (a folder or a bucket URL)."""
    from olmo_data.tokenize import tokenize_main

    args = ["--input", str(texts / "*.jsonl"), "--tokenizer", str(tokenizer), "--output", output]
    assert tokenize_main([*args, "--docs-per-shard", "40", "--chunk-tokens", "256"]) == 0


def test_a_mixture_tokenized_to_s3_trains_on_the_local_batches(s3_store, tmp_path):
    """The same texts tokenized to local disk and to s3:// (by olmo-data tokenize itself), the
    same mixture YAML beside each: two steps of the torch trainer read the same batches
    (its per-step batch digests) and so log the same losses."""
    import json

    import numpy as np
    import yaml

    from olmo_data.sample import train_tokenizer

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(200)]
    texts = tmp_path / "texts"
    texts.mkdir()
    for name, n in (("a", 90), ("b", 70)):
        docs = [" ".join(rng.choice(words, size=int(rng.integers(20, 120)))) for _ in range(n)]
        (texts / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tokenizer = tmp_path / "tokenizer.json"
    train_tokenizer([line for f in texts.glob("*.jsonl") for line in f.read_text().splitlines()], vocab_size=400).save(
        str(tokenizer)
    )
    local = tmp_path / "local"
    tokenized_mixture(local, str(local / "shards"), tokenizer, texts)
    tokenized_mixture(local, s3_store.url("m/shards"), tokenizer, texts)
    assert fileio.listdir(s3_store.url("m/shards")) == sorted(p.name for p in (local / "shards").iterdir())
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(tokenizer)).token_to_id("<|endoftext|>")
    mixture = {
        "name": "tokenized",
        "sequence_length": 64,
        "seed": 7,
        "eos_token_id": eos,
        "vocab_size": 400,
        "sources": [{"name": "text", "paths": ["shards"], "format": "shards", "ratio": 1.0}],
        "held_out": [],
    }
    (local / "mixture.yaml").write_text(yaml.safe_dump(mixture))
    remote_yaml = s3_store.upload(local / "mixture.yaml", "m/mixture.yaml")
    digests = {}
    for where, yaml_path in (("local", local / "mixture.yaml"), ("s3", remote_yaml)):
        run = tmp_path / f"run-{where}"
        two = [a.replace(f"--train.steps={STEPS}", "--train.steps=2") for a in ARGS]
        assert main("torch")([*two, f"--data.mixture={yaml_path}", f"--run_dir={run}"]) == 0
        digests[where] = [(r["step"], r["batch_digest"], r["loss"]) for r in read_metrics(run) if r["kind"] == "train"]
    assert [s for s, _, _ in digests["local"]] == [1, 2]
    assert digests["s3"] == digests["local"]


def test_a_denied_write_is_one_line(s3_store, s3_emulator, monkeypatch, capsys):
    """Credentials that may list and read but not write: the run stops before training with
    one line naming the URL, the operation and the permission to grant."""
    with s3_emulator.restricted_credentials(["s3:ListBucket", "s3:GetObject"]) as (key_id, secret):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        capsys.readouterr()
        assert main("torch")([*ARGS, f"--run_dir={s3_store.url('run')}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "permission denied (write)" in err[0] and "s3:PutObject" in err[0], err
    assert s3_store.url("run") in err[0], err

"""olmo-convert from a trainer checkpoint on object storage (issue 19) to a local hf: folder,
against the local emulators the tests start (tests/support/object_store.py). The reference is
the same checkpoint converted from local disk: a tiny run is trained locally, its run dir
uploaded by the emulator's own client (boto3 / plain HTTP, not the code under test), and both
conversions must give the same tensors, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.numpy import load_file

from olmo_tools.convert import main as convert_main

pytest_plugins = ["object_store"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPE = [
    "--model=tiny",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=512",
    "--train.steps=2",
    "--train.precision=fp32",
    "--checkpoint.every=1",
    "--eval.every=1000",
    "--log.progress=false",
    "--checkpoint.async_save=false",
    "--torch.parallel=none",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_helpers):
    """framework -> a local run dir with checkpoints at steps 1 and 2 (trained once per module)."""
    done: dict[str, Path] = {}

    def get(framework: str) -> Path:
        if framework not in done:
            run = tmp_path_factory.mktemp(f"{framework}-convert-remote") / "run"
            run_helpers.train(framework, [*RECIPE, f"--run_dir={run}"])
            done[framework] = run
        return done[framework]

    return get


def tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize(
    "framework, scheme, form",
    [
        ("torch", "s3", "torch:{run}"),
        ("torch", "gs", "torch-run:{run}/checkpoints/step_00000001"),
        ("jax", "gs", "jax:{run}/checkpoints/latest"),
    ],
)
def test_a_remote_trainer_checkpoint_converts_to_the_same_hf_tensors(
    framework, scheme, form, runs, request, tmp_path, monkeypatch
):
    store = request.getfixturevalue("s3_store" if scheme == "s3" else "gcs_store")
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))
    local = runs(framework)
    remote = store.upload_tree(local, "runs/x")
    assert convert_main([form.format(run=local), f"hf:{tmp_path / 'from-local'}"]) == 0
    assert convert_main([form.format(run=remote), f"hf:{tmp_path / 'from-remote'}"]) == 0
    want, got = tensors(tmp_path / "from-local"), tensors(tmp_path / "from-remote")
    assert want and sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and (got[name] == array).all(), name
    assert (tmp_path / "from-remote" / "config.json").read_text() == (
        tmp_path / "from-local" / "config.json"
    ).read_text()


def test_a_remote_run_without_a_checkpoint_and_a_remote_destination_are_one_line(s3_store, tmp_path, capsys):
    capsys.readouterr()
    assert convert_main([f"torch:{s3_store.url('nothing-here')}", f"hf:{tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and s3_store.url("nothing-here") in err[0], err
    assert convert_main([f"hf:{tmp_path}", f"hf:{s3_store.url('out')}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "writes local destinations" in err[0], err

"""olmo-convert and trainer checkpoints (issue 23): a source whose files no longer match the
checksums in its meta.json is refused in one line, both as a training state (``torch-run:``)
and as weights (``torch:`` on one checkpoint folder), before anything is written; and the
``.NAME.partial-PID`` temporaries that interrupted conversions left are removed by the next
conversion into the same folder when their process is gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_checks import refused

from olmo_tools.convert import main as convert_main

# A tiny torch run with one checkpoint, at step 2.
RECIPE = [
    "--model=tiny",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=512",
    "--train.steps=2",
    "--train.precision=fp32",
    "--checkpoint.every=2",
    "--eval.every=1000",
    "--log.progress=false",
    "--checkpoint.async_save=false",
    "--torch.parallel=none",
]
# The fixtures (one_torch_thread, run_helpers) live in the workspace's root conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, run_helpers) -> Path:
    run = tmp_path_factory.mktemp("convert-integrity") / "run"
    run_helpers.train("torch", [*RECIPE, f"--run_dir={run}"])
    return run / "checkpoints" / "step_00000002"


def fails(capsys, argv: list[str], *needles: str) -> None:
    refused(convert_main, capsys, argv, *needles)


def test_a_flipped_byte_source_is_refused_before_anything_is_written(checkpoint, tmp_path, capsys):
    damaged = tmp_path / "step_00000002"
    shutil.copytree(checkpoint, damaged)
    distcp = damaged / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0x80  # one sign bit
    distcp.write_bytes(bytes(data))
    for argv in (
        [f"torch-run:{damaged}", f"jax-run:{tmp_path / 'as-jax'}"],
        [f"torch:{damaged}", f"hf:{tmp_path / 'as-hf'}"],
    ):
        fails(capsys, argv, str(distcp), "sha256", "damaged", "convert an intact checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


def test_stale_partial_dirs_are_removed_by_the_next_conversion_into_that_folder(checkpoint, tmp_path, capsys):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f".earlier.partial-{gone.pid}"
    running = tmp_path / f".other.partial-{os.getppid()}"  # a conversion still running
    for p in (stale, running):
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"half")
    capsys.readouterr()
    assert convert_main([f"torch:{checkpoint}", f"hf:{tmp_path / 'hf'}"]) == 0
    assert f"removed {stale}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, "hf"]

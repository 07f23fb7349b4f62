"""The README's main jobs, as a new user runs them on a fresh clone: ``uv run --frozen
olmo-train-jax`` and then ``uv run --frozen olmo-train-torch``, from one working directory with
no --run_dir. Each trainer's default run dir is its own (runs/default-jax, runs/default-torch),
so the second command starts a fresh run instead of refusing the first one's checkpoint. The
installed entry points run as subprocesses, at tiny settings (model "tiny", 2 steps of 4
sequences of 64 tokens) so that the test costs seconds, not the README's minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from olmo_run.checkpoints import complete_checkpoints
from olmo_run.metrics import read_metrics

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = [
    "--model=tiny",
    "--train.steps=2",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=256",
    "--log.progress=false",
]


def test_the_readme_training_commands_run_one_after_the_other(tmp_path):
    readme = README.read_text()
    for command in ("uv run --frozen olmo-train-jax\n", "uv run --frozen olmo-train-torch`"):
        assert command in readme, command
    assert "`runs/default-jax/metrics.jsonl`" in readme and "`runs/default-jax/loss.png`" in readme
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for framework in ("jax", "torch"):
        done = subprocess.run(
            [str(bin_dir / f"olmo-train-{framework}"), *TINY],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"olmo-train-{framework}: {done.stderr[-2000:]}"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["default-jax", "default-torch"]
    for framework in ("jax", "torch"):
        run_dir = tmp_path / "runs" / f"default-{framework}"
        train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1, 2]
        ((step, ckpt),) = complete_checkpoints(run_dir)
        assert step == 2 and json.loads((ckpt / "meta.json").read_text())["framework"] == framework
        assert (run_dir / "loss.png").stat().st_size > 0


def test_the_readme_command_table_names_every_command_and_olmo_model_subcommand():
    """Every console script of the workspace's pyproject files, and each subcommand of
    ``olmo-model`` (read from its parser), has a row in the README's table of commands."""
    import argparse
    import tomllib

    from olmo_model.cli import _parser

    table = README.read_text().split("## What is here")[1].split("\n\n")[1]
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `")]
    root = README.parent
    for pyproject in [*root.glob("packages/*/pyproject.toml"), root / "tools" / "pyproject.toml"]:
        for script in tomllib.loads(pyproject.read_text())["project"].get("scripts", {}):
            assert any(script in row for row in rows), f"{script} ({pyproject}) has no row"
    [sub] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub.choices) == ["describe", "presets"]
    for name in sub.choices:
        assert any(row.startswith(f"| `olmo-model {name}") for row in rows), name

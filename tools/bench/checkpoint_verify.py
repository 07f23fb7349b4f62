"""What checkpoint checksums cost: save and restore of a training state with and without them,
for both trainers' formats (Orbax for olmo-train-jax, torch DCP for olmo-train-torch), side by
side in one run.

    uv run --frozen python tools/bench/checkpoint_verify.py [--spec olmo3-190m] [--repeats 2] [--dir DIR]

The state is what a checkpoint of ``--spec`` holds: the parameters and both AdamW moments,
float32, random values (random bytes do not compress, like trained weights), in each
framework's layout as its trainer saves it, written with the framework's own save:

- save: the framework's save, then the commit: ``checkpoints.commit_checkpoint`` (hashes every file
  and writes meta.json, what the trainers do) against writing meta.json alone (the commit
  before checksums);
- restore: ``checkpoints.read_verified_meta`` (size and sha256 of every file) then the framework's
  restore, against the framework's restore alone.

Variants alternate within each repeat, so background load hits them alike; the table gives the
fastest of the repeats. On a shared machine the framework's own save and restore vary from one
repeat to the next far more than the hashing does: the hashing column is the stable cost. Checkpoints go to ``--dir`` (default: a temporary folder, removed after)
and just-written files are in the page cache, so the hashing reads memory, not the disk: on a
cold cache verification reads each file once more from storage, and the restore that follows
finds it cached. Results go to tools/bench/results/checkpoint_verify-DATE.md as well.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from olmo_data import fileio
from olmo_model import hf_param_shapes, load_spec
from olmo_run.checkpoints import commit_checkpoint, read_verified_meta, training_meta
from olmo_run.recipe import load_recipe

RESULTS = Path(__file__).parent / "results"
# DCP announces on every call that it runs without a process group, which is the point here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def random_state(spec, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """{"params", "exp_avg", "exp_avg_sq"}: name -> float32 array of the spec's parameter shape."""
    rng = np.random.default_rng(seed)
    return {
        part: {name: rng.random(shape, dtype=np.float32) for name, shape in hf_param_shapes(spec).items()}
        for part in ("params", "exp_avg", "exp_avg_sq")
    }


class TorchDCP:
    """torch.distributed.checkpoint, one process: {"model", "optim"} as get_state_dict lays it out."""

    name = "torch DCP"

    def __init__(self, state):
        import torch

        self.state = {
            "model": {k: torch.from_numpy(v) for k, v in state["params"].items()},
            "optim": {
                "state": {
                    k: {
                        "exp_avg": torch.from_numpy(state["exp_avg"][k]),
                        "exp_avg_sq": torch.from_numpy(state["exp_avg_sq"][k]),
                    }
                    for k in state["params"]
                }
            },
        }

    def save(self, ckpt: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=str(ckpt), no_dist=True)

    def restore(self, ckpt: Path) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        target = {
            "model": {k: torch.empty_like(v) for k, v in self.state["model"].items()},
            "optim": {
                "state": {
                    k: {m: torch.empty_like(t) for m, t in s.items()} for k, s in self.state["optim"]["state"].items()
                }
            },
        }
        dcp.load(target, checkpoint_id=str(ckpt), no_dist=True)


class JaxOrbax:
    """Orbax, as olmo_train_jax.checkpoint saves {"params", "opt_state", "step"} in ckpt/state and
    restores it onto abstract arrays (its load_checkpoint)."""

    name = "jax Orbax"

    def __init__(self, state):
        import jax

        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self.params = state["params"]
        self.opt_state = {"mu": state["exp_avg"], "nu": state["exp_avg_sq"]}
        self.abstract = [
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), t)
            for t in (self.params, self.opt_state)
        ]

    def save(self, ckpt: Path) -> None:
        import orbax.checkpoint as ocp

        from olmo_train_jax.checkpoint import STATE_DIR

        with ocp.StandardCheckpointer() as orbax:
            orbax.save(ckpt.resolve() / STATE_DIR, {"params": self.params, "opt_state": self.opt_state, "step": 1})
            orbax.wait_until_finished()

    def restore(self, ckpt: Path) -> None:
        import jax

        from olmo_train_jax.checkpoint import load_checkpoint

        params, opt_state, _ = load_checkpoint(ckpt, *self.abstract)
        jax.block_until_ready((params, opt_state))
        del params, opt_state


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(fmt, root: Path, meta: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per repeat of: save plain / with checksums (and its commit alone), restore plain /
    verified (and the verification alone). Odd repeats run the two variants in reverse order."""
    out: dict[str, list[float]] = {
        k: [] for k in ("save", "save+sums", "commit", "restore", "verify+restore", "verify")
    }
    for r in range(repeats):
        plain, summed = root / f"plain-{r}", root / f"summed-{r}"
        for ckpt in (plain, summed):
            ckpt.mkdir(parents=True)

        def save_plain():
            out["save"].append(
                timed(lambda: (fmt.save(plain), fileio.write_text(plain / "meta.json", json.dumps(meta))))
            )

        def save_summed():
            saved = timed(lambda: fmt.save(summed))
            out["commit"].append(timed(lambda: commit_checkpoint(summed, meta)))
            out["save+sums"].append(saved + out["commit"][-1])

        def restore_plain():
            out["restore"].append(timed(lambda: fmt.restore(plain)))

        def restore_verified():
            out["verify"].append(timed(lambda: read_verified_meta(summed)))
            out["verify+restore"].append(out["verify"][-1] + timed(lambda: fmt.restore(summed)))

        for pair in ((save_plain, save_summed), (restore_plain, restore_verified)):
            for step in pair if r % 2 == 0 else pair[::-1]:
                step()
        for ckpt in (plain, summed):
            shutil.rmtree(ckpt)
    return out


def size_of(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="olmo3-190m", help="preset or spec file")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, help="where the checkpoints are written (default: a temporary folder)")
    args = parser.parse_args()

    spec = load_spec(args.spec)
    state = random_state(spec)
    n_bytes = sum(a.nbytes for part in state.values() for a in part.values())
    meta = training_meta("bench", 1, spec, load_recipe(None, [f"--model={args.spec}"]), {"step": 1})
    root = Path(tempfile.mkdtemp(prefix="checkpoint-verify-", dir=args.dir))
    results = {}
    try:
        for make in (TorchDCP, JaxOrbax):
            fmt = make(state)
            fmt.save(root / "probe")
            on_disk = size_of(root / "probe")
            shutil.rmtree(root / "probe")
            results[fmt.name] = (bench(fmt, root, meta, args.repeats), on_disk)
            del fmt
    finally:
        shutil.rmtree(root, ignore_errors=True)

    title = (
        f"checkpoint save/restore with and without checksums: {spec.name}, params + AdamW moments fp32 "
        f"({n_bytes / 2**30:.2f} GiB), fastest of {args.repeats}"
    )
    headers = (
        "format",
        "on disk GiB",
        "save s",
        "save + checksums s",
        "ratio",
        "restore s",
        "verify + restore s",
        "ratio",
        "hashing s (commit / verify)",
        "sha256 GiB/s",
    )
    rows = []
    for name, (t, on_disk) in results.items():
        best = {k: min(v) for k, v in t.items()}
        rows.append(
            (
                name,
                f"{on_disk / 2**30:.2f}",
                f"{best['save']:.2f}",
                f"{best['save+sums']:.2f}",
                f"{best['save+sums'] / best['save']:.2f}x",
                f"{best['restore']:.2f}",
                f"{best['verify+restore']:.2f}",
                f"{best['verify+restore'] / best['restore']:.2f}x",
                f"{best['commit']:.2f} / {best['verify']:.2f}",
                f"{on_disk / 2**30 / best['verify']:.2f}",
            )
        )
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="left" if h == "format" else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)

    import jax
    import torch

    today = datetime.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"checkpoint_verify-{today}.md"
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.machine(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.machine()
    )
    out.write_text(
        "\n".join(
            [
                f"# {title}",
                "",
                f"`uv run --frozen python tools/bench/checkpoint_verify.py --spec {args.spec} --repeats {args.repeats}`, {today}",
                "",
                f"Machine: {cpu}, {os.cpu_count()} CPU cores (shared with other work), "
                f"python {platform.python_version()}, torch {torch.__version__}, jax {jax.__version__}; checkpoints on "
                f"the local disk, page cache warm (see the script's docstring).",
                "",
                "| " + " | ".join(headers) + " |",
                "|" + "|".join("---" for _ in headers) + "|",
                *("| " + " | ".join(row) + " |" for row in rows),
                "",
                "Seconds per repeat (commit: hashing + writing meta.json; verify: read_verified_meta):",
                "",
                *(
                    f"- {name} {k}: {', '.join(f'{x:.3f}' for x in v)}"
                    for name, (t, _) in results.items()
                    for k, v in t.items()
                ),
                "",
            ]
        )
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()

"""How far one recipe's run on a device mesh drifts from the same run on one device: per-step
loss difference and, for MoE specs, whether the routing (tokens per expert) is the same.
A diagnostic script, not a test.

    uv run --frozen python packages/olmo-train-jax/bench/layout_drift.py --devices 4 --mesh data=1,expert=4
    uv run --frozen python packages/olmo-train-jax/bench/layout_drift.py --devices 4 --mesh data=1,fsdp=2,expert=2 --steps 20
    uv run --frozen python packages/olmo-train-jax/bench/layout_drift.py --devices 8 --mesh data=8 -- --model=tiny
    uv run --frozen python packages/olmo-train-jax/bench/layout_drift.py --devices 1 --mesh "" --second=--train.micro_batch_size=4

Both runs are ``python -m olmo_train_jax`` in subprocesses (simulated CPU devices via
``XLA_FLAGS``) in a temporary folder, with the same recipe: by default tiny-moe, learned
routing, fp32, 16 sequences of 64 tokens of the embedded sample mixture per step; anything
after ``--`` is added to both runs (dotted overrides), ``--second`` to the mesh run only (with
``--devices 1 --mesh ""`` and a micro-batch split: a one-device reordering of the same maths, the
spread a layout gap is set against), ``--xla-flags`` to both runs' ``XLA_FLAGS`` (e.g.
``--xla_cpu_max_isa=AVX2``: XLA's generated code as on a CPU without AVX-512; library kernels it
calls need not follow). Prints one line per step and the first step whose routing differs. The loss difference is set against ``olmo_model.fp32_mean_tolerance``
(the bound the trainers' cross-layout tests allow: a reordered fp32 sum of the step's token
losses) and the grad norms' relative difference is printed beside it. Learned top-k routing is discontinuous: once a router score pair
is within rounding of a tie, the layouts' different gradient summation orders can send a
(token, slot) to another expert, and the runs part from then on.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from olmo_model import fp32_mean_tolerance
from olmo_run.metrics import read_metrics

DEFAULTS = [
    "--model=tiny-moe",
    "--data.mixture=sample",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=1024",
    "--train.precision=fp32",
    "--log.progress=false",
]


def run(run_dir: Path, devices: int, args: list[str], xla_flags: str = "") -> dict[int, dict]:
    flags = f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "olmo_train_jax", *args, f"--run_dir={run_dir}"], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"the {devices}-device run failed:\n{done.stderr[-3000:]}")
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices of the mesh run")
    parser.add_argument("--mesh", default="data=1,expert=4", help="jax.mesh axes of the mesh run, e.g. data=1,expert=4")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--second", action="append", default=[], help="a recipe override for the mesh run only")
    parser.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for both runs, e.g. --xla_cpu_max_isa=AVX2")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both runs (after --)")
    args = parser.parse_args()
    common = [
        *DEFAULTS,
        f"--train.steps={args.steps}",
        f"--checkpoint.every={args.steps}",
        f"--eval.every={args.steps}",
        *args.overrides,
    ]
    mesh = [f"--jax.mesh.{kv.strip()}" for kv in args.mesh.split(",") if kv.strip()]
    with tempfile.TemporaryDirectory(prefix="layout-drift-") as tmp:
        one = run(Path(tmp) / "one", 1, common, args.xla_flags)
        many = run(Path(tmp) / "mesh", args.devices, [*common, *mesh, *args.second], args.xla_flags)
    moe = "moe_tokens_per_expert" in one[1]
    print(
        f"1 device vs {args.devices} devices ({args.mesh} {' '.join(args.second)}); "
        f"{' '.join(args.overrides) or 'defaults'}{' XLA_FLAGS+=' + args.xla_flags if args.xla_flags else ''}"
    )
    tokens = next(int(o.split("=")[1]) for o in reversed(common) if o.startswith("--train.global_batch_tokens="))
    print(
        "| step | loss, 1 device | loss, mesh | abs difference | fp32 bound | grad norm rel. difference |"
        + (" same routing |" if moe else "")
    )
    print("|---:|---:|---:|---:|---:|---:|" + ("---|" if moe else ""))
    first_flip = None
    for s in sorted(one):
        a, b = one[s], many[s]
        same = a.get("moe_tokens_per_expert") == b.get("moe_tokens_per_expert")
        if moe and not same and first_flip is None:
            first_flip = s
        bound = fp32_mean_tolerance(a["loss"], tokens)
        norm_rel = abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
        print(
            f"| {s} | {a['loss']:.7f} | {b['loss']:.7f} | {abs(a['loss'] - b['loss']):.2e} | {bound:.2e} |"
            f" {norm_rel:.2e} |" + (f" {'yes' if same else 'no'} |" if moe else "")
        )
    upto = [abs(one[s]["loss"] - many[s]["loss"]) for s in sorted(one) if first_flip is None or s < first_flip]
    if moe:
        print(
            f"first step with different routing: {first_flip or 'none'}; largest loss difference before it: "
            f"{max(upto, default=0.0):.2e}"
        )
    else:
        worst = max(abs(one[s]["grad_norm"] - many[s]["grad_norm"]) / one[s]["grad_norm"] for s in one)
        print(f"largest loss difference: {max(upto):.2e}; largest grad norm relative difference: {worst:.2e}")


if __name__ == "__main__":
    main()

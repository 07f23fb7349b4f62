"""Where one olmo-train-jax train step spends its time on XLA:CPU, op by op.

    uv run --frozen python packages/olmo-train-jax/bench/profile_step.py
    uv run --frozen python packages/olmo-train-jax/bench/profile_step.py --preset olmo3-30m --seq 512 --batch 8 --top 25
    uv run --frozen python packages/olmo-train-jax/bench/profile_step.py --moe-experts 128 [--moe-ep]

Runs the trainer's fused step (as ``bench_train.py`` builds it: fp32, one device), then one
more step under ``jax.profiler.trace`` with XLA:CPU's per-thunk trace events on
(``--xla_cpu_enable_xprof_traceme``, set here before jax starts). Prints the summed time per
fusion kind (``copy_bitcast_fusion``: layout copies; ``ynn_fusion``: YNNPACK matmuls and
reductions; ...) and the slowest single ops with their shapes and source op, read from the
optimised HLO (dumped to a temporary folder). Ops of the two XLA:CPU worker threads can
overlap, so the sums exceed the step's wall time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="olmo3-30m")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--top", type=int, default=20, help="how many single ops to list")
    parser.add_argument(
        "--moe-experts",
        type=int,
        default=0,
        help="profile bench_moe.py's MoE block step (learned routing, 2048 tokens) with this many "
        "experts instead of the trainer's step",
    )
    parser.add_argument(
        "--moe-ep",
        action="store_true",
        help="with --moe-experts: the block's experts split over 4 simulated devices (expert "
        "parallel, uniform routing, bench_moe.py part 2); op times of the 4 devices add up",
    )
    args = parser.parse_args()
    module = "jit_loss" if args.moe_experts else "jit_fused"

    work = Path(tempfile.mkdtemp(prefix="olmo-profile-"))
    os.environ["XLA_FLAGS"] = " ".join(
        [
            os.environ.get("XLA_FLAGS", ""),
            "--xla_cpu_enable_xprof_traceme=true",
            f"--xla_dump_to={work / 'hlo'}",
            "--xla_dump_hlo_as_text",
            f"--xla_dump_hlo_module_re={module}",
            "--xla_force_host_platform_device_count=4" if args.moe_ep else "",
        ]
    )
    import jax
    import numpy as np

    from olmo_model import get_preset

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_train import jax_step

    if args.moe_experts:
        step, what = moe_step(args.moe_experts, args.moe_ep)
    else:
        spec = get_preset(args.preset)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, spec.vocab_size, size=(args.batch, args.seq)).astype(np.int32)
        labels = np.roll(ids, -1, axis=1)
        labels[:, -1] = -100
        step, what = jax_step(spec, ids, labels), f"{args.preset}, seq {args.seq}, batch {args.batch}, fp32"
    step()  # compiles
    t0 = time.perf_counter()
    step()
    print(f"{what}: step {time.perf_counter() - t0:.3f} s unprofiled")
    with jax.profiler.trace(str(work / "trace")):
        step()

    hlo = "\n".join(Path(f).read_text() for f in glob.glob(str(work / "hlo" / f"*{module}*after_optimizations.txt")))
    # "%name = shape kind(operands), ... op_name="..."": the op's result shape and where it came from.
    info = {
        m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"%(\S+) = (\S+) [^\n]*?op_name=\"([^\"]*)\"", hlo)
    }
    trace = json.load(gzip.open(glob.glob(str(work / "trace" / "**" / "*.trace.json.gz"), recursive=True)[0]))
    per_op: collections.Counter = collections.Counter()
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") == "X" and name in info:
            per_op[name] += event["dur"] / 1e3  # microseconds -> ms
    per_kind: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for name, ms in per_op.items():
        kind = re.sub(r"\.\d+$", "", name)
        per_kind[kind] += ms
        count[kind] += 1
    print(f"\nsum of op times {sum(per_op.values()):.0f} ms (worker threads overlap); by kind:")
    for kind, ms in per_kind.most_common(15):
        print(f"  {ms:8.1f} ms  {count[kind]:4d} ops  {kind}")
    print(f"\nslowest {args.top} ops:")
    for name, ms in per_op.most_common(args.top):
        shape, op_name = info[name]
        print(f"  {ms:8.1f} ms  {name:32s} {shape:32s} {op_name[-70:]}")
    print(f"\nHLO and trace kept in {work}")


def moe_step(n_experts: int, expert_parallel: bool):
    """bench_moe.py's block gradient step as a no-argument callable, and its description."""
    import jax
    import jax.numpy as jnp
    from bench_moe import D_MODEL, EP, make_block, train_step_fn
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from olmo_train_jax.expert_parallel import EXPERT_AXIS, expert_parallel_experts
    from olmo_train_jax.moe import local_experts

    x = jax.random.normal(jax.random.key(1), (2048, D_MODEL), jnp.float32)
    moe, params = make_block(n_experts)
    if not expert_parallel:
        grad = train_step_fn(moe, "learned", local_experts)
        return (lambda: jax.block_until_ready(grad(params, x))), f"MoE block, {n_experts} experts, 1 device"
    mesh = jax.make_mesh((EP,), (EXPERT_AXIS,), axis_types=(AxisType.Auto,))
    x = jax.device_put(x, NamedSharding(mesh, P(EXPERT_AXIS)))
    placed = {
        name: jax.device_put(t, NamedSharding(mesh, P(EXPERT_AXIS) if name == "routed" else P()))
        for name, t in params.items()
    }
    grad = train_step_fn(moe, "uniform", expert_parallel_experts(mesh))
    return (lambda: jax.block_until_ready(grad(placed, x))), f"MoE block, {n_experts} experts, expert={EP}"


if __name__ == "__main__":
    main()

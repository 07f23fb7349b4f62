"""Where one olmo-train-jax train step spends its time on XLA:CPU, op by op.

    uv run --frozen python packages/olmo-train-jax/bench/profile_step.py
    uv run --frozen python packages/olmo-train-jax/bench/profile_step.py --preset olmo3-30m --seq 512 --batch 8 --top 25

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
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="olmo-profile-"))
    os.environ["XLA_FLAGS"] = " ".join([
        os.environ.get("XLA_FLAGS", ""), "--xla_cpu_enable_xprof_traceme=true", f"--xla_dump_to={work / 'hlo'}",
        "--xla_dump_hlo_as_text", "--xla_dump_hlo_module_re=jit_fused",
    ])
    import jax
    import numpy as np
    from olmo_model import get_preset

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_train import jax_step

    spec = get_preset(args.preset)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.vocab_size, size=(args.batch, args.seq)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    step = jax_step(spec, ids, labels)
    step()  # compiles
    t0 = time.perf_counter()
    step()
    print(f"{args.preset}, seq {args.seq}, batch {args.batch}, fp32: step {time.perf_counter() - t0:.2f} s unprofiled")
    with jax.profiler.trace(str(work / "trace")):
        step()

    hlo = "\n".join(Path(f).read_text() for f in glob.glob(str(work / "hlo" / "*jit_fused*after_optimizations.txt")))
    # "%name = shape kind(operands), ... op_name="..."": the op's result shape and where it came from.
    info = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"%(\S+) = (\S+) [^\n]*?op_name=\"([^\"]*)\"", hlo)
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


if __name__ == "__main__":
    main()

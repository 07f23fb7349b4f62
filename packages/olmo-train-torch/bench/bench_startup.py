"""Start-up time of the torch trainer's model: build + parallelize + initialise (``step.start_model``),
per rank, with the rank's peak resident memory and the bytes of parameters it holds.

    OMP_NUM_THREADS=1 uv run --frozen python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        packages/olmo-train-torch/bench/bench_startup.py [--model olmo3-1b] [--parallel fsdp]
    uv run --frozen python packages/olmo-train-torch/bench/bench_startup.py --model olmo3-32b --fake-ranks 64

gloo on CPU; fp32 master weights (the recipe's precision only sets FSDP2's compute dtype). Each
rank prints one JSON line; the clock starts after the process group and the mesh exist (all ranks
at a barrier) and stops at a barrier after the last rank has its weights. ``--fake-ranks N``: this
process alone as rank 0 of N over torch's fake backend (no collective is needed to start), with
real tensors: one rank of a cluster-sized job, its shards allocated and initialised for real;
``peak_growth_gib`` is how far its resident memory rose during the start-up (Linux VmHWM).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from torch.distributed.tensor import DTensor

from olmo_run.recipe import load_recipe
from olmo_train_torch.parallelize import Distributed, build_expert_mesh, build_mesh, init_distributed
from olmo_train_torch.step import start_model


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith("VmHWM:")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="olmo3-1b")
    parser.add_argument("--parallel", default="fsdp", choices=("fsdp", "hsdp", "ddp"))
    parser.add_argument("--fake-ranks", type=int, help="rank 0 of this many over the fake backend")
    args = parser.parse_args()
    recipe = load_recipe(None, [f"--model={args.model}", f"--torch.parallel={args.parallel}", "--train.precision=bf16"])
    if args.fake_ranks:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.distributed.init_process_group("fake", rank=0, world_size=args.fake_ranks, store=FakeStore())
        d = Distributed(rank=0, world_size=args.fake_ranks, local_rank=0, device=torch.device("cpu"), initialized=True)
    else:
        d = init_distributed("gloo")
    mesh, experts = build_mesh(d, recipe.torch), build_expert_mesh(d, recipe.torch)
    d.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the resident size now (proc(5))
    before = _peak_rss()
    t0 = time.perf_counter()
    model = start_model(recipe, recipe.model_spec(), d, mesh, experts)
    t1 = time.perf_counter()
    d.barrier()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    print(
        json.dumps(
            {
                "rank": d.rank,
                "world": d.world_size,
                "model": args.model,
                "parallel": args.parallel,
                "start_model_s": round(t1 - t0, 2),
                "all_ranks_s": round(time.perf_counter() - t0, 2),
                "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                "peak_growth_gib": round((_peak_rss() - before) / 2**30, 3),
                "local_param_gib": round(sum(t.numel() * t.element_size() for t in local) / 2**30, 3),
            }
        ),
        flush=True,
    )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

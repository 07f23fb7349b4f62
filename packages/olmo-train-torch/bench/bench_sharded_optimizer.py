"""DDP + the sharded optimizer state (``optim.sharded``) against FSDP2, side by side in one run on 4
CPU processes (gloo, 1 thread each): tokens/s per rank and memory per rank, for a dense model and
for an MoE model with expert parallelism 2 (the issue's "DDP + EP + sharded optimizer vs FSDP2 +
EP" comparison at a shape this machine runs).

    uv run --frozen python packages/olmo-train-torch/bench/bench_sharded_optimizer.py [--steps 4]

Each layout runs in its own 4 processes forked from this one before any step (so one's peak does not hide the other's), on the
same model, batch (16 sequences of ``--seq`` tokens, 4 per rank, one micro-step), routing and
precision (fp32): the trainer's ``start_model`` / ``make_optimizer`` / ``train_step``, one
untimed step, then ``--steps`` timed. Per rank (the mean over the 4, the max for memory):

- tokens/s: the rank's tokens over the timed steps' wall time;
- state MiB: the tensors this rank keeps between steps, counted from them: parameters (FSDP2:
  its shards; DDP: the full compute weights) and the optimizer state (FSDP2: its shards'
  moments; sharded: fp32 masters and moments, 1/4 of each tensor of 4096 elements or more);
- peak RSS growth MiB: the process's peak resident memory (``ru_maxrss``) at the end less its
  resident memory before the model was built (weights, gradients, activations, buffers,
  allocator slack).

Prints a markdown table with the ratios sharded / FSDP2.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from olmo_model import get_preset
from olmo_run.recipe import Recipe, batch_layout
from olmo_train_torch.parallelize import Distributed, build_expert_mesh, build_mesh
from olmo_train_torch.step import make_optimizer, start_model, train_step

WORLD, ROWS = 4, 16
LAYOUTS = {  # name: (preset, torch section, optim.sharded)
    "dense FSDP2": ("small", {"parallel": "fsdp"}, False),
    "dense DDP + sharded": ("small", {"parallel": "ddp"}, True),
    "MoE FSDP2 + EP 2": ("small-moe-64", {"parallel": "fsdp", "expert_parallel": 2}, False),
    "MoE DDP + EP 2 + sharded": ("small-moe-64", {"parallel": "ddp", "expert_parallel": 2}, True),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _bytes(tensors) -> int:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _rank(rank: int, port: int, name: str, seq: int, steps: int, out: dict) -> None:
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    d = Distributed(rank=rank, world_size=WORLD, local_rank=rank, device=torch.device("cpu"), initialized=True)
    preset, section, sharded = LAYOUTS[name]
    spec = get_preset(preset).replace(max_position_embeddings=seq)
    recipe = Recipe(
        model=spec.model_dump(mode="json"),
        train={"steps": 10, "precision": "fp32", "global_batch_tokens": ROWS * seq},
        torch=section,
        optim={"sharded": sharded},
    )
    before = _rss_mib()
    model = start_model(recipe, spec, d, build_mesh(d, recipe.torch), build_expert_mesh(d, recipe.torch))
    optimizer = make_optimizer(model, recipe, d.device)
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, size=(ROWS, seq + 1)) + 1, spec.vocab_size - 1)
    per = ROWS // WORLD
    rows = slice(rank * per, (rank + 1) * per)
    batch = {"input_ids": ids[rows, :-1], "labels": ids[rows, 1:], "doc_ids": np.zeros((per, seq), np.int64)}
    layout = batch_layout(ROWS, WORLD)

    def step(i: int) -> None:
        train_step(model, optimizer, batch, layout=layout, d=d, spec=spec, recipe=recipe, lr=1e-4, step=i).read()

    step(1)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(2 + i)
    seconds = time.perf_counter() - t0
    states = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    masters = [m for g in optimizer.param_groups for m in g["params"]] if sharded else []
    state = _bytes(model.parameters()) + _bytes(states) + _bytes(masters)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out[rank] = (per * seq * steps / seconds, state / 2**20, peak - before)
    dist.destroy_process_group()


def run(name: str, seq: int, steps: int) -> tuple[float, float, float]:
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29500 + os.getpid() % 1000 + len(name)
        mp.start_processes(_rank, args=(port, name, seq, steps, out), nprocs=WORLD, start_method="fork")
        per_rank = [out[r] for r in range(WORLD)]
    return (
        float(np.mean([r[0] for r in per_rank])),
        max(r[1] for r in per_rank),
        max(r[2] for r in per_rank),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    results = {name: run(name, args.seq, args.steps) for name in LAYOUTS}
    print(
        f"\n{WORLD} gloo processes x 1 thread, fp32, {ROWS} sequences x {args.seq} tokens per step "
        f"({ROWS // WORLD} per rank, 1 micro-step), {args.steps} timed steps after 1 untimed\n"
    )
    print("| model | layout | tokens/s per rank | state MiB per rank | peak RSS growth MiB per rank |")
    print("|---|---|---|---|---|")
    for name, (tps, state, rss) in results.items():
        print(f"| {LAYOUTS[name][0]} | {name} | {tps:,.0f} | {state:.1f} | {rss:.0f} |")
    print("\n| model | sharded / FSDP2: tokens/s | state | peak RSS growth |")
    print("|---|---|---|---|")
    for fsdp, ddp in (("dense FSDP2", "dense DDP + sharded"), ("MoE FSDP2 + EP 2", "MoE DDP + EP 2 + sharded")):
        a, b = results[fsdp], results[ddp]
        print(f"| {LAYOUTS[fsdp][0]} | {b[0] / a[0]:.2f}x | {b[1] / a[1]:.2f}x | {b[2] / a[2]:.2f}x |")


if __name__ == "__main__":
    main()

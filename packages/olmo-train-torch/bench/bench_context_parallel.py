"""CP = 4 against CP = 1 on 4 CPU processes (gloo), side by side in one run: training tokens/s at a
long sequence and where rank 0's step time goes.

    OMP_NUM_THREADS=1 uv run --frozen python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        packages/olmo-train-torch/bench/bench_context_parallel.py [--seq 8192] [--window 512] [--steps 3]

Both layouts train the same global batch (4 sequences of ``--seq`` tokens) with FSDP2 over the 4
ranks, fp32: CP = 1 gives each rank one whole sequence; CP = 4 splits every sequence over the 4
ranks (each holds 4 x seq/4 tokens: the same tokens per rank). The spec is ``small`` (d_model 128,
4 layers: 3 sliding, 1 global, vocab 4096) with the window at ``--window`` (Olmo 3's ratio of window
to stage-3 sequence is 4096 / 65536 = 1/16). One untimed step first, then ``--steps`` timed; rank
0's last step runs under torch.profiler, its self CPU time grouped into attention kernels,
matmuls, the context-parallel exchanges (K/V all-gather and halo all-to-all, forward and
backward), FSDP and other collectives, and the rest. Prints a markdown table.

    uv run --frozen python packages/olmo-train-torch/bench/bench_context_parallel.py --memory

(one process, no torchrun) instead prints rank 0's per-device memory from the torch dry run
(``dry_run.dry_run``: FSDPMemTracker under FakeTensorMode on a fake process group): olmo3-1b at
16,384 tokens, bf16, on 4 ranks for CP = 1, 2, 4 (one sequence per data-parallel rank), then the
olmo3-7b and olmo3-32b stage-1 recipes (8,192 tokens) beside their stage-3 ones (65,536 tokens)
at CP = 8, on h100:512.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

from olmo_model import get_preset
from olmo_run.recipe import Recipe, batch_layout
from olmo_train_torch.parallelize import Distributed, build_mesh
from olmo_train_torch.step import make_optimizer, start_model, train_step

ROWS = 4

CONTEXT = "context exchange"
CATEGORIES = (
    ("attention kernels", ("scaled_dot_product", "flash_attention")),
    ("collectives (FSDP, loss)", ("gloo", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "c10d", "nccl")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
)


def _in_context_exchange(event) -> bool:
    """Whether the event is, or runs inside, one of context_parallel's collectives (they are
    labelled ``context_parallel.*`` with record_function)."""
    while event is not None:
        if event.name.startswith("context_parallel."):
            return True
        event = event.cpu_parent
    return False


def categorize(prof) -> dict[str, float]:
    """Self CPU seconds per category: the context-parallel exchanges (forward all-gather / halo
    all-to-all and their backward, waits included: gloo blocks), then the first category whose
    names an op matches, else other."""
    out = {CONTEXT: 0.0} | {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    for e in prof.events():
        seconds = e.self_cpu_time_total / 1e6
        if _in_context_exchange(e):
            out[CONTEXT] += seconds
            continue
        for name, keys in CATEGORIES:
            if any(k in e.name for k in keys):
                out[name] += seconds
                break
        else:
            out["other"] += seconds
    return out


def memory() -> None:
    from pathlib import Path

    from olmo_run.recipe import load_recipe
    from olmo_train_torch.dry_run import dry_run

    gib = 2**30
    print("| run | CP | per-device batch | peak GiB | activations GiB | other parts at the peak (GiB) | wall s |")
    print("|---|---|---|---|---|---|---|")

    def show(label: str, recipe: Recipe, count: int) -> None:
        t0 = time.perf_counter()
        r = dry_run(recipe, "h100", count)
        parts = ", ".join(
            f"{k} {v / gib:.2f}" for k, v in r.memory_bytes.items() if k != "activations" and v >= gib / 100
        )
        print(
            f"| {label} | {recipe.torch.context_parallel} | {r.per_device_batch} | {r.peak_bytes_per_device / gib:.2f} | "
            f"{r.memory_bytes.get('activations', 0) / gib:.2f} | {parts} | {time.perf_counter() - t0:.0f} |",
            flush=True,
        )

    seq = 16384
    for cp in (1, 2, 4):
        recipe = Recipe(
            model="olmo3-1b",
            train={"steps": 1, "sequence_length": seq, "global_batch_tokens": seq * 4 // cp, "precision": "bf16"},
            torch={"context_parallel": cp},
        )
        show(f"olmo3-1b, {seq} tokens, h100:4", recipe, 4)
    recipes = Path(__file__).resolve().parents[3] / "recipes"
    for model in ("olmo3-7b", "olmo3-32b"):
        show(f"{model} stage 1 (8,192), h100:512", load_recipe(recipes / model / "stage1.yaml"), 512)
        stage3 = load_recipe(recipes / model / "stage3.yaml", ["--torch.context_parallel=8"])
        show(f"{model} stage 3 (65,536), h100:512", stage3, 512)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="dry-run memory figures instead (one process)")
    args = ap.parse_args()
    if args.memory:
        memory()
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = get_preset("small").replace(sliding_window=args.window, max_position_embeddings=args.seq)
    d = Distributed(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), initialized=True)
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, size=(ROWS, args.seq)) + 1, spec.vocab_size - 1)
    batch_all = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1), "doc_ids": np.zeros_like(ids)}
    rows = []
    for cp in (1, 4):
        recipe = Recipe(
            model=spec.model_dump(mode="json"),
            train={"steps": 10, "precision": "fp32", "global_batch_tokens": ROWS * args.seq},
            torch={"parallel": "fsdp", "context_parallel": cp},
        )
        model = start_model(recipe, spec, d, build_mesh(d, recipe.torch), None)
        optimizer = make_optimizer(model, recipe, d.device)
        layout = batch_layout(ROWS, world // cp)
        per, dp_rank = ROWS // layout.dp_size, rank // cp
        batch = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in batch_all.items()}

        def step(i: int) -> float:
            return train_step(
                model, optimizer, batch, layout=layout, d=d, spec=spec, recipe=recipe, lr=1e-4, step=i
            ).read()["loss"]

        step(1)
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(args.steps - 1):
            step(2 + i)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t_last = time.perf_counter()
            loss = step(1 + args.steps)
            t_last = time.perf_counter() - t_last
        dist.barrier()
        seconds = (time.perf_counter() - t0) / args.steps
        parts = categorize(prof)
        scale = t_last / max(sum(parts.values()), 1e-9)  # the profiler's own overhead taken out
        rows.append((cp, seconds, ROWS * args.seq / seconds, loss, {k: v * scale for k, v in parts.items()}))
    if rank == 0:
        print(
            f"\nsmall (d_model 128, 4 layers, window {args.window}), seq {args.seq}, {ROWS} sequences per step, "
            f"fp32, FSDP2 over {world} gloo processes, 1 thread each\n"
        )
        names = [CONTEXT] + [name for name, _ in CATEGORIES] + ["other"]
        print("| CP | step s | tokens/s | vs CP=1 | loss | " + " | ".join(f"{n} s" for n in names) + " |")
        print("|---" * (5 + len(names)) + "|")
        base = rows[0][2]
        for cp, seconds, tps, loss, parts in rows:
            print(
                f"| {cp} | {seconds:.2f} | {tps:,.0f} | {tps / base:.2f}x | {loss:.4f} | "
                + " | ".join(f"{parts[n]:.2f}" for n in names)
                + " |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

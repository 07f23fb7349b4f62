"""MoE block throughput on this machine (CPU, float32): a benchmark script, not a test.

    uv run --frozen python packages/olmo-train-torch/bench/bench_moe.py [--tokens 2048] [--repeats 10]

Part 1, one process: forward+backward tokens/s of one MoE block (d_model 128, top-4,
expert_hidden 64, one shared expert of 64) as the pool grows 8 -> 16 -> 32 -> 64 -> 128 experts;
active parameters per token stay constant (4 routed + 1 shared SwiGLU of width 64), so an
ideal implementation keeps tokens/s flat. Both grouped-GEMM backends (``torch._grouped_mm``
and the per-expert loop) side by side.

Part 2, 4 gloo processes (one CPU thread each): the same block with its experts split over
the 4 ranks, two ways, side by side in one run:

- ``ep``: expert parallel, tokens travel (``expert_parallel``: all-to-all dispatch and
  combine, forward and backward);
- ``allgather``: FSDP-style, weights travel: every rank all-gathers the full expert
  weights each step and computes its own tokens locally; the backward sums the expert
  gradients over ranks (an all-reduce, as gloo has no reduce-scatter) and keeps its slice.

Reports the best step time of ``--repeats`` (configurations interleaved; see
``best_times``), tokens/s per rank, the bytes each rank sends per step, and the ratios
all-gather / EP of both (one row per expert count, the two ways side by side).
Routing is "uniform" in part 2 so that both ways see identical, balanced work.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from olmo_model import MoESpec
from olmo_train_torch.expert_parallel import apply_expert_parallel, reduce_gradients, sum_gradients
from olmo_train_torch.grouped_gemm import grouped_matmul
from olmo_train_torch.moe import MoE, configure_moe, routing_stats

D_MODEL, HIDDEN, TOP_K = 128, 64, 4
EP = 4


def make_block(n_experts: int, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    block = MoE(MoESpec(n_experts=n_experts, top_k=TOP_K, expert_hidden=HIDDEN, n_shared_experts=1), D_MODEL, 0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def step(block: MoE, x: torch.Tensor, group=None) -> None:
    out, stats = block(x)
    aux = routing_stats([stats], group=group)
    (out.square().mean() + 0.01 * aux.load_balancing).backward()


def best_times(fns: dict, repeats: int) -> dict:
    """Fastest of ``repeats`` timed calls of each function, the functions interleaved
    round-robin: on a machine shared with other jobs, contention only ever adds time, and
    interleaving spreads its bursts over all configurations alike."""
    for fn in fns.values():
        fn()  # warm-up
    best = {key: float("inf") for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


# ---- part 1 ------------------------------------------------------------------------------------


def scaling(tokens: int, repeats: int) -> list[dict]:
    x = torch.randn(tokens, D_MODEL)
    blocks = {}
    for n_experts in (8, 16, 32, 64, 128):  # 128: the anchor's pool (8 -> 128 on 8 B300)
        for gemm in ("grouped_mm", "loop"):
            blocks[n_experts, gemm] = make_block(n_experts)
            blocks[n_experts, gemm].experts.gemm = gemm
    best = best_times({key: (lambda b=b: step(b, x)) for key, b in blocks.items()}, repeats)
    return [{"experts": e, "gemm": g, "seconds": t, "tokens_per_s": tokens / t} for (e, g), t in best.items()]


# ---- part 2 ------------------------------------------------------------------------------------


class _GatherWeights(torch.autograd.Function):
    """Forward: all-gather the expert shards into full weights; backward: sum the full
    gradients over ranks and keep this rank's shard."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * n : (rank + 1) * n], None


class AllGatherExperts(torch.nn.Module):
    """The routed experts of an MoE block kept as shards, gathered in full every forward."""

    def __init__(self, experts, group):
        super().__init__()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        n = experts.n_experts // world
        self.group = group
        self.gemm = experts.gemm
        self.shards = torch.nn.ParameterDict(
            {
                name: torch.nn.Parameter(getattr(experts, name).detach()[rank * n : (rank + 1) * n].clone())
                for name in ("gate_proj", "up_proj", "down_proj")
            }
        )

    def forward(self, xs: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        full = {name: _GatherWeights.apply(p, self.group) for name, p in self.shards.items()}
        g = grouped_matmul(xs, full["gate_proj"].transpose(1, 2), sizes, self.gemm)
        u = grouped_matmul(xs, full["up_proj"].transpose(1, 2), sizes, self.gemm)
        return grouped_matmul(torch.nn.functional.silu(g) * u, full["down_proj"].transpose(1, 2), sizes, self.gemm)


def _worker(rank: int, port: int, tokens: int, repeats: int, blocks: dict, out_queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=EP)
    group = dist.group.WORLD
    torch.manual_seed(100 + rank)
    x = torch.randn(tokens, D_MODEL)
    results = []
    for n_experts, block in blocks.items():
        ep_block = copy.deepcopy(block)
        # Uniform routing numbers the tokens of the global micro-batch (all 4 ranks).
        configure_moe(ep_block, routing="uniform", dp_rank=rank, dp_size=EP)
        apply_expert_parallel(ep_block, group)

        def ep_step() -> None:
            step(ep_block, x, group)
            reduce_gradients(ep_block, group)
            ep_block.zero_grad(set_to_none=True)

        ag_block = copy.deepcopy(block)
        configure_moe(ag_block, routing="uniform", dp_rank=rank, dp_size=EP)
        ag_block.experts = AllGatherExperts(ag_block.experts, group)

        def ag_step() -> None:
            step(ag_block, x, group)
            params = [p for n, p in ag_block.named_parameters() if not n.startswith("experts.")]
            sum_gradients(params, group)
            ag_block.zero_grad(set_to_none=True)

        expert_bytes = 3 * n_experts * HIDDEN * D_MODEL * 4
        dense_bytes = sum(p.numel() for n, p in block.named_parameters() if not n.startswith("experts.")) * 4
        moved = tokens * TOP_K * D_MODEL * 4 * (EP - 1) / EP  # rows leaving this rank, one all-to-all
        sent = {
            # dispatch + combine, forward and backward, plus the dense gradient all-reduce.
            "ep": 4 * moved + dense_bytes,
            # all-gather forward, gradient all-reduce backward (each ~ (EP-1)/EP of the full weights).
            "allgather": expert_bytes * (EP - 1) / EP + 2 * expert_bytes * (EP - 1) / EP + dense_bytes,
        }
        dist.barrier()
        best = best_times({"ep": ep_step, "allgather": ag_step}, repeats)
        for mode, seconds in best.items():
            slowest = torch.tensor([seconds])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            results.append({"mode": mode, "experts": n_experts, "seconds": float(slowest), "bytes": sent[mode]})
    if rank == 0:
        out_queue.put(results)
    dist.destroy_process_group()


def dispatch_vs_allgather(tokens: int, repeats: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    blocks = {n: make_block(n) for n in (8, 64)}
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    mp.start_processes(
        _worker, args=(port, tokens, repeats, blocks, queue), nprocs=EP, join=False, start_method="fork"
    ).join()
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per configuration (best of)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console(width=200)  # full tables also when the output is not a terminal
    console.print(f"load average before the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    rows = scaling(args.tokens, args.repeats)
    table = Table(
        title=f"MoE block fwd+bwd, 1 process, 1 thread, fp32, {args.tokens} tokens, d {D_MODEL}, top-{TOP_K}, hidden {HIDDEN}"
    )
    for col in ("experts", "gemm", "ms/step", "tokens/s", "vs 8 experts"):
        table.add_column(col, justify="right")
    base = {r["gemm"]: r["tokens_per_s"] for r in rows if r["experts"] == 8}
    for r in rows:
        table.add_row(
            str(r["experts"]),
            r["gemm"],
            f"{r['seconds'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base[r['gemm']]:.2f}",
        )
    console.print(table)

    rows = dispatch_vs_allgather(args.tokens, args.repeats)
    table = Table(
        title=f"{EP} gloo ranks (1 thread each), {args.tokens} tokens/rank, uniform routing, fp32; "
        "ms/step of the slowest rank"
    )
    for col in (
        "experts",
        "ep ms/step",
        "ep tokens/s/rank",
        "ep MB sent/rank/step",
        "allgather ms/step",
        "allgather tokens/s/rank",
        "allgather MB sent/rank/step",
        "time allgather/ep",
        "bytes allgather/ep",
    ):
        table.add_column(col, justify="right")
    by = {(r["experts"], r["mode"]): r for r in rows}
    for n_experts in sorted({r["experts"] for r in rows}):
        ep, ag = by[n_experts, "ep"], by[n_experts, "allgather"]
        table.add_row(
            str(n_experts),
            f"{ep['seconds'] * 1e3:.1f}",
            f"{args.tokens / ep['seconds']:,.0f}",
            f"{ep['bytes'] / 1e6:.2f}",
            f"{ag['seconds'] * 1e3:.1f}",
            f"{args.tokens / ag['seconds']:,.0f}",
            f"{ag['bytes'] / 1e6:.2f}",
            f"{ag['seconds'] / ep['seconds']:.2f}",
            f"{ag['bytes'] / ep['bytes']:.2f}",
        )
    console.print(table)
    console.print(f"load average after the run: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""Both trainers' train steps on one GPU, side by side with OLMo-core, and MoE block scaling.

    python tools/bench/gpu/bench_gpu.py all --out DIR [--deadline-s 450]   # everything, one table
    python tools/bench/gpu/bench_gpu.py torch --preset olmo3-1b --seq 4096 --batch 8
    python tools/bench/gpu/bench_gpu.py jax --preset olmo3-1b --seq 4096 --batch 8 --attention auto
    python tools/bench/gpu/bench_gpu.py moe-torch|moe-jax --experts 8 32 64 128
    python tools/bench/gpu/bench_gpu.py moe-model-torch|moe-model-jax --experts 8 128 [--layers N]
    python tools/bench/gpu/bench_gpu.py env

tools/bench/gpu/run_h200.sh is the one command the device machine runs (packages on PYTHONPATH,
carried wheels installed). Every contender runs in its own process (JAX and torch never share
the card), prints one JSON line, and ``all`` gathers them into DIR/results.jsonl and a table.

Train step (``torch``, ``jax``, OLMo-core): the olmo3-1b shape (docs/design.md), sequence 4096, batch 8
sequences (32,768 tokens per step), bf16 compute with fp32 master weights and fp32 AdamW state,
the same random token batches for every contender, one optimizer step = forward, loss (CE + z-loss),
backward, global-norm clip 1.0, AdamW. Each is run the way its trainer runs a single GPU:

- olmo-train-torch: ``step.train_step`` on a 1-rank NCCL group (as ``torchrun --nproc_per_node 1``
  launches it), so ``torch.parallel=fsdp`` wraps each block with FSDP2 and
  MixedPrecisionPolicy(bf16 params, fp32 reduce); ``--compile`` compiles each block
  (``torch.compile: true``); fused AdamW; SDPA attention (causal at this length: window 4096).
- olmo-train-jax: ``train.step_functions`` (one jitted step, donated params and state) on a
  one-device mesh; attention per ``jax.attention`` (auto = cuDNN's fused flash attention).
- OLMo-core: tools/bench/olmo_core/train_peer.py ``--device cuda --precision bf16`` (its own
  ``TransformerConfig.olmo3_1B``, FSDP bf16, ``apply_compile``, SkipStepAdamW), when its wheel
  is carried.

Timing: ``--warmup`` untimed steps (compilation), then ``--steps`` timed steps, each ended by a
device synchronisation (the loss is read back); the table gives the median step. Model FLOPs per
token are olmo_model.flops_per_token (6 x matmul parameters + causal attention, the trainers' own
MFU numerator); MFU is given against the datasheet bf16 dense peak (989 TFLOP/s for H100/H200, the
trainers' metric) and against the bf16 8192^3 matmul measured by ``env`` on the same card.

MoE (``moe-torch``, ``moe-jax``): forward + backward of one MoE block (d_model 2048, top-4 of E
routed SwiGLU experts of width 1024 and one shared expert of width 1024, bf16, 16,384 tokens) as
E grows 8 -> 128: active parameters per token stay constant, so a perfect implementation keeps
tokens/s flat (the report-2 anchor: < 5% loss from 8 to 128 experts, measured on 8 B300 across a
whole model; this is one block on one H200).

Whole-model MoE (``moe-model-torch``, ``moe-model-jax``): the trainers' own steps as above
(olmo-train-torch ``train_step``, FSDP2, compiled blocks; olmo-train-jax ``placed_step``, remat
save_dots, cuDNN attention) on the olmo3-1b shape with every MLP an MoE block of top-4 of E routed
experts + 1 shared expert, all 256 wide (``moe_model_spec``: why 256, and the memory arithmetic),
E = 8 -> 128, learned and random routing, 16,384 tokens per step (4 x 4096). Each row: step time,
tokens/s, model TFLOP/s (olmo_model.flops_per_token, which counts the active experts and the
router), the MoE blocks' share of those FLOPs, the per-expert assignments of the last step
(summed over layers) with max/mean, peak memory, the parameter count (computed and built) and
tokens/s over the E = 8 row of the same routing. One process per E (``cmd_moe_model``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
PEER = ROOT / "tools" / "bench" / "olmo_core" / "train_peer.py"
DATASHEET_BF16 = 989e12  # H100/H200 SXM dense bf16 (olmo_model.maths peak table)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def token_batches(vocab: int, n: int, batch: int, seq: int) -> np.ndarray:
    """[n, batch, seq + 1] int32, the same for every contender."""
    return np.random.default_rng(0).integers(2, vocab, size=(n, batch, seq + 1), dtype=np.int32)


def summarize(times: list[float], first: list[float], tokens: int, fpt: float, losses: list[float]) -> dict:
    step = statistics.median(times)
    tps = tokens / step
    return {
        "step_s": step,
        "step_min_s": min(times),
        "step_max_s": max(times),
        "warmup_s": first,
        "tokens_per_s_per_device": tps,
        "model_tflops": fpt * tps / 1e12,
        "mfu_datasheet": fpt * tps / DATASHEET_BF16,
        "losses": losses,
    }


# ---- env -------------------------------------------------------------------------------------


def cmd_env(args) -> None:
    import torch

    out = {
        "name": "env",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    try:
        import jax

        out["jax"] = jax.__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["jax"] = f"import failed: {e}"
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    out["matmul_bf16_tflops"] = 2 * n**3 / statistics.median(times) / 1e12
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    torch.cuda.synchronize()
    out["copy_tb_per_s"] = 5 * 2 * x.numel() / (time.perf_counter() - t0) / 1e12
    emit(out)


# ---- olmo-train-torch ------------------------------------------------------------------------


def cmd_torch(args) -> None:
    # A 1-rank process group, as `torchrun --nproc_per_node 1` gives: the trainer's GPU path (FSDP2).
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import torch

    from olmo_model import flops_per_token, get_preset
    from olmo_run.recipe import batch_layout, load_recipe
    from olmo_train_torch import initial_model
    from olmo_train_torch.parallelize import build_mesh, init_distributed
    from olmo_train_torch.step import make_optimizer, prepare_model, train_step

    spec = get_preset(args.preset)
    recipe = load_recipe(
        None,
        [
            f"--model={args.preset}",
            "--train.precision=bf16",
            "--optim.lr=1e-4",
            f"--torch.parallel={args.parallel}",
            f"--torch.compile={str(args.compile).lower()}",
            f"--torch.activation_checkpointing={str(args.ac).lower()}",
        ],
    )
    d = init_distributed("auto")
    mesh = build_mesh(d, recipe.torch)
    torch.manual_seed(0)
    model = prepare_model(initial_model(spec, seed=0, device=d.device), recipe, d, mesh, None)
    optimizer = make_optimizer(model, recipe, d.device)
    layout = batch_layout(args.batch, 1)
    data = token_batches(spec.vocab_size, args.warmup + args.steps, args.batch, args.seq)

    def step(tokens: np.ndarray) -> float:
        b = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "doc_ids": np.zeros_like(tokens[:, 1:])}
        stats = train_step(model, optimizer, b, layout=layout, d=d, spec=spec, recipe=recipe, lr=1e-4)
        _sync()
        return float(stats.loss)

    first, times, losses = _run_steps(step, data, args.warmup, args.max_seconds)
    res = summarize(times, first, args.batch * args.seq, flops_per_token(spec, args.seq), losses)
    res.update(
        name=f"olmo-train-torch {args.parallel}{' compile' if args.compile else ' eager'}{' ac' if args.ac else ''}",
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if _cuda() else None,
        torch=torch.__version__,
    )
    emit(res)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_steps(step, data: np.ndarray, warmup: int, max_seconds: float | None):
    first, times, losses = [], [], []
    for i, tokens in enumerate(data):
        t0 = time.perf_counter()
        loss = step(tokens)
        dt = time.perf_counter() - t0
        losses.append(round(loss, 5))
        (first if i < warmup else times).append(dt)
        print(f"step {i + 1}: {dt:.3f} s loss {loss:.4f}", file=sys.stderr, flush=True)
        if max_seconds and i >= warmup and sum(first) + sum(times) > max_seconds:
            break
    return first, times, losses


# ---- olmo-train-jax --------------------------------------------------------------------------


def cmd_jax(args) -> None:
    import jax
    import jax.numpy as jnp

    from olmo_model import flops_per_token, get_preset
    from olmo_run.recipe import load_recipe
    from olmo_train_jax.model import build_model
    from olmo_train_jax.step import placed_step

    spec = get_preset(args.preset)
    recipe = load_recipe(
        None, [f"--train.precision={args.precision}", f"--jax.remat={args.remat}", f"--jax.attention={args.attention}"]
    )
    dtype = jnp.bfloat16 if args.precision == "bf16" else jnp.float32
    fns, carry = placed_step(
        build_model(spec, seed=0, dtype=dtype, remat=args.remat, attention=args.attention), spec, recipe
    )
    data = token_batches(spec.vocab_size, args.warmup + args.steps, args.batch, args.seq)
    lr = np.float32(1e-4)

    def step(tokens: np.ndarray) -> float:
        b = {
            "input_ids": tokens[None, :, :-1],
            "labels": tokens[None, :, 1:],
            "doc_ids": np.zeros_like(tokens[None, :, 1:]),
        }
        b = {k: jnp.asarray(v) for k, v in b.items()}
        carry[0], carry[1], stats = fns.fused(carry[0], carry[1], b, lr, np.int32(1))
        return float(stats["loss"])

    first, times, losses = _run_steps(step, data, args.warmup, args.max_seconds)
    res = summarize(times, first, args.batch * args.seq, flops_per_token(spec, args.seq), losses)
    mem = jax.devices()[0].memory_stats() or {}
    res.update(
        name=f"olmo-train-jax attention={args.attention} remat={args.remat}"
        + ("" if args.precision == "bf16" else f" {args.precision}"),
        jax=jax.__version__,
        peak_mem_gib=mem.get("peak_bytes_in_use", 0) / 2**30,
    )
    emit(res)


# ---- OLMo-core -------------------------------------------------------------------------------


def run_olmo_core(args, tmp: Path, timeout: float) -> dict:
    from olmo_model import flops_per_token, get_preset, param_counts

    spec = get_preset(args.preset)
    spec_file, batch_file = tmp / "spec.json", tmp / "batches.npy"
    spec_file.write_text(spec.model_dump_json())
    np.save(batch_file, token_batches(spec.vocab_size, args.warmup + args.steps, args.batch, args.seq))
    cmd = [
        sys.executable,
        str(PEER),
        "--spec",
        str(spec_file),
        "--param-total",
        str(param_counts(spec).total),
        "--batches",
        str(batch_file),
        "--modes",
        "compile",
        "--device",
        "cuda" if _cuda() else "cpu",
        "--precision",
        "bf16",
        "--max-seconds",
        str(args.max_seconds),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    (tmp / "olmo_core.log").write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"name": "OLMo-core compile", "error": f"exit {proc.returncode}: {tail[:300]}"}
    peer = json.loads(lines[-1])
    r = peer["modes"]["compile"]
    warm = args.warmup - 1  # train_peer times its first step apart; the next warm-up ones are in step_times
    times = r["step_times"][warm:]
    res = summarize(
        times, [r["first_step_s"], *r["step_times"][:warm]], args.batch * args.seq, flops_per_token(spec, args.seq), []
    )
    res.update(
        name="OLMo-core compile",
        olmo_core=peer["olmo_core"],
        torch=peer["torch"],
        config=r["config"],
        peak_mem_gib=r.get("peak_memory_gib"),
        stopped_early=r.get("stopped_early"),
    )
    return res


# ---- the trainers' CLIs end to end ---------------------------------------------------------


def run_cli(framework: str, args, logs: Path, timeout: float) -> dict:
    """One trainer's CLI on the embedded sample mixture (loader, held-out eval, checkpoint,
    metrics JSONL) for ``--cli-steps`` steps of ``--cli-preset``: the whole job, not only its
    step. Reads the run's metrics.jsonl back."""
    import tempfile

    run_dir = Path(tempfile.mkdtemp(prefix=f"cli_{framework}_"))
    common = [
        f"--model={args.cli_preset}",
        f"--train.steps={args.cli_steps}",
        "--checkpoint.every=1000",
        "--eval.every=1000",
        "--log.progress=false",
        f"--run_dir={run_dir}",
    ]
    if framework == "torch":
        # torchrun with one process: the trainer's GPU path (NCCL group, FSDP2, bf16 params).
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "-m",
            "olmo_train_torch",
            *common,
            "--torch.compile=true",
        ]
    else:
        cmd = [sys.executable, "-m", "olmo_train_jax", *common, "--jax.remat=save_dots"]
    with open(logs / f"cli-{framework}.log", "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=ROOT)
    name = f"olmo-train-{framework} CLI {args.cli_preset}"
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode or not metrics.exists():
        tail = [ln for ln in (logs / f"cli-{framework}.log").read_text().splitlines() if ln.strip()][-3:]
        return {"name": name, "error": f"exit {proc.returncode}: " + " | ".join(tail)[-600:]}
    from olmo_run.metrics import read_metrics

    lines = read_metrics(run_dir)
    train = [ln for ln in lines if ln["kind"] == "train"]
    evals = [ln for ln in lines if ln["kind"] == "eval"]
    steady = train[3:] or train
    return {
        "name": name,
        "cli": True,
        "steps": len(train),
        "first_loss": train[0]["loss"],
        "last_loss": train[-1]["loss"],
        "tokens_per_s_per_device": statistics.median(ln["tokens_per_second_per_device"] for ln in steady),
        "mfu": statistics.median(ln["mfu"] for ln in steady),
        "mfu_peak": train[-1].get("mfu_peak"),
        "eval": evals[-1]["eval"] if evals else None,
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        if (run_dir / "checkpoints").exists()
        else [],
    }


# ---- MoE block scaling -----------------------------------------------------------------------


def moe_flops_per_token(d: int, hidden: int, top_k: int, shared_hidden: int, n_experts: int) -> float:
    """fwd + bwd matmul FLOPs of one MoE block per token: 3 SwiGLU matmuls for each of the top-k
    routed experts and the shared expert, and the router."""
    return 6 * (3 * d * hidden * top_k + 3 * d * shared_hidden + d * n_experts)


def cmd_moe_torch(args) -> None:
    import torch

    from olmo_model import MoESpec
    from olmo_train_torch.moe import MoE, routing_stats

    device = "cuda" if _cuda() else "cpu"
    x = torch.randn(args.tokens, args.d_model, device=device, dtype=torch.bfloat16)
    rows = []
    for routing in args.routing:
        for e in args.experts:
            torch.manual_seed(0)
            block = MoE(
                MoESpec(n_experts=e, top_k=4, expert_hidden=args.hidden, n_shared_experts=1), args.d_model, 0
            ).to(device)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0, 0.02)
            block = block.to(torch.bfloat16)
            block.routing = routing

            def step(block=block):
                out, stats = block(x)
                aux = routing_stats([stats])
                (out.float().square().mean() + 0.01 * aux.load_balancing).backward()

            rows.append(_time_moe(step, _sync, args, e, routing))
    emit({"name": "moe olmo-train-torch", "torch": torch.__version__, "rows": rows})


def cmd_moe_jax(args) -> None:
    import functools

    import jax
    import jax.numpy as jnp

    from olmo_model import MoESpec
    from olmo_train_jax.grouped_gemm import ExpertWeights, gemm_backend
    from olmo_train_jax.moe import local_experts, moe_block

    d, h = args.d_model, args.hidden
    x = jax.random.normal(jax.random.key(1), (args.tokens, d), jnp.bfloat16)
    rows = []
    for gemm in args.gemm:
        name = gemm_backend(jnp.bfloat16, d, h) if gemm == "auto" else gemm
        for routing in args.routing:
            for e in args.experts:
                moe = MoESpec(n_experts=e, top_k=4, expert_hidden=h, n_shared_experts=1)
                keys = jax.random.split(jax.random.key(0), 7)

                def w(i, *shape, keys=keys):
                    return (0.02 * jax.random.normal(keys[i], shape, jnp.float32)).astype(jnp.bfloat16)

                params = {
                    "router": w(0, d, e),
                    "routed": ExpertWeights(w(1, e, d, h), w(2, e, d, h), w(3, e, h, d)),
                    "shared": ExpertWeights(w(4, d, h), w(5, d, h), w(6, h, d)),
                }
                experts_fn = functools.partial(local_experts, gemm=gemm)

                def loss(params, x, moe=moe, routing=routing, experts_fn=experts_fn):
                    out, stats = moe_block(
                        x,
                        params["router"],
                        params["routed"],
                        params["shared"],
                        moe,
                        routing=routing,
                        key=jax.random.key(3),
                        experts_fn=experts_fn,
                    )
                    return jnp.mean(jnp.square(out.astype(jnp.float32))) + 0.01 * stats.load_balancing

                grad = jax.jit(jax.grad(loss))
                try:
                    row = _time_moe(
                        lambda g=grad, p=params: jax.block_until_ready(g(p, x)), lambda: None, args, e, routing, name
                    )
                except Exception as err:  # noqa: BLE001 - one backend failing must not hide the others
                    row = {"experts": e, "routing": routing, "error": f"{type(err).__name__}: {str(err)[:300]}"}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append({**row, "gemm": name})
    emit({"name": "moe olmo-train-jax", "jax": jax.__version__, "rows": rows})


def _time_moe(step, sync, args, n_experts: int, routing: str, gemm: str | None = None) -> dict:
    for _ in range(2):
        step()
    sync()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    fpt = moe_flops_per_token(args.d_model, args.hidden, 4, args.hidden, n_experts)
    row = {
        "experts": n_experts,
        "routing": routing,
        "step_s": t,
        "tokens_per_s": args.tokens / t,
        "tflops": fpt * args.tokens / t / 1e12,
        **({"gemm": gemm} if gemm else {}),
    }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


# ---- whole-model MoE -------------------------------------------------------------------------

MOE_MODEL_TOP_K = 4  # routed experts per token
MOE_MODEL_SHARED = 1  # shared experts, every token goes through them
MOE_MODEL_HIDDEN = 256  # routed and shared expert width: moe_model_spec says why


def moe_model_spec(preset: str, n_experts: int, expert_hidden: int = MOE_MODEL_HIDDEN, layers: int | None = None):
    """``preset``'s shape (d_model, heads, vocab, window; ``layers`` overrides its depth) with
    every MLP an MoE block: top-4 of ``n_experts`` routed SwiGLU experts and one shared expert,
    all ``expert_hidden`` wide.

    The width is the same at every E, so the parameters a token multiplies through stay
    constant (up to the router's d x E) while the stored ones grow with E. The default, 256 at
    the olmo3-1b shape (d 2048, 16 layers, 16 heads, vocab 100,352 padded), is the widest
    multiple of 128 (the widths the Hopper grouped-GEMM kernels of olmo_train_jax.moe take)
    whose E = 128 model fits one H200 (141 GB) with margin, by ``moe_model_memory`` at 16,384
    tokens per step (parameter counts from olmo_model.param_counts):

    - width 256: 3.93 B parameters at E = 128 (0.81 B active): 62.9 GB of fp32 weights,
      gradients and AdamW moments (16 B each) + 7.9 GB bf16 weight copy + 27.0 GB activations
      = 97.7 GB, 31% of the card free (E = 8: 0.91 B parameters, 43.0 GB).
    - width 384: 5.55 B: 88.9 + 11.1 + 28.0 = 127.9 GB, 9% free: too close to risk a device
      run on (XLA's temporaries are not in the estimate; the dense olmo3-1b step without remat
      had one of 104 GiB).
    - width 512: 7.18 B: 114.8 GB of optimizer state alone.

    At width 256 the MoE blocks are 18% of the step's FLOPs (attention, its projections and the
    100k-vocabulary head are the rest; ``moe_flop_share`` in every row), so a 5% whole-model
    loss at E = 128 allows about a 28% loss in the MoE blocks themselves. ``--layers 8
    --expert-hidden 768`` (Qwen3-30B-A3B's expert width at d 2048) fits too (5.42 B parameters
    at E = 128, 113.0 GB estimated, 20% free) with the MoE share at 32%."""
    from olmo_model import spec_from_dict
    from olmo_model.presets import preset_dict

    base = preset_dict(preset)
    data = {
        **base,
        "name": f"{preset}-moe{n_experts}x{expert_hidden}" + (f"-{layers}l" if layers else ""),
        "moe": dict(
            n_experts=n_experts, top_k=MOE_MODEL_TOP_K, expert_hidden=expert_hidden, n_shared_experts=MOE_MODEL_SHARED
        ),
    }
    if layers is not None:
        data["n_layers"] = layers
    return spec_from_dict(data, source=f"moe-model spec (--preset {preset} --experts {n_experts})")


def moe_model_memory(spec, tokens: int) -> dict:
    """Bytes one device needs for a train step of ``spec`` at ``tokens`` tokens, estimated:
    16 per parameter (fp32 weights, fp32 gradients, two fp32 AdamW moments); 2 per parameter
    for a bf16 copy of every weight (JAX casts them all at once; torch's FSDP2 gathers one block
    at a time, so for torch this is the upper side); and per token and layer what the backward
    keeps when nothing is recomputed: bf16 block input, q, k, v, attention output and o-proj
    input (9 d x 2 B), two float32 RMSNorm rows (2 d x 4 B), the MoE block's bf16 input and
    router input (2 d x 2 B), the top-k gathered rows and per-slot outputs (2 k d x 2 B), the
    SwiGLU gate, up and product of the k routed and the shared experts (3 (k h + s h_s) x 2 B),
    float32 router logits and probabilities (2 E x 4 B). The head's logits are computed in
    chunks (head_loss) and left out, as are the compilers' temporaries."""
    from olmo_model import param_counts

    moe = spec.moe
    d, k, e = spec.d_model, moe.top_k, moe.n_experts
    swiglu = 3 * (k * moe.expert_hidden + moe.n_shared_experts * moe.shared_hidden)
    per_token_layer = 2 * 9 * d + 4 * 2 * d + 2 * (2 * d + 2 * k * d + swiglu) + 4 * 2 * e
    p = param_counts(spec).total
    out = {
        "params": p,
        "state_bytes": 16 * p,
        "bf16_copy_bytes": 2 * p,
        "activation_bytes": per_token_layer * spec.n_layers * tokens,
    }
    out["total_bytes"] = out["state_bytes"] + out["bf16_copy_bytes"] + out["activation_bytes"]
    return out


def moe_flop_share(spec, seq: int) -> float:
    """The MoE blocks' part of the step's FLOPs (router, top-k routed and shared experts)."""
    from olmo_model import flops_per_token

    moe = spec.moe
    d = spec.d_model
    per_layer = d * moe.n_experts + 3 * d * (moe.top_k * moe.expert_hidden + moe.n_shared_experts * moe.shared_hidden)
    return 6 * per_layer * spec.n_layers / flops_per_token(spec, seq)


def _moe_model_plan(args, n_experts: int) -> dict:
    spec = moe_model_spec(args.preset, n_experts, args.expert_hidden, args.layers)
    from olmo_model import param_counts

    mem = moe_model_memory(spec, args.batch * args.seq)
    counts = param_counts(spec)
    return {
        "experts": n_experts,
        "layers": spec.n_layers,
        "d_model": spec.d_model,
        "expert_hidden": args.expert_hidden,
        "params_total": counts.total,
        "params_active": counts.active,
        "memory_estimate_gb": round(mem["total_bytes"] / 1e9, 2),
        "state_gb": round(mem["state_bytes"] / 1e9, 2),
        "bf16_copy_gb": round(mem["bf16_copy_bytes"] / 1e9, 2),
        "activation_gb": round(mem["activation_bytes"] / 1e9, 2),
        "moe_flop_share": round(moe_flop_share(spec, args.seq), 4),
    }


def cmd_moe_model(args) -> None:
    """``moe-model-torch`` / ``moe-model-jax``: each E in its own process (``--one-experts``),
    both routings (and, for JAX, every ``--gemm``) one after the other inside it. A process per
    E frees the card between sizes (torch's caching allocator and XLA's pool keep their blocks
    otherwise, and the E = 128 model is the largest), and a failure at one size (out of memory)
    loses only that size; the routings of one E share a process because their models have the
    same sizes, which saves a start-up (imports, process group) per row. Rows stream to stdout
    as each finishes."""
    trainer = args.cmd.removeprefix("moe-model-")
    if args.one_experts is not None:
        spec = moe_model_spec(args.preset, args.one_experts, args.expert_hidden, args.layers)
        (_moe_model_torch_rows if trainer == "torch" else _moe_model_jax_rows)(args, spec)
        return
    for e in args.experts:
        print("moe-model plan: " + json.dumps(_moe_model_plan(args, e)), flush=True)
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    gemms = args.gemm if trainer == "jax" else [None]
    rows: list[dict] = []
    for e in args.experts:
        wanted = [(g, r) for g in gemms for r in args.routing]
        got: list[dict]
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < 20:
            got, why = [], f"skipped: {max(left, 0):.0f} s left of --budget-s"
        else:
            got, why = _stream_child([sys.executable, __file__, *sys.argv[1:], "--one-experts", str(e)], left)
        rows.extend(got)
        done = {(r.get("gemm_requested"), r["routing"]) for r in got}
        for g, r in wanted:
            if (g, r) not in done:
                rows.append({"trainer": trainer, "experts": e, "routing": r, "gemm_requested": g, "error": why})
    add_moe_model_ratios(rows)
    emit({"name": f"moe-model olmo-train-{trainer}", "rows": rows})


def _stream_child(cmd: list[str], timeout: float | None) -> tuple[list[dict], str]:
    """Run one size's process: its stdout echoed line by line (so a log keeps what it printed
    even if this process is stopped), its row lines parsed; killed after ``timeout`` s."""
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        proc.kill()

    timer = threading.Timer(timeout, kill) if timeout else None
    if timer:
        timer.start()
    rows = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith("{"):
            row = json.loads(line)
            if "experts" in row:
                rows.append(row)
    rc = proc.wait()
    if timer:
        timer.cancel()
    return rows, f"timed out after {timeout:.0f} s" if fired.is_set() else f"exit {rc} before this row (log above)"


def add_moe_model_ratios(rows: list[dict]) -> None:
    """Each row's tokens/s over the E = 8 row of the same trainer, routing and GEMM backend
    (``tokens_per_s_vs_e8``; None when there is no such row)."""
    base = {
        (r["trainer"], r["routing"], r.get("gemm")): r["tokens_per_s"]
        for r in rows
        if r.get("experts") == 8 and "tokens_per_s" in r
    }
    for r in rows:
        if "tokens_per_s" in r:
            b = base.get((r["trainer"], r["routing"], r.get("gemm")))
            r["tokens_per_s_vs_e8"] = r["tokens_per_s"] / b if b else None


def _moe_fit_error(spec, tokens: int, capacity: float | None) -> str | None:
    mem = moe_model_memory(spec, tokens)
    if capacity and mem["total_bytes"] > 0.95 * capacity:
        return (
            f"estimated {mem['total_bytes'] / 1e9:.1f} GB for E={spec.moe.n_experts} exceeds 95% of the device's "
            f"{capacity / 1e9:.1f} GB; lower --expert-hidden, --layers or --batch"
        )
    return None


def _moe_model_row(args, spec, trainer: str, routing: str, run, moe_keys: dict, built: int, peak_gib) -> dict:
    from olmo_model import flops_per_token, param_counts

    first, times, losses = run
    tokens = args.batch * args.seq
    step = statistics.median(times)
    fpt = flops_per_token(spec, args.seq)
    counts = np.asarray(moe_keys["moe_tokens_per_expert"], dtype=np.int64)
    mean = counts.mean()
    pc = param_counts(spec)
    return {
        "trainer": trainer,
        "experts": spec.moe.n_experts,
        "routing": routing,
        "layers": spec.n_layers,
        "d_model": spec.d_model,
        "expert_hidden": spec.moe.expert_hidden,
        "top_k": spec.moe.top_k,
        "shared_experts": spec.moe.n_shared_experts,
        "seq": args.seq,
        "batch": args.batch,
        "tokens_per_step": tokens,
        "params_total": pc.total,
        "params_active": pc.active,
        "params_built": built,
        "memory_estimate_gb": moe_model_memory(spec, tokens)["total_bytes"] / 1e9,
        "step_s": step,
        "step_min_s": min(times),
        "step_max_s": max(times),
        "warmup_s": first,
        "tokens_per_s": tokens / step,
        "tflops": fpt * tokens / step / 1e12,
        "mfu_datasheet": fpt * tokens / step / DATASHEET_BF16,
        "moe_flop_share": moe_flop_share(spec, args.seq),
        # Assignments per expert in the last timed step, summed over the MoE layers.
        "tokens_per_expert": counts.tolist(),
        "assignments": int(counts.sum()),
        "expert_load_max_over_mean": float(counts.max() / mean),
        "expert_load_min_over_mean": float(counts.min() / mean),
        "dropped": int(moe_keys["moe_dropped_tokens"]),
        "peak_mem_gib": peak_gib,
        "losses": losses,
    }


def _print_row(row: dict) -> None:
    print(json.dumps(row), flush=True)
    print(json.dumps({k: v for k, v in row.items() if k != "tokens_per_expert"}), file=sys.stderr, flush=True)


def _moe_model_torch_rows(args, spec) -> None:
    """The rows of one E: olmo-train-torch's ``train_step`` on a 1-rank process group (FSDP2,
    bf16 params / fp32 reduce, blocks compiled unless ``--no-compile``), the model started as
    the trainer starts it (``start_model``: meta device, ``prepare_model`` with the recipe's
    ``moe.routing``, storage allocated) and filled on the device (truncated normal, std
    ``init_std`` cut at ``init_cutoff`` std, norms ones: the distribution of olmo_model.init
    without its host-side float64 draw, which would take minutes at billions of parameters)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    from olmo_run.recipe import batch_layout, load_recipe
    from olmo_train_torch.parallelize import build_mesh, init_distributed
    from olmo_train_torch.step import make_optimizer, start_model, train_step

    d = init_distributed("auto")
    capacity = torch.cuda.get_device_properties(0).total_memory if _cuda() else None
    fit = _moe_fit_error(spec, args.batch * args.seq, capacity)
    data = token_batches(spec.vocab_size, args.warmup + args.steps, args.batch, args.seq)
    for routing in args.routing:
        if fit:
            _print_row({"trainer": "torch", "experts": spec.moe.n_experts, "routing": routing, "error": fit})
            continue
        recipe = load_recipe(
            None,
            [
                "--train.precision=bf16",
                "--optim.lr=1e-4",
                "--torch.parallel=fsdp",
                f"--torch.compile={str(args.compile).lower()}",
                f"--moe.routing={routing}",
            ],
        ).model_copy(update={"model": spec.model_dump(mode="json")})
        try:
            mesh = build_mesh(d, recipe.torch)
            torch.manual_seed(0)
            model = start_model(recipe, spec, d, mesh, None, allocate_only=True)
            std, cut = spec.init_std, spec.init_cutoff * spec.init_std
            with torch.no_grad():
                for p in model.parameters():
                    local = p.to_local() if isinstance(p, DTensor) else p
                    if local.ndim >= 2:
                        torch.nn.init.trunc_normal_(local, std=std, a=-cut, b=cut)
                    else:
                        local.fill_(1.0)
            built = sum(p.numel() for p in model.parameters())
            optimizer = make_optimizer(model, recipe, d.device)
            layout = batch_layout(args.batch, 1)
            last: dict = {}

            def step(tokens: np.ndarray, model=model, optimizer=optimizer, recipe=recipe, layout=layout):
                last["n"] = last.get("n", 0) + 1
                b = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "doc_ids": np.zeros_like(tokens[:, 1:])}
                stats = train_step(
                    model,
                    optimizer,
                    b,
                    layout=layout,
                    d=d,
                    spec=spec,
                    recipe=recipe,
                    lr=1e-4,
                    step=last["n"],  # seeds random routing: a new draw every step
                )
                _sync()
                host = stats.read()
                last["moe"] = host
                return host["loss"]

            run = _run_steps(step, data, args.warmup, args.max_seconds)
            peak = torch.cuda.max_memory_allocated() / 2**30 if _cuda() else None
            row = _moe_model_row(args, spec, "torch", routing, run, last["moe"], built, peak)
            row.update(compile=args.compile, torch=torch.__version__)
        except Exception as err:  # noqa: BLE001 - one routing failing (OOM) must not hide the other
            row = {
                "trainer": "torch",
                "experts": spec.moe.n_experts,
                "routing": routing,
                "error": f"{type(err).__name__}: {str(err)[:400]}",
            }
        _print_row(row)
        model = optimizer = None
        gc.collect()
        # The next routing's model compiles afresh, not into a cache this one filled (whose
        # recompile limit would silently leave blocks eager).
        torch._dynamo.reset()
        if _cuda():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def _moe_model_jax_rows(args, spec) -> None:
    """The rows of one E: olmo-train-jax's ``placed_step`` (``step_functions``' fused step on a
    one-device mesh: jitted, parameters and AdamW state donated), ``jax.remat`` and
    ``jax.attention`` from the flags, ``moe.routing`` per row, ``--gemm`` as the recipe's
    ``jax.moe_gemm`` (auto: ``grouped_gemm.gemm_backend``'s choice)."""
    import gc

    import jax
    import jax.numpy as jnp

    from olmo_run.recipe import load_recipe
    from olmo_train_jax import grouped_gemm
    from olmo_train_jax import moe as jax_moe
    from olmo_train_jax.model import build_model
    from olmo_train_jax.step import placed_step

    dtype = jnp.bfloat16 if args.precision == "bf16" else jnp.float32
    stats0 = jax.devices()[0].memory_stats() or {}
    fit = _moe_fit_error(spec, args.batch * args.seq, stats0.get("bytes_limit"))
    data = token_batches(spec.vocab_size, args.warmup + args.steps, args.batch, args.seq)
    lr = np.float32(1e-4)
    for gemm in args.gemm:
        if gemm not in grouped_gemm.GEMM_BACKENDS:
            raise SystemExit(f"--gemm {gemm}: unknown; use one of {', '.join(grouped_gemm.GEMM_BACKENDS)}")
        name = grouped_gemm.gemm_backend(dtype, spec.d_model, spec.moe.expert_hidden) if gemm == "auto" else gemm
        for routing in args.routing:
            head = {"trainer": "jax", "experts": spec.moe.n_experts, "routing": routing}
            head.update(gemm=name, gemm_requested=gemm)
            if fit:
                _print_row({**head, "error": fit})
                continue
            recipe = load_recipe(
                None,
                [
                    f"--train.precision={args.precision}",
                    f"--jax.remat={args.remat}",
                    f"--jax.attention={args.attention}",
                    f"--moe.routing={routing}",
                    f"--jax.moe_gemm={gemm}",
                ],
            )
            try:
                model = build_model(spec, seed=0, dtype=dtype, remat=args.remat, attention=args.attention)
                fns, carry = placed_step(model, spec, recipe)
                del model
                built = sum(x.size for x in jax.tree.leaves(carry[0]))
                last: dict = {}

                def step(tokens: np.ndarray, fns=fns, carry=carry) -> float:
                    last["n"] = last.get("n", 0) + 1
                    host = {
                        "input_ids": tokens[None, :, :-1],
                        "labels": tokens[None, :, 1:],
                        "doc_ids": np.zeros_like(tokens[None, :, 1:]),
                    }
                    b = {k: jnp.asarray(v) for k, v in host.items()}
                    carry[0], carry[1], stats = fns.fused(carry[0], carry[1], b, lr, np.int32(last["n"]))
                    last["moe"] = stats["moe"]
                    return float(stats["loss"])

                run = _run_steps(step, data, args.warmup, args.max_seconds)
                moe_keys = jax_moe.moe_metrics(last["moe"], ep_size=1)
                mem = jax.devices()[0].memory_stats() or {}
                # JAX has no peak reset: a process's second row reports the larger of both.
                peak = mem.get("peak_bytes_in_use", 0) / 2**30 or None
                row = {**_moe_model_row(args, spec, "jax", routing, run, moe_keys, built, peak), **head}
                row.update(remat=args.remat, attention=args.attention, precision=args.precision, jax=jax.__version__)
            except Exception as err:  # noqa: BLE001 - one backend or routing failing must not hide the others
                row = {**head, "error": f"{type(err).__name__}: {str(err)[:400]}"}
            _print_row(row)
            fns = carry = None  # the row's arrays go before the next row builds its own
            last = {}
            gc.collect()


# ---- all -------------------------------------------------------------------------------------

# The default ``--only``: what issue 24's acceptance needs first (the whole-model MoE at 8 and
# 128 experts, both trainers), then the dense steps and the CLIs, then 32 and 64 experts.
DEFAULT_PLAN = [
    "env",
    "torch",
    "jax-save-dots",
    "olmo-core",
    "moe-model-torch",
    "moe-model-jax",
    "cli-torch",
    "cli-jax",
    # remat none with the RMSNorm / SwiGLU VJPs: 70.7 GiB by XLA:GPU's ahead-of-time compile for
    # the H200 (olmo-train-jax --dry-run --devices h200:1), so it fits again; faster than save_dots?
    "jax",
    "torch-none",
    "moe-model-torch-more",
    "moe-model-jax-more",
]


def cmd_all(args) -> None:
    out = Path(args.out)
    logs = out / "logs"  # the device tool returns at most 8 files: run_h200.sh tars this folder
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline_s

    def step_args(batch: int) -> list[str]:
        return [
            *("--preset", args.preset, "--seq", str(args.seq), "--batch", str(batch)),
            *("--steps", str(args.steps), "--warmup", str(args.warmup), "--max-seconds", str(args.max_seconds)),
        ]

    common = step_args(args.batch)
    moe = [
        "--experts",
        *map(str, args.moe_experts),
        "--tokens",
        str(args.moe_tokens),
        "--d-model",
        str(args.moe_d_model),
        "--hidden",
        str(args.moe_hidden),
    ]
    moe_model = [
        *step_args(args.moe_model_batch),
        "--expert-hidden",
        str(args.moe_model_expert_hidden),
        *(["--layers", str(args.moe_model_layers)] if args.moe_model_layers else []),
    ]
    first_e, more_e = (["--experts", *map(str, e)] for e in (args.moe_model_experts, args.moe_model_more_experts))
    jax_gemm = ["--gemm", *args.moe_model_gemm, "--precision", args.moe_model_precision]
    torch_compile = ["--compile" if args.moe_model_compile else "--no-compile"]
    plan = {
        "env": (["env"], 60),
        "moe-model-torch": (["moe-model-torch", *moe_model, *first_e, *torch_compile], 210),
        "moe-model-jax": (["moe-model-jax", *moe_model, *first_e, *jax_gemm], 180),
        "moe-model-torch-more": (["moe-model-torch", *moe_model, *more_e, *torch_compile], 210),
        "moe-model-jax-more": (["moe-model-jax", *moe_model, *more_e, *jax_gemm], 180),
        "torch": (["torch", *common, "--compile"], 200),
        "jax": (["jax", *common, "--attention", "auto"], 200),
        "olmo-core": (None, 200),
        "jax-attention-test": (None, 90),
        "moe-torch": (["moe-torch", *moe], 90),
        "moe-jax": (["moe-jax", *moe, "--gemm", *args.moe_jax_gemm], 150),
        "jax-xla-attention": (["jax", *common, "--attention", "xla"], 200),
        "torch-eager": (["torch", *common], 150),
        # No FSDP wrapper on the one GPU: bf16 autocast over fp32 weights, compiled blocks.
        "torch-none": (["torch", *common, "--compile", "--parallel", "none"], 200),
        "jax-remat-block": (["jax", *common, "--attention", "auto", "--remat", "block"], 200),
        "jax-save-dots": (["jax", *common, "--attention", "auto", "--remat", "save_dots"], 200),
        "jax-xla-save-dots": (["jax", *common, "--attention", "xla", "--remat", "save_dots"], 200),
        "grouped-gemm-test": (None, 90),
        "cli-torch": (None, 240),
        "cli-jax": (None, 240),
    }
    plan = [(key, *plan[key]) for key in args.only]
    results = []
    for key, argv, budget in plan:
        left = deadline - time.monotonic()
        if left < 30:
            print(f"== {key}: skipped, {left:.0f} s left of the deadline", flush=True)
            results.append({"name": key, "error": "skipped: out of time"})
            continue
        timeout = min(budget, left)
        if key.startswith("moe-model"):
            # The driver stops its size processes itself, before this timeout would stop it
            # and leave a size's process holding the card.
            argv = [*argv, "--budget-s", f"{max(timeout - 15, 20):.0f}"]
        if key == "olmo-core" and importlib.util.find_spec("olmo_core") is None:
            res = {"name": "OLMo-core compile", "error": "skipped: ai2-olmo-core is not installed (carry its wheel)"}
            print(json.dumps(res), flush=True)
            results.append(res)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(res) + "\n")
            continue
        print(f"== {key} (timeout {timeout:.0f} s)", flush=True)
        t0 = time.perf_counter()
        log = logs / f"{key}.log"
        try:
            if key == "olmo-core":
                res = run_olmo_core(args, logs, timeout)
            elif key in ("cli-torch", "cli-jax"):
                res = run_cli(key[4:], args, logs, timeout)
            elif key in ("jax-attention-test", "grouped-gemm-test"):
                name = "test_attention_impl.py" if key == "jax-attention-test" else "test_grouped_gemm.py"
                test = ROOT / "packages" / "olmo-train-jax" / "tests" / name
                proc = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(test)],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    cwd=ROOT,
                )
                log.write_text(proc.stdout + proc.stderr)
                errs = [
                    ln for ln in proc.stdout.splitlines() if "relative error" in ln or "xla bf16" in ln or "Error" in ln
                ][:12]
                res = {
                    "name": key,
                    "exit": proc.returncode,
                    "summary": proc.stdout.strip().splitlines()[-1:],
                    "errors": errs,
                }
            else:
                # Output goes straight to the log, so a contender stopped at its timeout still
                # leaves what it printed (device run 2 lost a whole MoE table that way).
                with open(log, "w") as f:
                    proc = subprocess.run(
                        [sys.executable, __file__, *argv],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        text=True,
                        timeout=timeout,
                        cwd=ROOT,
                    )
                text = log.read_text()
                found = [ln[7:] for ln in text.splitlines() if ln.startswith("RESULT ")]
                if found:
                    res = json.loads(found[-1])
                else:
                    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-3:]
                    res = {"name": key, "error": f"exit {proc.returncode}: " + " | ".join(tail)[-600:]}
        except subprocess.TimeoutExpired:
            partial = [ln for ln in log.read_text().splitlines() if ln.startswith("{")] if log.exists() else []
            res = {"name": key, "error": f"timed out after {timeout:.0f} s", "partial": partial}
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        print(json.dumps(res), flush=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(res) + "\n")
    print_table(results)


def print_table(results: list[dict]) -> None:
    env = next((r for r in results if r.get("name") == "env" and "matmul_bf16_tflops" in r), None)
    measured = env["matmul_bf16_tflops"] * 1e12 if env else None
    if env:
        print(
            f"\n{env['device']}: torch {env['torch']}, jax {env.get('jax')}, bf16 8192^3 matmul "
            f"{env['matmul_bf16_tflops']:.0f} TFLOP/s, copy {env['copy_tb_per_s']:.2f} TB/s"
        )
    print(
        f"{'contender':44s} {'step s':>7s} {'tok/s/dev':>10s} {'TFLOP/s':>8s} {'MFU(989)':>9s} "
        f"{'MFU(meas)':>9s} {'mem GiB':>8s} {'warmup s':>9s}"
    )
    # 32 and 64 experts run in contenders of their own: their ratios to E = 8 come from here.
    add_moe_model_ratios(
        [row for r in results if str(r.get("name", "")).startswith("moe-model") for row in r.get("rows", [])]
    )
    for r in results:
        if str(r.get("name", "")).startswith("moe-model") and "rows" in r:
            for row in r["rows"]:
                label = f"{r['name']} {row.get('gemm') or ''}".strip()
                head = f"{label:36s} E={row['experts']:<4d} {row['routing']:8s}"
                if "error" in row:
                    print(f"{head} {row['error'][:200]}")
                    continue
                ratio = row.get("tokens_per_s_vs_e8")
                mem = f"{row['peak_mem_gib']:.1f} GiB" if row.get("peak_mem_gib") else "- GiB"
                print(
                    f"{head} {row['step_s'] * 1e3:8.1f} ms {row['tokens_per_s']:10,.0f} tok/s "
                    f"{row['tflops']:6.1f} TFLOP/s load max/mean {row['expert_load_max_over_mean']:.2f} {mem:>9s} "
                    + (f"{ratio:.3f} of E=8" if ratio else "")
                    + f" ({row['layers']} layers x {row['expert_hidden']}, {row['params_total'] / 1e9:.3g} B params)"
                )
        elif r.get("cli"):
            ev = ", ".join(f"{k} ppl {v['perplexity']:.1f}" for k, v in (r["eval"] or {}).items())
            print(
                f"{r['name']:44s} {r['steps']} steps, loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, "
                f"{r['tokens_per_s_per_device']:,.0f} tok/s/dev, MFU {r['mfu']:.1%} ({r['mfu_peak']}), "
                f"held-out {ev}, checkpoints {r['checkpoints']}"
            )
        elif "tokens_per_s_per_device" in r:
            meas = f"{r['model_tflops'] * 1e12 / measured:.1%}" if measured else "-"
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") else "-"
            print(
                f"{r['name']:44s} {r['step_s']:7.3f} {r['tokens_per_s_per_device']:10,.0f} "
                f"{r['model_tflops']:8.1f} {r['mfu_datasheet']:9.1%} {meas:>9s} {mem:>8s} "
                f"{sum(r['warmup_s']):9.1f}"
            )
        elif "rows" in r:
            base = {}
            for row in r["rows"]:
                label = f"{r['name']} {row.get('gemm', '')}".strip()
                if "error" in row:
                    print(f"{label:34s} E={row['experts']:<4d} {row['routing']:8s} {row['error'][:200]}")
                    continue
                key = (row.get("gemm"), row["routing"])
                base.setdefault(key, (row["experts"], row["tokens_per_s"]))
                print(
                    f"{label:34s} E={row['experts']:<4d} {row['routing']:8s} {row['step_s'] * 1e3:8.2f} ms "
                    f"{row['tokens_per_s']:12,.0f} tok/s {row['tflops']:7.1f} TFLOP/s "
                    f"{row['tokens_per_s'] / base[key][1]:.3f} of E={base[key][0]}"
                )
        elif "error" in r:
            print(f"{r['name']:44s} {r['error']}")
            for line in r.get("partial", []):  # rows a timed-out contender printed before its limit
                print(f"    {line[:200]}")
        elif "summary" in r:
            print(f"{r['name']:44s} exit {r['exit']} {r['summary']}")
            for ln in r["errors"]:
                print(f"    {ln}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("all", "torch", "jax"):
        p = sub.add_parser(name)
        p.add_argument("--preset", default="olmo3-1b")
        p.add_argument("--seq", type=int, default=4096)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--steps", type=int, default=8, help="timed steps")
        p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
        p.add_argument("--max-seconds", type=float, default=120, help="stop timing once this much has run")
    sub.choices["all"].add_argument("--out", required=True)
    sub.choices["all"].add_argument("--deadline-s", type=float, default=450)
    sub.choices["all"].add_argument(
        "--only",
        nargs="+",
        default=DEFAULT_PLAN,
        help="contenders, in this order (default: the plan of README 'Default plan', about 8 minutes)",
    )
    sub.choices["all"].add_argument("--cli-preset", default="olmo3-190m", help="model of the cli-* contenders")
    sub.choices["all"].add_argument("--cli-steps", type=int, default=30)
    sub.choices["all"].add_argument("--moe-experts", type=int, nargs="+", default=[8, 32, 64, 128])
    sub.choices["all"].add_argument("--moe-tokens", type=int, default=16384)
    sub.choices["all"].add_argument("--moe-jax-gemm", nargs="+", default=["auto", "ragged"])
    sub.choices["all"].add_argument("--moe-model-experts", type=int, nargs="+", default=[8, 128])
    sub.choices["all"].add_argument("--moe-model-more-experts", type=int, nargs="+", default=[32, 64])
    sub.choices["all"].add_argument("--moe-model-batch", type=int, default=4, help="sequences per MoE-model step")
    sub.choices["all"].add_argument("--moe-model-expert-hidden", type=int, default=MOE_MODEL_HIDDEN)
    sub.choices["all"].add_argument("--moe-model-layers", type=int, default=None, help="default: the preset's")
    sub.choices["all"].add_argument("--moe-model-gemm", nargs="+", default=["auto"])
    sub.choices["all"].add_argument(
        "--moe-model-compile", action=argparse.BooleanOptionalAction, default=True, help="no: CPU dry runs"
    )
    sub.choices["all"].add_argument("--moe-model-precision", default="bf16", help="JAX; fp32: CPU dry runs")
    sub.choices["all"].add_argument("--moe-d-model", type=int, default=2048)
    sub.choices["all"].add_argument("--moe-hidden", type=int, default=1024)
    sub.choices["torch"].add_argument("--compile", action="store_true")
    sub.choices["torch"].add_argument("--ac", action="store_true", help="activation checkpointing per block")
    sub.choices["torch"].add_argument(
        "--parallel",
        choices=["fsdp", "none"],
        default="fsdp",
        help="fsdp: FSDP2 on a 1-rank group, bf16 params / fp32 reduce; none: no wrapper, bf16 autocast",
    )
    sub.choices["jax"].add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"))
    sub.choices["jax"].add_argument(
        "--precision",
        default="bf16",
        choices=("bf16", "fp32"),
        help="fp32 only for dry runs on CPU (XLA:CPU has no bf16 x bf16 -> f32 dot)",
    )
    sub.choices["jax"].add_argument("--remat", default="none", choices=("none", "block", "save_dots"))
    sub.add_parser("env")
    for name in ("moe-torch", "moe-jax"):
        p = sub.add_parser(name)
        p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64, 128])
        p.add_argument("--routing", nargs="+", default=["learned", "random"])
        p.add_argument("--tokens", type=int, default=16384)
        p.add_argument("--d-model", type=int, default=2048)
        p.add_argument("--hidden", type=int, default=1024)
        p.add_argument("--repeats", type=int, default=10)
    sub.choices["moe-jax"].add_argument(
        "--gemm",
        nargs="+",
        default=["auto", "ragged"],
        help="grouped GEMM backends (grouped_gemm.GEMM_BACKENDS; auto = grouped_gemm.gemm_backend)",
    )
    for name in ("moe-model-torch", "moe-model-jax"):
        p = sub.add_parser(name, help="the whole model's train step with every MLP an MoE block (moe_model_spec)")
        p.add_argument("--preset", default="olmo3-1b", help="the shape: d_model, heads, vocab, window, layers")
        p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset's (stated in each row)")
        p.add_argument("--expert-hidden", type=int, default=MOE_MODEL_HIDDEN, help="routed and shared expert width")
        p.add_argument(
            "--experts", type=int, nargs="+", default=[8, 32, 64, 128], help="routed experts, one process each"
        )
        p.add_argument("--routing", nargs="+", default=["learned", "random"], choices=("learned", "random", "uniform"))
        p.add_argument("--seq", type=int, default=4096)
        p.add_argument("--batch", type=int, default=4, help="sequences per step (moe_model_spec: 16,384 tokens)")
        p.add_argument("--steps", type=int, default=8, help="timed steps")
        p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
        p.add_argument("--max-seconds", type=float, default=60, help="stop timing a row once this much has run")
        p.add_argument("--budget-s", type=float, default=None, help="start no size after this many seconds")
        p.add_argument("--one-experts", type=int, default=None, help=argparse.SUPPRESS)  # a size's own process
    sub.choices["moe-model-torch"].add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile each block"
    )
    jm = sub.choices["moe-model-jax"]
    jm.add_argument("--gemm", nargs="+", default=["auto"], choices=("auto", "ragged", "tiled", "mgpu"))
    jm.add_argument("--remat", default="save_dots", choices=("none", "block", "save_dots"))
    jm.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"))
    jm.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="fp32 only for dry runs on CPU")
    args = parser.parse_args()
    {
        "all": cmd_all,
        "env": cmd_env,
        "torch": cmd_torch,
        "jax": cmd_jax,
        "moe-torch": cmd_moe_torch,
        "moe-jax": cmd_moe_jax,
        "moe-model-torch": cmd_moe_model,
        "moe-model-jax": cmd_moe_model,
    }[args.cmd](args)


if __name__ == "__main__":
    main()

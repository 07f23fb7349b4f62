"""tools/bench/gpu/bench_gpu.py's whole-model MoE contenders (moe-model-torch, moe-model-jax) end
to end on CPU at a tiny shape, as the GPU run drives them (a driver process, one process per
expert count), and the parameter count behind their default E = 128 shape.

Expected values are derived by hand from the shape: the tiny preset (d 64, 4 heads of 16, vocab
4096, full q/k norms) cut to 2 layers, experts 32 wide, top-4 routed + 1 shared; 2 sequences of
64 tokens per step."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench" / "gpu" / "bench_gpu.py"
D, LAYERS, HIDDEN, VOCAB, TOP_K = 64, 2, 32, 4096, 4
BATCH, SEQ = 2, 64
SHAPE = ["--preset", "tiny", "--layers", str(LAYERS), "--expert-hidden", str(HIDDEN)]
STEPS = ["--seq", str(SEQ), "--batch", str(BATCH), "--steps", "1", "--warmup", "1"]


def hand_params(n_experts: int, d: int, layers: int, hidden: int, vocab: int) -> int:
    """Embedding + head, final norm, and per layer: q/k/v/o, q and k norms (full width), the
    two block norms, the router, the routed experts and the shared one (SwiGLU: 3 d h each)."""
    per_layer = 4 * d * d + 2 * d + 2 * d + d * n_experts + (n_experts + 1) * 3 * d * hidden
    return 2 * vocab * d + d + layers * per_layer


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_shape_fits_one_h200():
    """The E = 128 default (olmo3-1b: d 2048, 16 layers, vocab 100,352 padded; experts 256 wide)
    holds the parameter count its docstring states, and its estimate leaves the margin it claims."""
    bench = _bench_module()
    spec = bench.moe_model_spec("olmo3-1b", 128)
    mem = bench.moe_model_memory(spec, 4 * 4096)
    assert mem["params"] == hand_params(128, 2048, 16, 256, 100352) == 3_930_195_968
    assert mem["state_bytes"] == 16 * mem["params"]
    assert mem["total_bytes"] < 0.75 * 141e9  # the docstring's "31% free", rounded down
    wider = bench.moe_model_memory(bench.moe_model_spec("olmo3-1b", 128, expert_hidden=384), 4 * 4096)
    assert wider["total_bytes"] > 0.9 * 141e9  # why 384 was not chosen


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Both contenders, started together (each is mostly process start-up and compilation).
    torch: experts 8 and 16 (two size processes), both routings. JAX: experts 8, random routing
    only, as its compile per row is the slow part; the driver and its per-size processes are the
    same code for both trainers, and the bench builds learned and random rows alike (only
    ``moe.routing`` differs, and both routings run through the JAX trainer's own tests)."""
    # One intra-op thread each: the two run side by side on a small CPU.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmds = {
        "torch": [*SHAPE, "--experts", "8", "16", "--routing", "learned", "random", *STEPS, "--no-compile"],
        "jax": [*SHAPE, "--experts", "8", "--routing", "random", *STEPS, "--precision", "fp32"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(BENCH), f"moe-model-{name}", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for name, argv in cmds.items()
    }
    out = {}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, text[-3000:]
        result = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert result, text[-3000:]
        plans = [json.loads(ln.split(": ", 1)[1]) for ln in text.splitlines() if ln.startswith("moe-model plan: ")]
        out[name] = (json.loads(result[-1][7:]), plans)
    return out


@pytest.mark.parametrize(
    "trainer,experts,routings", [("torch", (8, 16), ("learned", "random")), ("jax", (8,), ("random",))]
)
def test_moe_model_rows(dry_runs, trainer, experts, routings):
    result, plans = dry_runs[trainer]
    rows = result["rows"]
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    assert sorted((r["experts"], r["routing"]) for r in rows) == sorted((e, r) for e in experts for r in routings)
    printed = {p["experts"]: p["params_total"] for p in plans}
    tps = {(r["experts"], r["routing"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        e = r["experts"]
        # The count the driver printed, the count of the model the trainer built, and the hand count.
        assert printed[e] == r["params_built"] == hand_params(e, D, LAYERS, HIDDEN, VOCAB)
        assert r["layers"] == LAYERS and r["tokens_per_step"] == BATCH * SEQ
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["tflops"] > 0
        counts = r["tokens_per_expert"]
        # Dropless: every token reaches top_k experts in every layer.
        assert len(counts) == e and sum(counts) == BATCH * SEQ * TOP_K * LAYERS == r["assignments"]
        assert r["dropped"] == 0
        mean = sum(counts) / e
        assert r["expert_load_max_over_mean"] == pytest.approx(max(counts) / mean, rel=1e-12)
        assert r["tokens_per_s_vs_e8"] == pytest.approx(tps[(e, r["routing"])] / tps[(8, r["routing"])], rel=1e-12)
        assert all(loss == loss and 7.0 < loss < 10.0 for loss in r["losses"])  # ln(4096) = 8.32 at init
        if trainer == "jax":
            assert r["gemm"] == "tiled"  # grouped_gemm.gemm_backend's choice on CPU for gemm=auto

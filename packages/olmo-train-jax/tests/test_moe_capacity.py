"""The capacity rule (``moe.capacity_factor``, ``olmo_model.moe``) in the JAX MoE block (CPU,
float32): the kept assignments against the numpy rule, the block's output against a float64
numpy computation of the kept assignments, ``capacity_factor: null`` against the dropless path
bitwise, the dropped count on the train line against a count by hand; on 4 simulated devices
(a subprocess, since the device count is fixed when JAX starts), expert parallelism against the
all-local block, and the all-to-all bytes of the compiled expert-parallel block against the
minimum (every assignment's row sent once) and against the dropless buffer.

    uv run --frozen pytest packages/olmo-train-jax/tests/test_moe_capacity.py -n 0 -q
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from olmo_model import MoESpec
from olmo_model.moe import capacity_keep, expert_capacity

SPEC = MoESpec(n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=0)
D, B, S = 32, 8, 16  # C = ceil(1.0 x 16 x 2 / 8) = 4 rows per (sequence, expert)
FACTOR = 1.25  # the HLO measurement's factor: C = 5


def _case(seed: int = 3):
    """Inputs [B*S, D] and weights whose router prefers experts 0 and 1 (so capacity 1.0 drops)."""
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(D)
    direction /= np.linalg.norm(direction)
    x = (direction + rng.standard_normal((B * S, D))).astype(np.float32)
    router = (0.3 * rng.standard_normal((D, SPEC.n_experts))).astype(np.float32)
    router[:, :2] += 1.5 * direction[:, None]
    shape = (SPEC.n_experts, D, SPEC.expert_hidden)
    gate, up = ((0.2 * rng.standard_normal(shape)).astype(np.float32) for _ in range(2))
    down = (0.2 * rng.standard_normal((SPEC.n_experts, SPEC.expert_hidden, D))).astype(np.float32)
    return x, router, (gate, up, down)


def _block(experts_fn, x, router, weights, routing="learned"):
    import jax
    import jax.numpy as jnp

    from olmo_train_jax.grouped_gemm import ExpertWeights
    from olmo_train_jax.moe import moe_block

    routed = ExpertWeights(*(jnp.asarray(w) for w in weights))
    key = jax.random.key(4)

    def f(x):
        return moe_block(
            x,
            jnp.asarray(router),
            routed,
            None,
            SPEC,
            routing=routing,
            key=key,
            experts_fn=experts_fn,
            sequence_length=S,
        )

    with jax.default_matmul_precision("highest"):
        return jax.jit(f)(jnp.asarray(x))


@pytest.mark.parametrize("mode", ["learned", "random", "uniform"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_kept_assignments_are_the_numpy_rules(mode, factor):
    import jax
    import jax.numpy as jnp

    from olmo_train_jax.capacity import capacity_slots
    from olmo_train_jax.moe import route

    x, router, _ = _case()
    logits = jnp.asarray(x) @ jnp.asarray(router)
    experts = np.asarray(route(logits, SPEC, mode, jax.random.key(4))[0]).reshape(B, S, SPEC.top_k)
    c = expert_capacity(factor, S, SPEC.top_k, SPEC.n_experts)
    slots = jax.jit(capacity_slots, static_argnums=(1, 2))(jnp.asarray(experts), SPEC.n_experts, c)
    keep = np.asarray(slots.keep)
    np.testing.assert_array_equal(keep.reshape(B, S, SPEC.top_k), capacity_keep(experts, SPEC.n_experts, c))
    slot, source = np.asarray(slots.slot), np.asarray(slots.source)
    assert len(set(slot[keep].tolist())) == keep.sum()  # one row per kept assignment
    cell = experts.reshape(-1) * B + np.repeat(np.arange(B), S * SPEC.top_k)
    np.testing.assert_array_equal(slot[keep] // c, cell[keep])
    np.testing.assert_array_equal(source[slot[keep]], np.nonzero(keep)[0])
    assert (source < keep.size).sum() == keep.sum()


def _swiglu64(gate, up, down, x):
    g, u = x @ gate, x @ up
    return (g / (1 + np.exp(-g)) * u) @ down


@pytest.mark.parametrize("routing", ["learned", "random"])
def test_block_output_is_the_kept_assignments_computed_in_float64(routing):
    """out = sum over kept (token, slot) of w x SwiGLU_e(x); dropped assignments add nothing. The
    routing (experts and weights) is the block's own route; the rest is numpy."""
    import jax
    import jax.numpy as jnp

    from olmo_train_jax.moe import local_experts, route

    x, router, weights = _case()
    out, stats = _block(functools.partial(local_experts, capacity_factor=1.0), x, router, weights, routing)
    logits = jnp.asarray(x) @ jnp.asarray(router)
    with jax.default_matmul_precision("highest"):
        experts, w, _ = (np.asarray(a) for a in route(logits, SPEC, routing, jax.random.key(4)))
    keep = capacity_keep(experts.reshape(B, S, SPEC.top_k), SPEC.n_experts, 4).reshape(-1, SPEC.top_k)
    assert 0 < (~keep).sum() == int(stats.dropped)
    g, u, d = (a.astype(np.float64) for a in weights)
    want = np.zeros((B * S, D))
    for t, j in zip(*np.nonzero(keep), strict=True):
        e = experts[t, j]
        want[t] += w[t, j] * _swiglu64(g[e], u[e], d[e], x[t].astype(np.float64))
    # fp32 against float64: sums of 32 and 16 products of O(1) terms, well inside 1e-5.
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=0)


def test_null_capacity_is_the_dropless_path_bitwise():
    from olmo_train_jax.moe import local_experts

    x, router, weights = _case()
    out, stats = _block(functools.partial(local_experts, capacity_factor=None), x, router, weights)
    want, want_stats = _block(local_experts, x, router, weights)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert int(stats.dropped) == int(want_stats.dropped) == 0


def test_dropped_count_reaches_the_train_line(tmp_path):
    """Uniform routing sends each 64-token sequence's 256 assignments 32 to each of tiny-moe's 8
    experts (assignment n to expert n mod 8); capacity 0.5 keeps C = 16: 8 x 16 dropped per
    sequence, x 8 sequences x 4 layers = 4096 by hand."""
    from test_train import write_mixture

    from olmo_run.metrics import read_metrics
    from olmo_train_jax.cli import main

    mixture = write_mixture(tmp_path / "mixture")
    args = ["--model=tiny-moe", "--train.global_batch_tokens=512", "--train.precision=fp32", "--log.progress=false"]
    args += ["--moe.routing=uniform", "--moe.capacity_factor=0.5", "--train.steps=1", "--eval.every=100"]
    assert main([*args, "--checkpoint.every=100", f"--data.mixture={mixture}", f"--run_dir={tmp_path / 'run'}"]) == 0
    (line,) = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert line["moe_dropped_tokens"] == 4 * 8 * 8 * (32 - 16) == 4096
    assert sum(line["moe_tokens_per_expert"]) == 4 * 512 * 4  # counts are before the rule


# ---- 4 simulated devices ---------------------------------------------------------------------------

_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|s8|u8|pred)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def all_to_all_bytes(hlo: str) -> int:
    """Bytes the all-to-alls of a compiled (per-device) HLO module produce: each instruction's
    result shape(s), summed."""
    total = 0
    for line in hlo.splitlines():
        if " all-to-all(" not in line or "=" not in line:
            continue
        result = line.split("=", 1)[1].split(" all-to-all(", 1)[0]
        for dtype, dims in _SHAPE.findall(result):
            total += _BYTES[dtype] * int(np.prod([int(v) for v in dims.split(",") if v] or [1]))
    return total


def _measure() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType

    from olmo_train_jax.expert_parallel import expert_parallel_experts
    from olmo_train_jax.grouped_gemm import ExpertWeights
    from olmo_train_jax.moe import local_experts, moe_block

    assert jax.device_count() == 4
    x, router, weights = _case()
    results: dict = {}
    local, local_stats = _block(functools.partial(local_experts, capacity_factor=1.0), x, router, weights)
    for data, expert in ((2, 2), (1, 4)):
        mesh = jax.make_mesh((data, expert), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
        out, stats = _block(expert_parallel_experts(mesh, capacity_factor=1.0), x, router, weights)
        results[f"ep{expert}_vs_local"] = float(np.abs(np.asarray(out) - np.asarray(local)).max())
        results[f"ep{expert}_dropped"] = [int(stats.dropped), int(local_stats.dropped)]
    mesh = jax.make_mesh((1, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    routed = ExpertWeights(*(jnp.asarray(w) for w in weights))
    for name, factor in (("capacity", FACTOR), ("dropless", None)):
        fn = expert_parallel_experts(mesh, capacity_factor=factor)

        def block(x, fn=fn):
            return moe_block(x, jnp.asarray(router), routed, None, SPEC, experts_fn=fn, sequence_length=S)

        results[f"{name}_bytes"] = all_to_all_bytes(jax.jit(block).lower(jnp.asarray(x)).compile().as_text())
    return results


@pytest.fixture(scope="module")
def measured() -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_expert_parallel_with_capacity_matches_the_local_block(measured):
    """data 2 x expert 2 and expert 4 against all experts on one device, each sequence whole on one
    device: the per-sequence rule drops the same assignments, so the outputs agree to fp32
    rounding (the same products summed in another order) and the dropped counts are equal."""
    for ep in (2, 4):
        got, want = measured[f"ep{ep}_dropped"]
        assert got == want > 0
        assert measured[f"ep{ep}_vs_local"] <= 1e-5


def test_all_to_all_bytes_are_the_capacity_factor_times_the_minimum(measured):
    """Per device (2 of the 8 sequences, expert=4, one forward: dispatch and combine), the minimum
    is every assignment's row once each way: 2 x (2 x 16 x 2 rows x 32 x 4 bytes). Capacity 1.25
    moves E x B x C = 8 x 2 x 5 rows each way, at most factor x minimum plus the ceil's padding
    (under one row per (expert, sequence)); the dropless buffer holds every row for each of the 4
    destinations (and their expert ids): 4x the minimum and more."""
    row = D * 4
    minimum = 2 * (2 * S * SPEC.top_k) * row
    padding = 2 * SPEC.n_experts * 2 * row
    assert measured["capacity_bytes"] == 2 * SPEC.n_experts * 2 * 5 * row
    assert measured["capacity_bytes"] <= FACTOR * minimum + padding
    assert measured["dropless_bytes"] >= 4 * minimum


if __name__ == "__main__":
    print(json.dumps(_measure()))

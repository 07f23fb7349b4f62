"""``olmo-train-jax RECIPE --dry-run --devices KIND:COUNT`` (``dry_run``): the train step compiled
ahead of time for small TPU topologies, its numbers checked against references worked out by hand
(GPU targets: test_dry_run_gpu.py).

The spec is small (d_model 256, 8 layers = two repeats of the 4-layer pattern, so the layer scan
is a real loop; 256-token rows) and each compile takes seconds. Needs libtpu (the dev group
installs it), which is what compiles for a TPU topology on this CPU-only machine.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("libtpu", reason="compiling for a TPU topology needs libtpu (uv sync --extra tpu)")

from olmo_model import flops_per_token, param_counts  # noqa: E402
from olmo_model.maths import matmul_params_per_token  # noqa: E402
from olmo_run.recipe import RecipeError, load_recipe  # noqa: E402
from olmo_train_jax import aot_targets, hlo_cost, parallelize, step  # noqa: E402  # noqa: E402
from olmo_train_jax.cli import main  # noqa: E402
from olmo_train_jax.model import build_model  # noqa: E402

MIXTURE = Path(__file__).resolve().parents[3] / "recipes" / "mixtures" / "olmo3-stage1.yaml"
SEQ = 256
WINDOW = 64
SPEC = {
    "name": "dry-run-test",
    "d_model": 256,
    "n_layers": 8,
    "n_heads": 2,
    "mlp_hidden": 512,
    "vocab_size": 4096,
    "padded_vocab_size": 4096,
    "eos_token_id": 0,
    "pad_token_id": 1,
    "sliding_window": WINDOW,
    "max_position_embeddings": 4096,
}
GIB = 2**30


def write_recipe(path: Path, rows: int, spec: dict | None = None) -> Path:
    recipe = dict(
        name="dry-run-test",
        model=spec or SPEC,
        data=dict(mixture=str(MIXTURE)),
        train=dict(sequence_length=SEQ, global_batch_tokens=rows * SEQ, micro_batch_size=1, steps=10, precision="bf16"),
        jax=dict(mesh=dict(data=1, fsdp=-1, tensor=1), remat="none"),
    )
    path.write_text(yaml.safe_dump(recipe))
    return path


@functools.cache
def cli_json(recipe: Path, devices: str) -> tuple[int, dict, str]:
    """(exit status, the --json object, stderr) of the CLI's dry run; each layout compiles once."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(recipe), "--dry-run", "--devices", devices, "--json"])
    return rc, json.loads(out.getvalue()), err.getvalue()


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> dict[int, Path]:
    """Recipes of 8 and 16 rows of 256 tokens (one row per device per micro-step on 8 and 16 devices)."""
    d = tmp_path_factory.mktemp("dry_run")
    return {rows: write_recipe(d / f"rows{rows}.yaml", rows) for rows in (8, 16)}


def test_cli_json_keys_layout_and_arguments_are_the_sharded_state(recipes):
    rc, report, _ = cli_json(recipes[8], "v5p:4")
    assert rc == 0
    for key in (
        "devices",
        "device_kind",
        "mesh",
        "per_device_batch",
        "accumulation_steps",
        "peak_bytes_per_device",
        "hbm_bytes_per_device",
        "fits",
        "planner_peak_bytes_per_device",
        "compile_seconds",
        "estimated_step_seconds",
        "estimated_mfu",
    ):
        assert key in report, key
    assert report["devices"] == 4 and report["device_kind"] == "v5p"
    assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    # 8 rows over 4 data-parallel devices, micro_batch_size 1: one row per device, 2 micro-steps.
    assert (report["per_device_batch"], report["accumulation_steps"]) == (1, 2)
    assert report["fits"] is True and report["hbm_bytes_per_device"] == 95 * GIB
    assert 0 < report["estimated_mfu"] < 1 and report["estimated_step_seconds"] > 0

    # Arguments by hand: fp32 parameter + AdamW mu + nu = 12 bytes per parameter. Every matrix
    # (embedding, head, stacked projections) splits over fsdp=4 (all its sizes divide 4); the
    # norm scales are replicated (parallelize.param_partition_spec). The batch: input_ids and labels,
    # [2 micro-steps, 1 row, 256] int32 per device (doc_ids is unused without document masking and
    # jit drops unused arguments); lr and step are scalars that XLA:TPU pads to a 128-lane tile of 4
    # bytes (512 bytes each).
    d, L, q, kv = 256, 8, 256, 256
    norms = L * (2 * d + q + kv) + d  # post-attention, post-feedforward, q_norm, k_norm; final norm
    matrices = param_counts(load_recipe(recipes[8], []).model_spec()).total - norms
    state = 12 * (matrices // 4 + norms)
    batch = 2 * (2 * 1 * SEQ * 4)
    scalars = 2 * 128 * 4
    parts = report["memory_bytes"]
    assert parts["arguments"] == state + batch + scalars
    assert report["peak_bytes_per_device"] == sum(parts.values())


def _attention_flops_per_token(n_heads: int, head_dim: int) -> float:
    """The attention matmuls the compiled step runs per token (not olmo_model's causal count):
    the 2 global layers (3, 7) run ``blocked_causal_attention`` with one query block of all 256
    positions (``causal_attention.query_block(256)``), so every query scores 256 keys, in 7 matmul
    passes (forward: scores, values; its own backward: scores recomputed, dv, dp, dq, dk); the 6
    sliding layers (window 64, S >= 4 W) run the blocked local path, each query scoring its own
    and the previous 64-key block (128 keys) in 6 passes (autodiff of dot_product_attention keeps
    the probabilities). A pass is 2 x heads x head_dim x keys FLOPs per query."""
    per_pass = 2 * n_heads * head_dim
    return 2 * 7 * per_pass * SEQ + 6 * 6 * per_pass * 2 * WINDOW


def test_compiled_flops_match_the_matmuls_by_hand_and_the_model_count(recipes):
    _, report, _ = cli_json(recipes[8], "v5p:4")
    spec = load_recipe(recipes[8], []).model_spec()
    tokens = 8 * SEQ
    reference = tokens * (6 * matmul_params_per_token(spec) + _attention_flops_per_token(2, 128))
    compiled = report["compiled_flops_per_step"]
    # XLA also counts the non-matmul work (RMSNorm, RoPE, softmax, SwiGLU, the loss, AdamW), which
    # neither reference has: about 2% of this step; 4% leaves room for XLA's fusion choices.
    assert reference <= compiled <= 1.04 * reference
    # olmo_model counts only causal keys (p + 1 per query) and no backward recompute, so the
    # compiled step runs more: here the excess attention above plus that non-matmul work.
    model = flops_per_token(spec, SEQ) * tokens
    assert report["model_flops_per_step"] == pytest.approx(model, rel=1e-12)
    assert 1.0 < compiled / model < 1.10


def test_scaled_cost_counts_each_loop_body_trip_count_times():
    """A program whose FLOPs are known exactly: a scan of 3 steps around a scan of 4 matmuls of
    128 x 128 (2 x 128^3 FLOPs each) and one more matmul outside: 13 matmuls, where XLA's own cost
    analysis counts the loop bodies once (2 matmuls + the outside one)."""
    _, devices = aot_targets.topology_devices("v5p", 1)
    n = 128
    w_spec = jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=NamedSharding(jax.sharding.Mesh(devices, ("x",)), P()))

    def f(x, w):
        def inner(c, _):
            return c @ w, None

        def outer(c, _):
            return jax.lax.scan(inner, c, None, length=4)[0], None

        return jax.lax.scan(outer, x, None, length=3)[0] @ w

    compiled = jax.jit(f).lower(w_spec, w_spec).compile()
    cost = hlo_cost.scaled_cost(compiled.as_text())
    matmul = 2 * n**3
    # Beside the matmuls XLA counts the loop counters' adds and compares and an elementwise pass or
    # two over the 128 x 128 carry (n^2 FLOPs each, 1/256 of a matmul): 1e-3 allows three passes.
    assert cost.flops == pytest.approx(13 * matmul, rel=1e-3)
    assert cost.flops_once == pytest.approx(compiled.cost_analysis()["flops"], rel=1e-6)
    assert sorted(cost.trip_counts.values()) == [3, 4]


def test_the_step_estimate_scales_the_cost_model_and_refuses_what_is_no_time():
    """optimal_seconds x compiled FLOPs / FLOPs counted once; nothing where XLA's cost model gives
    no positive time (XLA:TPU gave -1894 s for olmo3-7b on tpu7x:256, which became a negative MFU)."""
    cost = hlo_cost.ScaledCost(flops=12.0, flops_once=3.0, trip_counts={"body": 4})
    assert hlo_cost.step_estimate(0.5, cost) == 2.0
    for bad in (None, 0.0, -1894.8, float("nan")):
        assert hlo_cost.step_estimate(bad, cost) is None
    assert hlo_cost.step_estimate(0.5, hlo_cost.ScaledCost(flops=0.0, flops_once=0.0, trip_counts={})) is None


def test_temporaries_do_not_grow_with_the_device_count(recipes):
    """Doubling the devices at a fixed per-device batch (one row per device per micro-step)
    leaves each device the same work, so its temporaries must not grow: before the residual
    stream was pinned to the batch split (``OlmoModel.hidden_sharding``, issue 17), XLA could
    all-gather the global batch's activations onto every device for the FSDP matmuls (at the 7B's
    width: 118 GiB of temporaries on 64 devices, 12.6 TiB on 512)."""
    _, four, _ = cli_json(recipes[8], "v5p:4")
    _, eight, _ = cli_json(recipes[16], "v5p:8")
    assert (four["per_device_batch"], four["accumulation_steps"]) == (
        eight["per_device_batch"],
        eight["accumulation_steps"],
    )
    # Sharded weights and gradients halve, so the total may only shrink; 5% allows for XLA's
    # different buffer packing at another device count.
    assert eight["memory_bytes"]["temporaries"] <= 1.05 * four["memory_bytes"]["temporaries"]


def test_for_mesh_picks_the_tpu_path_and_pins_the_batch_split(recipes):
    """Tracing for a TPU topology on a CPU host takes the TPU kernels (by the mesh's platform, not
    ``jax.default_backend()``) and pins the residual stream to the batch axes."""
    recipe = load_recipe(recipes[8], [])
    spec = recipe.model_spec()
    _, devices = aot_targets.topology_devices("v5p", 4)
    mesh = parallelize.build_mesh(recipe.jax.mesh, devices)
    model = nnx.eval_shape(lambda: build_model(spec))
    step.for_mesh(model, spec, recipe, mesh)
    assert jax.default_backend() == "cpu" and model.platform == "tpu"
    assert model.hidden_sharding == NamedSharding(mesh, P(("data", "fsdp"), None, None))


def test_quarter_size_keeps_the_global_batch_by_accumulating_in_the_program(recipes):
    _, full, _ = cli_json(recipes[8], "v5p:4")
    _, quarter, _ = cli_json(recipes[8], "v5p:1")
    assert quarter["devices"] == 1 and quarter["mesh"]["fsdp"] == 1
    assert quarter["per_device_batch"] == full["per_device_batch"] == 1
    assert quarter["accumulation_steps"] == 4 * full["accumulation_steps"] == 8
    # The whole global batch's FLOPs are in the quarter's compiled program (a program of one
    # micro-step would count an eighth of them); 1% for what differs: the optimizer runs on 4x
    # the parameters per device over a quarter of the devices, and 7 accumulating adds instead of 1.
    assert quarter["compiled_flops_per_step"] == pytest.approx(full["compiled_flops_per_step"], rel=0.01)


def test_a_step_that_cannot_fit_exits_1_with_the_reason(tmp_path):
    # 8 layers of d_model 8192 / MLP 32768: 8.7B parameters, 97 GiB of fp32 weights and AdamW
    # state on one v5p chip (95 GiB HBM) before any activation.
    big = dict(SPEC, name="too-big", d_model=8192, n_heads=64, mlp_hidden=32768)
    rc, report, err = cli_json(write_recipe(tmp_path / "big.yaml", 1, big), "v5p:1")
    assert rc == 1 and report["fits"] is False
    assert report["peak_bytes_per_device"] > report["hbm_bytes_per_device"]
    assert any("RESOURCE_EXHAUSTED" in note for note in report["notes"])
    assert err.strip().splitlines()[-1].startswith("does not fit: v5p:1 needs")


@pytest.mark.parametrize(
    ("kind", "chips", "shape"),
    [
        ("v5p", 512, (8, 8, 8)),
        ("v5p", 128, (4, 4, 8)),
        ("v5p", 4, (2, 2, 1)),
        ("v5p", 1, (1, 1, 1)),
        ("v6e", 256, (16, 16)),
        ("tpu7x", 64, (4, 4, 4)),
    ],
)
def test_topology_shapes(kind, chips, shape):
    assert aot_targets.topology_shape(kind, chips) == shape


def test_topology_devices_tpu7x_has_two_per_chip_and_bad_counts_are_refused():
    name, devices = aot_targets.topology_devices("tpu7x", 4)
    assert name == "tpu7x:2x2x1" and len(devices) == 8
    with pytest.raises(RecipeError, match="v5p:7"):
        aot_targets.topology_devices("v5p", 7)

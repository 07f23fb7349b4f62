"""Context parallelism on simulated CPU devices (fp32): the trainer's step with the sequence split
over ``jax.mesh.context`` follows the CP=1 step; the forward at full length matches the numpy
reference; sliding layers exchange only the window's keys; the state resumes across CP degrees;
per-device activation memory falls with the degree.

    uv run --frozen pytest packages/olmo-train-jax/tests/test_context_parallel.py -n 0 -q

Spec: tiny-gqa (4 query heads, 2 key/value heads) cut to 2 layers, one sliding (window 48) and
one global (with YaRN, original context 64, for the logits checks), at sequence 256: at CP=4 a chunk is 32 tokens and a device's shard 64, so the window
is longer than a chunk (two chunks back: halo 2) and shorter than a shard; at CP=2 (chunk 64) it
reaches one chunk back. The context kernel's query block is 16 (``context_block``: at most half a
chunk), so the sequence is 4 x CP x block at CP=4. A second spec with window 100 (more than the
halo path saves at CP=4: ``halo_gathers``) takes the all-gather fallback (its logits are checked).
One process compiles each layout's step once and runs CP=1, CP=4 and CP=2 x data 2 with and without
document masking; the resume chain reuses the CP=4 run's step-4 checkpoint. The device count must
be set before JAX starts, so the measurements run in a subprocess (this file run as a script with
XLA_FLAGS) that prints them as JSON; the tests assert.

Tolerances: per-step losses within ``olmo_model.layout_loss_tolerance`` of CP=1 (fp32, 1020
token losses per step at loss ~8.3: the reordered-sum bound, 4.5e-5, at step 1, where the weights
are equal, and that plus a measured drift envelope, 2.5e-4 more, from step 2, where AdamW carries
the layouts' last-bit differences forward; measured at most 4.8e-6 natively and 3.8e-6 with
``--xla_cpu_max_isa=AVX2``, 2.3e-5 reported by CI on an AMD EPYC:
packages/olmo-train-jax/bench/results/2026-12-03-layout-bounds-cpu.md);
logits within 1e-5 of the float64 reference (fp32 matmuls at highest precision on a 2-layer,
width-64 model: measured 2e-6). The subprocess's XLA_FLAGS are this process's plus its device count,
so a CPU code path chosen by flags (``--xla_cpu_max_isa=AVX2``) reaches it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from olmo_model import layout_loss_tolerance

STEPS = 20
SEQ = 256
ROWS = 4
WINDOW = 48
FAR_WINDOW = 100
RESUME_EVERY = 4  # CP=4 for steps 1-4, CP=2 for 5-8, CP=1 for 9-12
# lr 1e-3 (after 5 warmup steps): at 3e-3 the fp32 rounding of a reordered sum grew ~2x per step
# from step 6 in every layout (CP=2 x data 2 as much as CP=4), 1e-3 the AdamW runs of the other
# layout tests use.
LR = 1e-3


def _measure(memory_seq: int | None = None) -> dict:
    """Everything the tests assert (or, with ``memory_seq``, only the per-device memory of the
    fused step at that sequence for CP=1/2/4, one row: the figures of the README's table)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from olmo_model import get_preset, reference
    from olmo_model.context import ContextLayout
    from olmo_run.checkpoints import checkpoint_dir
    from olmo_run.recipe import RecipeError, load_recipe
    from olmo_train_jax import model_from_hf
    from olmo_train_jax import parallelize as sh
    from olmo_train_jax.checkpoint import Checkpointer, abstract_like, load_checkpoint
    from olmo_train_jax.context_parallel import context_block
    from olmo_train_jax.step import BATCH_KEYS, for_mesh, step_functions

    assert jax.device_count() == 8, jax.devices()
    started = time.perf_counter()

    def mark(what: str) -> None:  # where the subprocess's time goes, on its stderr
        print(f"{time.perf_counter() - started:7.1f}s {what}", file=sys.stderr, flush=True)

    # One sliding and one global layer (a period of 2: half the compile of Olmo 3's 3:1 pattern).
    spec = get_preset("tiny-gqa").replace(
        n_layers=2, layer_types=("sliding_attention", "full_attention"), sliding_window=WINDOW, name="cp-w48"
    )
    far = spec.replace(sliding_window=FAR_WINDOW, name="cp-w100")
    # The forward checks add YaRN on the global layer beyond 64 tokens (as stage 3's beyond 8192),
    # so RoPE and YaRN both take the split's positions. (Training runs without it: with YaRN the
    # 20-step runs of CP=2 x data 2, a mere reordering, already part from CP=1 by 2e-5.)
    yarn = {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}
    spec_yarn = spec.replace(yarn=yarn, name="cp-w48-yarn")
    params0 = {s.name: reference.init_params(s, seed=5) for s in (spec, far, spec_yarn)}

    def recipe_for(masking: bool):
        return load_recipe(
            None, ["--train.precision=fp32", f"--optim.lr={LR}", f"--train.document_masking={str(masking).lower()}"]
        )

    def batch(step: int, seq: int = SEQ, rows: int = ROWS) -> dict[str, np.ndarray]:
        """A learnable stream (arithmetic progressions) in documents of ~60 tokens."""
        rng = np.random.default_rng(step)
        start = rng.integers(0, 4000, (rows, 1))
        stride = rng.integers(1, 9, (rows, 1))
        ids = ((start + stride * np.arange(seq + 1)) % 4000 + 2).astype(np.int32)
        doc = np.cumsum(rng.random((rows, seq)) < 1 / 60, axis=1).astype(np.int32)
        labels = ids[:, 1:].copy()
        labels[:, -1] = -100
        return {"input_ids": ids[:, :-1], "labels": labels, "doc_ids": doc}

    def prepared(s, recipe, axes: dict[str, int]):
        n = int(np.prod(list(axes.values())))
        mesh = sh.build_mesh(axes, jax.devices()[:n])
        m = for_mesh(model_from_hf(s, params0[s.name]), s, recipe, mesh)
        fns = step_functions(m, s, recipe, mesh)
        return mesh, m, fns

    def shaped(tree, shardings):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    cp1, cp2, cp4 = {"data": 1}, {"data": 1, "context": 2}, {"data": 1, "context": 4}
    if memory_seq is not None:
        long = spec.replace(sliding_window=memory_seq // 8, name="cp-long")
        params0[long.name] = reference.init_params(long, seed=5)
        memory = {}
        for degree, axes in ((1, cp1), (2, cp2), (4, cp4)):
            mesh, m, fns = prepared(long, recipe_for(True), axes)
            b = {
                k: jax.ShapeDtypeStruct((1, 1, memory_seq), jnp.int32, sharding=sh.batch_sharding(mesh))
                for k in BATCH_KEYS
            }
            scalar = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            compiled = fns.fused.lower(
                shaped(m.params, m.params_sh),
                shaped(m.abstract_opt, m.opt_sh),
                b,
                jax.ShapeDtypeStruct((), jnp.float32, sharding=scalar),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar),
            ).compile()
            mem = compiled.memory_analysis()
            memory[str(degree)] = {
                "temporaries": int(mem.temp_size_in_bytes),
                "arguments": int(mem.argument_size_in_bytes),
            }
            mark(f"memory cp{degree}")
        return {"memory_seq": memory_seq, "window": long.sliding_window, "memory": memory}

    out: dict = {"block": context_block(ContextLayout(SEQ, 4).chunk, 1, 4, SEQ), "chunk": ContextLayout(SEQ, 4).chunk}
    tmp = tempfile.TemporaryDirectory()
    save_to = Path(tmp.name)
    compiled: dict = {}

    def key_of(s, masking: bool, axes: dict[str, int]) -> tuple:
        return (s.name, masking, tuple(sorted(axes.items())))

    def place(mesh, local: dict[str, np.ndarray]) -> dict:
        # The trainer's placement: columns to the context order, rows to their shards.
        return {k: sh.global_batch_array(local[k], mesh, 1, local[k].shape[0]) for k in BATCH_KEYS}

    def lr(step: int) -> np.float32:
        return np.float32(LR * min(1.0, step / 5))

    def train(s, masking: bool, axes: dict[str, int], steps=range(1, STEPS + 1), state=None, save_at=None):
        """Per-step losses of the trainer's fused step; one compile per layout (kept, with its
        program text and memory analysis)."""
        key = key_of(s, masking, axes)
        if key not in compiled:
            compiled[key] = {"setup": prepared(s, recipe_for(masking), axes)}
        entry = compiled[key]
        mesh, m, fns = entry["setup"]
        if state is None:
            params = jax.device_put(m.params, m.params_sh)
            state = (params, jax.jit(m.tx.init, out_shardings=m.opt_sh)(params))
        params, opt = state
        losses = []
        for step in steps:
            args = (params, opt, place(mesh, batch(step)), lr(step), np.int32(step))
            if "step" not in entry:
                entry["step"] = fns.fused.lower(*args).compile()
            params, opt, stats = entry["step"](*args)
            losses.append(float(stats["loss"]))
            if step == save_at:
                writer = Checkpointer(save_to, keep=3, async_save=False)
                writer.save(step, params, opt, {"step": step})
                writer.close()
        return losses, (params, opt)

    layouts = {"cp4": cp4, "cp2_data2": {"data": 2, "context": 2}}
    # The loader's view: context is not a data-parallel axis; a context group reads one shard.
    out["loader"] = {}
    for name, axes in (("cp4", cp4), ("cp2_data2", layouts["cp2_data2"]), ("cp2_data4", {"data": 4, "context": 2})):
        mesh = sh.build_mesh(axes, jax.devices()[: int(np.prod(list(axes.values())))])
        out["loader"][name] = {"dp": sh.dp_size(mesh), "shards": list(sh.process_batch_shards(mesh))}
    try:
        sh.check_sequence_split(sh.build_mesh(cp4, jax.devices()[:4]), 250)
        out["bad_sequence"] = None
    except RecipeError as err:
        out["bad_sequence"] = str(err)
    try:
        sh.build_mesh({"data": 1, "context": -1}, jax.devices()[:4])
        out["bad_axis"] = None
    except RecipeError as err:
        out["bad_axis"] = str(err)
    out["losses"] = {}
    for masking in (False, True):
        name = "masked" if masking else "plain"
        runs = {"cp1": train(spec, masking, cp1)[0]}
        for layout, axes in layouts.items():
            save_at = RESUME_EVERY if (layout, masking) == ("cp4", False) else None
            runs[layout] = train(spec, masking, axes, save_at=save_at)[0]
            mark(f"{name} {layout}")
        out["losses"][name] = runs

    # ---- resume across CP degrees: CP=4 -> CP=2 -> CP=1 through Orbax checkpoints ----------------
    # The plain CP=4 run saved its step-4 state; CP=2 resumes it for steps 5-8 and saves, CP=1
    # resumes that for steps 9-12 (each restore reshards onto the new mesh).
    resumed = list(out["losses"]["plain"]["cp4"][:RESUME_EVERY])
    for i, axes in ((1, cp2), (2, cp1)):
        key = key_of(spec, False, axes)
        compiled.setdefault(key, {"setup": prepared(spec, recipe_for(False), axes)})
        _, m, _ = compiled[key]["setup"]
        params, opt, saved = load_checkpoint(
            checkpoint_dir(save_to, i * RESUME_EVERY),
            abstract_like(m.params, m.params_sh),
            abstract_like(m.abstract_opt, m.opt_sh),
        )
        assert saved == i * RESUME_EVERY, saved
        steps = range(i * RESUME_EVERY + 1, (i + 1) * RESUME_EVERY + 1)
        resumed += train(spec, False, axes, steps, (params, opt), save_at=steps[-1])[0]
    out["resumed"] = resumed
    tmp.cleanup()
    mark("resume")

    # The compiled steps of CP=1/2/4 (data 1, 4 rows of 256): per-device memory and collectives.
    out["memory"] = {}
    for degree, axes in ((1, cp1), (2, cp2), (4, cp4)):
        mem = compiled[key_of(spec, False, axes)]["step"].memory_analysis()
        out["memory"][str(degree)] = {"temporaries": int(mem.temp_size_in_bytes)}
    out["hlo_cp4"] = _collectives(compiled[key_of(spec, False, cp4)]["step"].as_text())

    # ---- forward logits at full length against the numpy reference --------------------------------
    ids = batch(99)["input_ids"][:2]
    out["logits_err"] = {}
    composed = {
        "cp2_fsdp2": {"data": 1, "fsdp": 2, "context": 2},
        "cp2_tensor2": {"data": 1, "context": 2, "tensor": 2},
    }
    forwards = [("cp4", spec_yarn, cp4), ("cp2_data2", spec_yarn, layouts["cp2_data2"]), ("far_cp4", far, cp4)]
    for name, s, axes in forwards + [(name, spec_yarn, axes) for name, axes in composed.items()]:
        mesh, m, _ = prepared(s, recipe_for(False), axes)
        positions = jnp.asarray(sh.sequence_positions(mesh, SEQ))
        forward = jax.jit(
            lambda p, x, m=m, positions=positions: nnx.merge(m.graphdef, p)(x, positions=positions).logits
        )
        placed = jax.device_put(m.params, m.params_sh)
        x = jnp.asarray(sh.to_context_order(ids, mesh))
        program = forward.lower(placed, x).compile()
        layout = sh.context_layout(mesh, SEQ)
        assert layout is not None
        logits = layout.unshard(np.asarray(program(placed, x)), axis=1)
        out["logits_err"][name] = float(np.abs(logits - reference.forward(s, params0[s.name], ids)).max())
        if name == "far_cp4":
            out["hlo_far_cp4"] = _collectives(program.as_text())
        mark(f"logits {name}")
    return out


_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (collective-permute|all-gather)(?:-start)?\(", re.M)
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _collectives(hlo: str) -> dict[str, list[list]]:
    """The result shapes of every collective-permute and all-gather in a compiled module, by op
    (dtype first, then the dimensions; a combined collective's tuple gives one entry per part;
    an async start's (operand, result) pair gives its result)."""
    found: dict[str, list[list]] = {"collective-permute": [], "all-gather": []}
    for result, op in _COLLECTIVE.findall(hlo):
        shapes = [[dtype, *[int(d) for d in dims.split(",") if d]] for dtype, dims in _SHAPE.findall(result)]
        if result.startswith("(") and "start" in op:
            shapes = shapes[len(shapes) // 2 :]
        found[op] += [sh for sh in shapes if sh[0] != "u32"]  # u32[]: an async op's context
    return found


@pytest.fixture(scope="module")
def measured() -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_losses_follow(ref: np.ndarray, got: np.ndarray) -> None:
    """Step s of two runs from the same initial weights within ``layout_loss_tolerance`` of the
    step's ROWS x (SEQ - 1) token losses (each row's last label is -100)."""
    for s, (want, have) in enumerate(zip(ref, got), start=1):
        assert abs(have - want) <= layout_loss_tolerance(want, ROWS * (SEQ - 1), s), (s, want, have)


@pytest.mark.parametrize("masking", ["plain", "masked"])
@pytest.mark.parametrize("layout", ["cp4", "cp2_data2"])
def test_context_parallel_losses_follow_cp1_for_20_steps(measured, masking, layout):
    ref = np.asarray(measured["losses"][masking]["cp1"])
    got = np.asarray(measured["losses"][masking][layout])
    assert len(ref) == len(got) == STEPS
    assert ref[-1] < ref[0] - 0.02  # the runs learn (8.33 -> 8.26 / 8.28), so the weights move
    _assert_losses_follow(ref, got)


def test_context_is_model_parallel_for_the_loader_and_bad_layouts_are_one_line(measured):
    loader = measured["loader"]
    assert loader["cp4"] == {"dp": 1, "shards": [0]}  # 4 devices, one sequence group
    assert loader["cp2_data2"] == {"dp": 2, "shards": [0, 1]}
    assert loader["cp2_data4"] == {"dp": 4, "shards": [0, 1, 2, 3]}
    assert measured["bad_sequence"] == (
        "jax.mesh.context=4: sequence_length=250 does not split into 2 x 4 equal chunks for context degree 4; "
        "use a degree whose double divides the sequence length"
    )
    assert "jax.mesh.context cannot be -1" in measured["bad_axis"]


def test_document_masking_changes_the_loss(measured):
    # The masked and plain runs differ (the masks reach the attention under CP too).
    plain, masked = measured["losses"]["plain"]["cp4"], measured["losses"]["masked"]["cp4"]
    assert abs(plain[0] - masked[0]) > 1e-4


def test_a_window_past_the_halo_limit_gathers_and_still_matches_the_reference(measured):
    # Window 100 at CP=4 (chunk 32): 99 keys back is more than the 3 chunks where the halo moves
    # fewer keys than the all-gather (``halo_gathers``), so the sliding layer gathers too.
    assert measured["logits_err"]["far_cp4"] <= 1e-5
    hlo = measured["hlo_far_cp4"]
    assert [s for s in hlo["collective-permute"] if s[0] == "f32"] == []
    kv = [s for s in hlo["all-gather"] if s[0] == "f32" and len(s) == 5 and s[3] == SEQ]
    assert len(kv) >= 2  # K and V gathered (XLA may share one gather between the two layers' paths)


def test_resume_across_context_degrees_follows_the_uninterrupted_run(measured):
    resumed = np.asarray(measured["resumed"])
    ref = np.asarray(measured["losses"]["plain"]["cp1"][: len(resumed)])
    assert len(resumed) == 3 * RESUME_EVERY
    _assert_losses_follow(ref, resumed)  # both from the same initial weights: step 1 is step 1


@pytest.mark.parametrize("layout", ["cp4", "cp2_data2", "cp2_fsdp2", "cp2_tensor2"])
def test_forward_logits_at_full_length_match_the_numpy_reference(measured, layout):
    assert measured["logits_err"][layout] <= 1e-5


def test_sliding_layers_move_only_the_windows_keys(measured):
    """In the compiled CP=4 train step (forward and backward), every key/value collective-permute
    carries a piece of the window - 1 = 47 keys before a chunk (the whole chunk two back, 32 keys,
    and the last 15 of the chunk before: halo 2), while the global layer's all-gathers carry all
    256."""
    hlo = measured["hlo_cp4"]
    chunk = measured["chunk"]
    # [rows, kv heads, keys, head_dim] float pieces: the sliding layers' K and V halos.
    pieces = [s for s in hlo["collective-permute"] if s[0] == "f32"]
    assert pieces, hlo
    assert all(len(s) == 5 and s[2] == 2 and s[4] == 16 for s in pieces), pieces
    assert sorted({s[3] for s in pieces}) == sorted({WINDOW - 1 - chunk, chunk})
    # A sliding layer's forward permutes per key kind: 2 distances x 3 routes (module
    # context_parallel ``_halo``; pieces with no source are not sent) for K and for V.
    assert len(gathered_kv := [s for s in hlo["all-gather"] if s[0] == "f32" and len(s) == 5]) >= 2, gathered_kv
    gathered = [s for s in hlo["all-gather"] if s[0] == "f32" and len(s) == 5]
    assert gathered and all(s[3] == SEQ for s in gathered), gathered
    # A permute's keys against a gather's: the window's share of the sequence.
    assert max(s[3] for s in pieces) * 4 < SEQ


def test_per_device_activation_memory_falls_with_the_context_degree(measured):
    # The compiler's temporaries per device of the train step (4 rows of 256 tokens, data 1):
    # activations, attention scores and gradients of S / C tokens per row. The parameters are
    # arguments, and the K/V gathers add a share that does not shrink, so less than 1/2 per
    # doubling is not expected; 3/4 is a margin below the 1/2 of a perfect split.
    mem = {int(k): v["temporaries"] for k, v in measured["memory"].items()}
    assert mem[2] < 0.75 * mem[1] and mem[4] < 0.75 * mem[2], mem


if __name__ == "__main__":
    # ``--memory-seq N``: only the CP=1/2/4 memory of the fused step at N tokens (README table).
    seq = int(sys.argv[sys.argv.index("--memory-seq") + 1]) if "--memory-seq" in sys.argv else None
    print(json.dumps(_measure(seq)))

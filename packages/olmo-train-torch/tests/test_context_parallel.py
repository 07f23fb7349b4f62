"""Context parallelism (``torch.context_parallel``; ``context_parallel.py``) against CP = 1 and the
float64 numpy reference, on gloo CPU processes in fp32.

The spec (``SPEC``): 4 layers (3 sliding, window 24, then 1 global with YaRN), grouped-query
attention (4 heads, 2 KV heads), sequence 128. At CP = 2 a chunk is 32 tokens, so the window is
shorter than a chunk (halo 1); at CP = 4 a chunk is 16 and a shard 32, so the window is longer
than a chunk and shorter than a shard (halo 2, keys from two ranks). 128 = 4 x CP x 8 at CP = 4.

One run of 4 gloo processes (``_worker``, ranks from the fork server: tests/support/ranks.py) does
the in-process checks and writes what it measured to a JSON file the tests read:

- forward logits at the full length, reassembled from the ranks' shards, against
  ``olmo_model.reference.forward`` (CP = 4, and CP = 2 x data 2); with document masking against
  the reference run on each document alone (RoPE scores depend on q - k only, so a document's
  logits are those of the document by itself: an independent reference for the mask);
- bytes sent by one forward's sliding and global layers (``ContextParallel.bytes_sent``);
- 20 steps of ``step.train_step`` for CP = 4 (FSDP over 4) and CP = 2 x data 2 (HSDP 2 x 2),
  with and without document masking, against a single-process CP = 1 run of the same batches.

The trainer CLI (loader, checkpoints, resume, evaluation) runs separately: CP = 4 on 4 processes
(FSDP2), its checkpoint resumed at CP = 2 (DDP) and that one's at CP = 1 (one process).

Activation memory: the dry run's tracker (FakeTensorMode, fake process group of 4) for CP = 1, 2, 4.

Tolerances. Logits: 1e-5, the issue's bound; the fp32 forward against float64 differs by fp32
rounding only (measured: 9.2e-7 at CP = 4 and CP = 2, with and without document masking).
Losses: CP reorders the attention's key sums and the gradient sums over ranks, and AdamW carries
that forward, so ``olmo_model.layout_loss_tolerance`` of the step's token losses, counted from the
step both runs take from the same weights (the reordered-sum bound at that step, plus a measured
drift envelope after it; the gaps measured natively and with ATen's AVX2 kernels:
packages/olmo-train-jax/bench/results/2026-12-03-layout-bounds-cpu.md).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from ranks import start_ranks

from olmo_model import get_preset, layout_loss_tolerance
from olmo_model.context import ContextLayout

SEQ = 128
WINDOW = 24
ROWS = 4  # sequences of the forward checks
GLOBAL_BATCH = 8  # sequences per training step
STEPS = 20
TOL = 1e-5  # the logits' bound (the issue's); see the module docstring for the margins


def cp_spec():
    return get_preset("tiny-gqa").replace(
        sliding_window=WINDOW,
        mlp_hidden=128,
        yarn=dict(factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0),
    )


def _tokens(seed: int, rows: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (a skewed distribution, so a model has something to learn) and document ids:
    each row cut into documents of 9-60 tokens."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(rows, SEQ)) + 1, vocab - 1).astype(np.int64)
    docs = np.zeros((rows, SEQ), dtype=np.int64)
    for r in range(rows):
        start, doc = 0, 0
        while start < SEQ:
            n = int(rng.integers(9, 61))
            docs[r, start : start + n] = doc
            start, doc = start + n, doc + 1
    return ids, docs


def _batch(step: int, vocab: int) -> dict[str, np.ndarray]:
    """The global batch of ``step``: labels are the next token, -100 at each row's end and at
    one in seven positions (so counts differ between shards and ranks)."""
    ids, docs = _tokens(1000 + step, GLOBAL_BATCH, vocab)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[np.random.default_rng(step).random(labels.shape) < 1 / 7] = -100
    return {"input_ids": ids, "labels": labels, "doc_ids": docs}


# ---- the 4-rank worker --------------------------------------------------------------------------


def _worker(rank: int, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from olmo_model import reference
    from olmo_run.recipe import Recipe, batch_layout
    from olmo_train_torch.hf_adapter import model_from_hf
    from olmo_train_torch.parallelize import Distributed, build_context, build_mesh
    from olmo_train_torch.step import make_optimizer, start_model, train_step

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    world = dist.get_world_size()
    spec = cp_spec()
    results: dict = {"forward": {}, "bytes": {}, "losses": {}}

    def gather_obj(obj):
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    # ---- forward logits and bytes sent ----
    ids, docs = _tokens(0, ROWS, spec.vocab_size)
    params = reference.init_params(spec, seed=3)
    if rank == 0:
        ref = reference.forward(spec, params, ids)
        ref_docs = np.zeros_like(ref)
        for r in range(ROWS):
            for doc in np.unique(docs[r]):
                cols = np.nonzero(docs[r] == doc)[0]
                ref_docs[r, cols] = reference.forward(spec, params, ids[r : r + 1, cols])[0]
    for cp in (4, 2):
        recipe = Recipe(model="tiny-gqa", train={"steps": 1}, torch={"context_parallel": cp})
        context = build_context(recipe.torch, "cpu")
        assert context is not None
        model = model_from_hf(spec, params)
        model.context = context
        rows = slice(context.dp_rank * ROWS // context.dp_size, (context.dp_rank + 1) * ROWS // context.dp_size)
        t_ids = context.shard(torch.from_numpy(ids[rows]))
        t_docs = context.shard(torch.from_numpy(docs[rows]))
        with torch.no_grad():
            context.bytes_sent.update({"global": 0, "sliding": 0})
            plain = model(t_ids).logits.numpy()
            sent = dict(context.bytes_sent)
            masked = model(t_ids, t_docs).logits.numpy()
        shards = gather_obj((context.rank, context.dp_rank, plain, masked, sent))
        if rank == 0:
            layout = ContextLayout(SEQ, cp)
            full = {"plain": np.zeros((ROWS, SEQ, spec.padded_vocab_size)), "masked": None}
            full["masked"] = np.zeros_like(full["plain"])
            per = ROWS // (world // cp)
            for cp_rank, dp_rank, p, m, _ in shards:
                cols = layout.positions(cp_rank)
                full["plain"][dp_rank * per : (dp_rank + 1) * per, cols] = p
                full["masked"][dp_rank * per : (dp_rank + 1) * per, cols] = m
            results["forward"][str(cp)] = {
                "plain": float(np.abs(full["plain"] - ref).max()),
                "masked": float(np.abs(full["masked"] - ref_docs).max()),
                "masked_vs_plain": float(np.abs(full["masked"] - ref).max()),
            }
            results["bytes"][str(cp)] = [s[4] for s in shards]
        dist.barrier()

    # ---- 20 training steps against CP = 1 ----
    configs = {
        "cp4": {"parallel": "fsdp", "context_parallel": 4},
        "cp2_dp2": {"parallel": "hsdp", "replicate": 2, "context_parallel": 2},
    }

    def run(torch_section: dict, masking: bool, d: Distributed) -> list[float]:
        recipe = Recipe(
            model="tiny-gqa",
            train={"steps": STEPS, "precision": "fp32", "document_masking": masking, "global_batch_tokens": 8 * SEQ},
            optim={"lr": 1e-3},
            torch=torch_section,
        )
        cp = recipe.torch.context_parallel
        mesh = build_mesh(d, recipe.torch)
        model = start_model(recipe, spec, d, mesh, None)
        optimizer = make_optimizer(model, recipe, d.device)
        layout = batch_layout(GLOBAL_BATCH, d.world_size // cp)
        dp_rank = d.rank // cp
        per = GLOBAL_BATCH // layout.dp_size
        losses = []
        for step in range(1, STEPS + 1):
            batch = {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in _batch(step, spec.vocab_size).items()}
            stats = train_step(
                model, optimizer, batch, layout=layout, d=d, spec=spec, recipe=recipe, lr=1e-3, step=step
            )
            losses.append(stats.read()["loss"])
        return losses

    d_all = Distributed(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), initialized=True)
    d_one = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)
    for masking in (False, True):
        tag = "masked" if masking else "plain"
        if rank == 0:
            results["losses"][f"cp1_{tag}"] = run({"parallel": "none"}, masking, d_one)
        dist.barrier()
        for name, section in configs.items():
            losses = run(section, masking, d_all)
            if rank == 0:
                results["losses"][f"{name}_{tag}"] = losses
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp") / "results.json"
    start_ranks(_worker, 4, str(out))
    return json.loads(out.read_text())


# ---- the tests --------------------------------------------------------------------------------


def test_halo_plan_brings_exactly_the_window():
    """Simulated exchange (no processes): every rank's halo rows are exactly the positions its
    chunks' windows reach before them, for windows shorter than a chunk, longer than one, longer
    than a shard and reaching the sequence start."""
    from olmo_train_torch.context_parallel import halo_plan

    for seq, degree, window in [(128, 2, 24), (128, 4, 24), (128, 4, 40), (128, 4, 100), (96, 3, 20)]:
        layout = ContextLayout(seq, degree)
        plans = [halo_plan(layout, r, window) for r in range(degree)]
        sent = [[plans[src].send_index[sum(plans[src].send_sizes[:dst]) :][: plans[src].send_sizes[dst]]
                 for dst in range(degree)] for src in range(degree)]  # fmt: skip
        for r, plan in enumerate(plans):
            assert plan.recv_sizes == [plans[src].send_sizes[r] for src in range(degree)]
            # cat(local, received) in positions: this rank's, then each source's rows it sent here
            pool = list(layout.positions(r)) + [
                int(layout.positions(src)[i]) for src in range(degree) for i in sent[src][r]
            ]
            for slot, j in enumerate(layout.chunks_of(r)):
                want = [p for p in range(max(0, j * layout.chunk - window + 1), j * layout.chunk)]
                assert [pool[i] for i in plan.halo_index[slot]] == want, (seq, degree, window, r, slot)
                assert list(plan.halo_positions[slot]) == want
            assert plan.send_sizes[r] == 0  # nothing sent to itself


def test_bad_context_degrees_are_refused(harness, mixture, capsys):
    """One line naming torch.context_parallel and the fix, before anything runs."""
    from olmo_run.recipe import RecipeError, TorchSection
    from olmo_train_torch.parallelize import check_parallel, check_sequence_split

    harness.refused(
        capsys,
        [f"--data.mixture={mixture}", "--model=tiny", "--train.steps=1", "--torch.context_parallel=2"],
        "torch.context_parallel=2 does not divide the 1 ranks",
    )
    with pytest.raises(RecipeError, match="sequence length 100 is not a multiple of 8"):
        check_sequence_split(TorchSection(context_parallel=4), 100)
    with pytest.raises(RecipeError, match="HSDP shard group of 2 ranks"):
        check_parallel(TorchSection(parallel="hsdp", replicate=4, context_parallel=4), 8)
    with pytest.raises(RecipeError, match="mixture-of-experts model is not supported"):
        check_parallel(TorchSection(context_parallel=2), 4, get_preset("tiny-moe"))


def _rows_others_need(layout: ContextLayout, window: int, rank: int) -> int:
    """Brute force: the (destination, key position) pairs with the key held by ``rank``, the
    destination another rank, and some query of the destination seeing the key in its window."""
    mine = set(layout.positions(rank).tolist())
    total = 0
    for dst in range(layout.degree):
        if dst == rank:
            continue
        keys = {k for q in layout.positions(dst) for k in range(max(0, q - window + 1), q + 1)}
        total += len(keys & mine)
    return total


def test_sliding_layers_send_only_the_window(measured):
    """Bytes one forward sends: a sliding layer exactly the rows other ranks' windows reach
    (brute force above) of K and V; a global layer its whole K/V shard to every other rank."""
    spec = cp_spec()
    n_sliding = sum(spec.window_of(i) is not None for i in range(spec.n_layers))
    n_global = spec.n_layers - n_sliding
    for cp in (4, 2):
        layout = ContextLayout(SEQ, cp)
        rows_per_rank = ROWS // (4 // cp)
        row_bytes = 2 * rows_per_rank * spec.kv_heads * spec.head_dim * 4  # K and V, fp32
        for r, sent in enumerate(measured["bytes"][str(cp)]):
            cp_rank = r % cp
            want_sliding = n_sliding * _rows_others_need(layout, WINDOW, cp_rank) * row_bytes
            want_global = n_global * (cp - 1) * layout.shard_length * row_bytes
            assert sent == {"sliding": want_sliding, "global": want_global}, (cp, r, sent)
        # The window's keys only: per layer, a sliding layer sends at most 2 chunks' W - 1 rows.
        per_layer = max(s["sliding"] for s in measured["bytes"][str(cp)]) / n_sliding / row_bytes
        assert per_layer <= 2 * (WINDOW - 1)
        assert per_layer < (cp - 1) * layout.shard_length / 2


def test_forward_logits_match_the_reference_at_full_length(measured):
    for cp in ("4", "2"):
        got = measured["forward"][cp]
        assert got["plain"] <= TOL, (cp, got)
        assert got["masked"] <= TOL, (cp, got)
        assert got["masked_vs_plain"] > 1e-2  # the mask really changed the logits


@pytest.mark.parametrize("masking", ["plain", "masked"])
@pytest.mark.parametrize("config", ["cp4", "cp2_dp2"])
def test_losses_follow_cp1_for_20_steps(measured, config, masking):
    ref = measured["losses"][f"cp1_{masking}"]
    got = measured["losses"][f"{config}_{masking}"]
    assert len(got) == len(ref) == STEPS
    assert ref[-1] < ref[0] - 0.1  # it trains
    for step, (want, have) in enumerate(zip(ref, got), start=1):
        tokens = int((_batch(step, cp_spec().vocab_size)["labels"] != -100).sum())
        assert abs(have - want) <= layout_loss_tolerance(want, tokens, step), (step, want, have)


def _activation_worker(rank: int, port: int, seq: int, out_path: str) -> None:
    """The dry run's per-rank figures for CP = 1, 2, 4 (one sequence per data-parallel rank), as JSON."""
    from olmo_run.recipe import Recipe
    from olmo_train_torch.dry_run import dry_run

    out = {}
    for cp in (1, 2, 4):
        recipe = Recipe(
            model=cp_spec().model_dump(mode="json"),
            train={"steps": 1, "sequence_length": seq, "global_batch_tokens": seq * 4 // cp, "precision": "fp32"},
            torch={"context_parallel": cp},
        )
        r = dry_run(recipe, "h100", 4)
        out[cp] = [r.per_device_batch, r.mesh.get("context", 1), r.memory_bytes["activations"]]
    Path(out_path).write_text(json.dumps(out))


def test_activation_memory_falls_with_context_degree(tmp_path):
    """Rank 0's activation memory for one fp32 training step of a 4,096-token sequence on 4 ranks
    (the dry run: FSDPMemTracker under FakeTensorMode on a fake process group), CP = 1, 2, 4, one
    sequence per data-parallel rank. Per-token activations divide by C; what does not is a global
    layer's gathered K and V of the whole sequence (the exchange), so each doubling of C must at
    least halve the activations up to that: act(2C) <= act(C) / 2 + gathered K/V bytes."""
    seq = 4096
    spec = cp_spec()
    # In a process of its own (forked from the fork server): a dry run leaves DTensor state (its
    # fake 4-rank meshes) that a process forked from this one afterwards would inherit.
    out = tmp_path / "activations.json"
    start_ranks(_activation_worker, 1, seq, str(out))
    acts = {}
    for cp, (batch, context, activations) in json.loads(out.read_text()).items():
        assert batch == 1 and context == int(cp)
        acts[int(cp)] = activations
    gathered_kv = 2 * seq * spec.kv_width * 4  # K and V of the whole sequence, fp32
    assert acts[2] <= acts[1] / 2 + gathered_kv, acts
    assert acts[4] <= acts[2] / 2 + gathered_kv, acts


# ---- the trainer CLI: loader, checkpoints, resume across degrees ------------------------------------


def test_trainer_resumes_across_context_degrees(harness, tmp_path):
    """The trainer CLI (loader, FSDP2, DCP checkpoints, evaluation) at CP = 4 on 4 processes for
    9 steps with document masking; its step-3 checkpoint resumed at CP = 2 (2 processes, DDP), and that
    run's step-6 checkpoint at CP = 1 (one process, no context): each resumed step sees the same
    global batch (digest) and its loss, and the final held-out loss, are within
    ``layout_loss_tolerance`` of the uninterrupted CP = 4 run's, counted from the step-3
    checkpoint both resumed runs descend from (at most GLOBAL_BATCH x SEQ token losses a step; the
    held-out loss's own token count)."""
    from olmo_run.checkpoints import checkpoint_dir

    mixture = harness.make_mixture(tmp_path / "mixture")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(json.dumps(cp_spec().model_dump(mode="json")))

    def args(run_dir: Path, *extra: str) -> list[str]:
        return [
            f"--data.mixture={mixture}",
            f"--run_dir={run_dir}",
            f"--model={spec_file}",
            f"--train.sequence_length={SEQ}",
            f"--train.global_batch_tokens={GLOBAL_BATCH * SEQ}",
            "--train.steps=9",
            "--train.precision=fp32",
            "--train.document_masking=true",
            "--checkpoint.every=3",
            "--checkpoint.keep=5",
            "--eval.every=1000",
            "--log.progress=false",
            "--data.prefetch=1",
            *extra,
        ]

    def lines(run_dir: Path, kind: str) -> dict[int, dict]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return {r["step"]: r for r in rows if r["kind"] == kind}  # a resumed step: its last line

    four, two, one = tmp_path / "four", tmp_path / "two", tmp_path / "one"
    result = harness.run(args(four, "--torch.context_parallel=4"), nproc=4)
    harness.check_ok(result)
    assert "context parallel 4 (data-parallel 1)" in result.stdout
    shutil.copytree(four, two)
    for step in (6, 9):
        shutil.rmtree(checkpoint_dir(two, step))
    harness.check_ok(harness.run(args(two, "--torch.context_parallel=2", "--torch.parallel=ddp"), nproc=2))
    shutil.copytree(two, one)
    shutil.rmtree(checkpoint_dir(one, 9))
    harness.check_ok(harness.run(args(one)))

    want, want_eval = lines(four, "train"), lines(four, "eval")
    assert sorted(want) == list(range(1, 10)) and 9 in want_eval
    for run_dir, steps in ((two, range(4, 10)), (one, range(7, 10))):
        got = lines(run_dir, "train")
        for s in steps:
            assert got[s]["batch_digest"] == want[s]["batch_digest"], (run_dir.name, s)
            tol = layout_loss_tolerance(want[s]["loss"], GLOBAL_BATCH * SEQ, s - 3)
            assert abs(got[s]["loss"] - want[s]["loss"]) <= tol, (run_dir.name, s, got[s]["loss"], want[s]["loss"])
        ev, ev_want = lines(run_dir, "eval")[9]["eval"], want_eval[9]["eval"]
        assert ev.keys() == ev_want.keys() and ev
        for source in ev_want:
            # The weights after step 9: what step 10's loss would see, 7 steps from the checkpoint.
            tol = layout_loss_tolerance(ev_want[source]["loss"], ev_want[source]["tokens"], 7)
            assert abs(ev[source]["loss"] - ev_want[source]["loss"]) <= tol, (run_dir.name, source)

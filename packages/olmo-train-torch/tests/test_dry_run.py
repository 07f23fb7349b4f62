"""``olmo-train-torch --dry-run --devices KIND:COUNT``: rank 0 of a fake process group, the model
started as the trainer starts it under FakeTensorMode, one step tracked (``olmo_train_torch.dry_run``).

Checked against values derived here from the spec: the sharded fp32 parameters (FSDP2 pads each
parameter's dim 0 to a multiple of the ranks), AdamW's two moments plus a 4-byte step count per
parameter tensor, the batch layout; activation checkpointing lowers the activations at the peak;
a layout that cannot fit exits 1 with one line; bad requests exit 2 with one line; no process
group is left behind.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist

from olmo_model import PEAKS, get_preset, hf_param_shapes
from olmo_run.recipe import load_recipe
from olmo_train_torch.cli import main
from olmo_train_torch.dry_run import dry_run

GIB = 2**30
ROOT = Path(__file__).resolve().parents[3]
TINY = ["--model=tiny", "--train.sequence_length=256", "--train.global_batch_tokens=32768", "--train.precision=bf16"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dry(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    status = main([*args, "--json"])
    out = capsys.readouterr().out
    assert not dist.is_initialized()  # the fake process group is gone
    return status, json.loads(out)


def _sharded_bytes(ranks: int) -> tuple[int, int]:
    """(fp32 bytes of rank 0's padded FSDP2 shards, parameter tensors) of spec tiny."""
    shapes = list(hf_param_shapes(get_preset("tiny")).values())
    return sum(4 * math.ceil(s[0] / ranks) * math.prod(s[1:]) for s in shapes), len(shapes)


def test_tiny_on_64_fake_ranks(capsys):
    status, report = _dry(capsys, *TINY, "--torch.activation_checkpointing=true", "--dry-run", "--devices", "h100:64")
    assert status == 0 and report["fits"]
    assert report["ranks"] == report["devices"] == 64 and report["device_kind"] == "h100"
    assert report["mesh"] == {"dp": 64}
    # 32768 / 256 = 128 sequences over 64 ranks: 2 each, in one micro-step (no micro_batch_size).
    assert (report["per_device_batch"], report["accumulation_steps"]) == (2, 1)
    assert report["hbm_bytes_per_device"] == 81559 * 2**20  # nvidia-smi's total of an H100 80GB HBM3
    parts = report["memory_bytes"]
    params, tensors = _sharded_bytes(64)
    assert parts["params"] == params
    assert parts["optimizer"] == 2 * params + 4 * tensors
    assert report["peak_bytes_per_device"] == sum(parts.values()) >= params + parts["optimizer"]
    assert report["planner_peak_bytes_per_device"] > 0 and "FSDPMemTracker" in report["method"]
    # Without checkpointing every block keeps its activations for backward.
    _, plain = _dry(capsys, *TINY, "--dry-run", "--devices", "h100:64")
    assert parts["activations"] < plain["memory_bytes"]["activations"]


def test_olmo3_1b_on_one_host_of_b300s_and_b200s_within_5_percent_of_olmo_plan(capsys):
    """The 7B stage-1 recipe (block checkpointing, seq 8192) with the olmo3-1b preset and 8 sequences:
    one per rank of 8. Blackwell changes only the HBM (nvidia-smi's totals), so both kinds hold the
    same bytes; olmo-plan within 5% of them, as on the stage-1 recipes (bench/results/2026-12-01-meta-init.md)."""
    args = [str(ROOT / "recipes/olmo3-7b/stage1.yaml"), "--model=olmo3-1b", "--train.global_batch_tokens=65536"]
    shapes = list(hf_param_shapes(get_preset("olmo3-1b")).values())
    params = sum(4 * math.ceil(s[0] / 8) * math.prod(s[1:]) for s in shapes)
    reports = {}
    for kind, smi_mib in (("b300", 275040), ("b200", 183359)):
        status, report = _dry(capsys, *args, "--dry-run", "--devices", f"{kind}:8")
        assert status == 0 and report["fits"] and report["device_kind"] == kind
        assert report["hbm_bytes_per_device"] == smi_mib * 2**20
        assert (report["mesh"], report["per_device_batch"], report["accumulation_steps"]) == ({"dp": 8}, 1, 1)
        assert report["memory_bytes"]["params"] == params
        assert report["memory_bytes"]["optimizer"] == 2 * params + 4 * len(shapes)
        peak = report["peak_bytes_per_device"]
        assert abs(report["planner_peak_bytes_per_device"] / peak - 1) <= 0.05
        reports[kind] = peak
    assert reports["b300"] == reports["b200"]


def test_accumulation_reduces_every_micro_step_so_gradients_stay_sharded(capsys):
    """micro_batch_size 1: 2 micro-steps. The gradients at the peak are FSDP2's sharded fp32 ones
    (the reduce-scatter of each micro-step), never a full unsharded copy."""
    status, report = _dry(capsys, *TINY, "--train.micro_batch_size=1", "--dry-run", "--devices", "h100:64")
    assert status == 0 and report["accumulation_steps"] == 2
    params, _ = _sharded_bytes(64)
    full = 4 * sum(math.prod(s) for s in hf_param_shapes(get_preset("tiny")).values())
    assert report["memory_bytes"].get("unsharded_grads", 0) < full / 4


def test_a_layout_that_does_not_fit_exits_1_with_the_reason(capsys, tmp_path):
    """olmo3-32b's shapes cut to 10 layers on one GPU (no wrapper, ``MemTracker``): 5.9B parameters
    at 16 bytes each (fp32 weights and gradients, AdamW's two moments: 88 GiB) > the card's 79.65 GiB before any
    activation. Ten layers rather than a whole preset: the refusal comes after the tracked step, whose
    cost grows with the layers, and the path to it is the same."""
    spec = get_preset("olmo3-32b").replace(n_layers=10)
    assert 16 * sum(math.prod(s) for s in hf_param_shapes(spec).values()) > PEAKS["h100"].hbm_bytes
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    capsys.readouterr()
    args = [f"--model={spec_file}", "--train.sequence_length=128", "--train.global_batch_tokens=128"]
    assert main([*args, "--dry-run", "--devices", "h100:1"]) == 1
    captured = capsys.readouterr()
    assert "NO" in captured.out and "MemTracker" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("does not fit: h100:1 needs") and "HBM is 79.65 GiB" in err[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--dry-run"], "--devices KIND:COUNT"),
        (["--dry-run", "--devices", "v5p:8"], "name a GPU kind"),
        (["--dry-run", "--devices", "h900:8"], "h900"),
        (["--dry-run", "--devices", "gb300:8"], "use one of h100, h200, b200, b300"),
        (["--dry-run", "--devices", "h100:3"], "cannot be split over 3"),
        (
            ["--model=tiny-moe", "--torch.expert_parallel=2", "--dry-run", "--devices", "h100:4"],
            "torch.expert_parallel=1",
        ),
        (["--torch.parallel=ddp", "--dry-run", "--devices", "h100:4"], "torch.parallel=fsdp or hsdp"),
    ],
)
def test_bad_requests_are_one_line_and_exit_2(capsys, args, expected):
    capsys.readouterr()
    assert main([*TINY, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("args", "devices"),
    [
        ([*TINY, "--torch.activation_checkpointing=true", "--train.micro_batch_size=1"], 64),  # FSDP2, 2 micro-steps
        ([*TINY, "--torch.parallel=hsdp", "--torch.replicate=4", "--torch.activation_checkpointing=true"], 16),
        ([*TINY, "--torch.activation_checkpointing=true"], 1),  # no wrapper: MemTracker
        (["WIDE"], 1),  # peak in the optimizer step
        (["WIDE"], 4),  # peak in the backward (a block's unsharded gradients)
    ],
)
def test_peak_only_tracker_gives_the_bytes_of_torchs_tracker(args, devices, tmp_path):
    """The dry run's trackers leave out torch's per-module peaks; the step's peak and every part
    of it are the same bytes as with torch's FSDPMemTracker / MemTracker as they are. The tiny
    layouts peak in the head's forward; WIDE (tiny made 256 wide with a 256-token vocabulary, 16
    tokens per device) moves the peak to the optimizer step on one GPU and to the backward on 4."""
    if args == ["WIDE"]:
        spec = get_preset("tiny").replace(
            d_model=256, mlp_hidden=768, vocab_size=256, padded_vocab_size=256, n_layers=2,
            layer_types=("sliding_attention", "full_attention"),
        )  # fmt: skip
        spec_file = tmp_path / "wide.json"
        spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
        args = [f"--model={spec_file}", "--train.sequence_length=16", f"--train.global_batch_tokens={16 * devices}"]
        args.append("--train.precision=bf16")
    recipe = load_recipe(None, args)
    fast = dry_run(recipe, "h100", devices)
    full = dry_run(recipe, "h100", devices, module_stats=True)
    assert fast.memory_bytes == full.memory_bytes and len(fast.memory_bytes) >= 4
    assert fast.peak_bytes_per_device == full.peak_bytes_per_device == sum(full.memory_bytes.values())
    if args[0].endswith("wide.json"):  # the peak is past the forward: the gradients are in it
        assert full.memory_bytes["grads"] > 0


def test_accumulation_without_a_wrapper_holds_the_full_model_once(capsys):
    """One GPU, micro_batch_size 8: 16 micro-steps (the first two and the last run), plain
    ``MemTracker``. The fp32 weights and gradients are each the whole model once (the gradients
    accumulate in place), AdamW's moments twice plus a 4-byte step per tensor."""
    status, report = _dry(capsys, *TINY, "--train.micro_batch_size=8", "--dry-run", "--devices", "h100:1")
    assert status == 0 and report["accumulation_steps"] == 16 and "MemTracker" in report["method"]
    params, tensors = _sharded_bytes(1)
    parts = report["memory_bytes"]
    assert parts["params"] == parts["grads"] == params
    assert parts["optimizer"] == 2 * params + 4 * tensors
    assert report["peak_bytes_per_device"] == sum(parts.values())

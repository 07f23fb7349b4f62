"""olmo-plan on the repo's Olmo 3 recipes, and the launchers' dry runs."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from olmo_model import get_preset, param_counts
from olmo_run.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[3]
STAGE1 = ROOT / "recipes" / "olmo3-7b" / "stage1.yaml"


def _plan(capsys, *args):
    rc = plan_main([str(STAGE1), *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_stage1_on_512_devices_of_three_kinds(capsys):
    rc, out = _plan(capsys, "--devices", "tpu7x:512", "--devices", "v5p:512", "--devices", "h100:512")
    assert rc == 0
    # 5.93T tokens at 512 x 8192 tokens per step (the first report: about 1.41M steps)
    expected_steps = math.ceil(5.93e12 / (512 * 8192))
    assert expected_steps == 1_413_823
    for plan in out["plans"]:
        assert plan["steps"] == expected_steps
        assert (plan["global_batch"], plan["sequence_length"]) == (512, 8192)
        assert (plan["per_device_batch"], plan["accumulation_steps"]) == (1, 1)
        assert plan["fits"] and plan["memory_total_gib"] > 0
    assert [p["framework"] for p in out["plans"]] == ["jax", "jax", "torch"]
    # step time = FLOPs/token x tokens/step / (MFU x peak x devices); h100 vs v5p: 459/989
    h100, v5p = out["plans"][2], out["plans"][1]
    assert h100["step_time_s"] / v5p["step_time_s"] == pytest.approx(459 / 989)


def test_jax_on_gpus_drops_the_blocked_attention_scores_for_cudnn_flash(capsys):
    """``--framework jax`` on an H100 plans the JAX step with cuDNN's flash attention (bf16, no
    document mask, head_dim 128), which keeps no scores; with ``jax.attention=xla`` it keeps the
    blocked kernel's, ``JAX_ATTENTION_SCORES`` (1.5) x heads (32) x 8192^2 fp32 = 12 GiB per row,
    as on a TPU."""
    rc, out = _plan(capsys, "--devices", "h100:512", "--framework", "jax")
    rc_xla, xla = _plan(capsys, "--devices", "h100:512", "--framework", "jax", "--jax.attention=xla")
    assert rc == rc_xla == 0
    flash, blocked = out["plans"][0], xla["plans"][0]
    assert flash["framework"] == blocked["framework"] == "jax"
    assert blocked["memory_total_gib"] - flash["memory_total_gib"] == pytest.approx(1.5 * 32 * 8192**2 * 4 / 2**30)
    # The default for a GPU kind is still the torch trainer.
    rc, default = _plan(capsys, "--devices", "h100:512")
    assert default["plans"][0]["framework"] == "torch"


def test_quarter_of_the_devices_keeps_the_global_batch(capsys):
    rc, out = _plan(capsys, "--devices", "tpu7x:512", "--devices", "tpu7x:128")
    assert rc == 0
    full, quarter = out["plans"]
    assert quarter["global_batch"] == full["global_batch"] == 512
    # the recipe caps micro-batches at 1 sequence: a quarter of the devices accumulate 4 steps
    assert quarter["per_device_batch"] * quarter["dp_size"] * quarter["accumulation_steps"] == 512
    assert quarter["accumulation_steps"] == 4
    assert quarter["step_time_s"] == pytest.approx(4 * full["step_time_s"])
    assert "accumulation_steps 1 -> 4" in out["changes"][0]
    assert "global batch kept: 512 x 8192 tokens" in out["changes"][0]


def test_refuses_what_cannot_fit_and_names_the_knob(capsys):
    rc, out = _plan(
        capsys,
        "--devices",
        "h100:512",
        "--train.micro_batch_size=null",
        "--train.global_batch_tokens=33554432",
        "--torch.activation_checkpointing=false",
    )
    assert rc == 1
    plan = out["plans"][0]
    assert not plan["fits"] and plan["per_device_batch"] == 8
    assert "torch.activation_checkpointing=true" in plan["advice"]


def test_stage1_on_blackwell_plans_the_torch_step_at_the_datasheet_peak(capsys):
    """B200 / B300 are torch kinds: the same layout as h100:512 (so the same memory), step time
    scaled by the dense bf16 peaks (989 vs 2250 TFLOP/s) and HBM of nvidia-smi's totals."""
    rc, out = _plan(capsys, "--devices", "b300:512", "--devices", "b200:512", "--devices", "h100:512")
    assert rc == 0
    b300, b200, h100 = out["plans"]
    assert [p["framework"] for p in out["plans"]] == ["torch"] * 3
    assert b300["memory_total_gib"] == b200["memory_total_gib"] == h100["memory_total_gib"]
    assert b300["step_time_s"] == b200["step_time_s"] == pytest.approx(h100["step_time_s"] * 989 / 2250)
    assert (b300["hbm_gib"], b200["hbm_gib"]) == (pytest.approx(275040 / 1024), pytest.approx(183359 / 1024))


def test_unknown_device_and_indivisible_layout(capsys):
    assert plan_main([str(STAGE1), "--devices", "tpu9:8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown device kind 'tpu9'" in err
    assert len(err.splitlines()) == 1 and "h100, h200, b200, b300" in err
    assert plan_main([str(STAGE1), "--devices", "h100:768"]) == 2
    assert "cannot be split over 768" in capsys.readouterr().err


def test_launchers_dry_run_print_the_exact_commands():
    env = {**os.environ, "NNODES": "16", "NODE_RANK": "3", "MASTER_ADDR": "node0", "GPUS_PER_NODE": "8"}
    gpu = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "launch_gpu.sh"),
            str(STAGE1),
            "--device",
            "h100",
            "--dry-run",
            "--",
            "--optim.lr=2e-4",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert f"olmo-plan {STAGE1} --devices h100:128 --optim.lr=2e-4" in gpu
    assert (
        "torchrun --nnodes 16 --nproc-per-node 8 --node-rank 3 --rdzv-backend c10d --rdzv-endpoint node0:29500" in gpu
    )
    assert f"-m olmo_train_torch {STAGE1} --optim.lr=2e-4" in gpu
    tpu = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "launch_tpu.sh"),
            str(STAGE1),
            "--device",
            "v5p",
            "--devices",
            "128",
            "--tpu-name",
            "slice",
            "--zone",
            "z",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"olmo-plan {STAGE1} --devices v5p:128" in tpu
    assert "tpu-vm ssh slice --zone z --worker=all" in tpu
    assert "olmo-train-jax" in tpu and "--jax.distributed=true" in tpu


STAGE3_7B = ROOT / "recipes" / "olmo3-7b" / "stage3.yaml"
STAGE3_32B = ROOT / "recipes" / "olmo3-32b" / "stage3.yaml"


def _plans(capsys, recipe, *args):
    rc = plan_main([str(recipe), *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)["plans"]


@pytest.mark.parametrize("recipe", [STAGE3_7B, STAGE3_32B])
def test_stage3_with_context_8_on_512_devices(capsys, recipe):
    rc, plans = _plans(capsys, recipe, "--devices", "tpu7x:512", "--devices", "v5p:512", "--devices", "h100:512")
    assert rc == 0
    for p in plans:
        # 64 sequences of 65536: CP=8 leaves 512 / 8 = 64 data-parallel groups of one sequence,
        # 65536 / 8 = 8192 tokens per device (stage 1's share).
        assert (p["context_degree"], p["dp_size"], p["per_device_batch"], p["accumulation_steps"]) == (8, 64, 1, 1)
        assert p["tokens_per_device"] == 8192 and p["fits"]
        assert p["memory_kv_exchange_gib"] > 0
    # JAX keeps the context axis out of the parameter placement: the state is split over fsdp = 64.
    assert plans[0]["shard_group"] == 64


def test_stage3_at_cp8_needs_no_more_than_stage1_plus_the_kv_exchange(capsys):
    """The issue's goal: stage 3 (65,536 tokens, CP=8) per device at most stage 1's (8,192 tokens)
    plus the K/V exchange, by olmo-plan, for both trainers."""
    _, stage3 = _plans(capsys, STAGE3_7B, "--devices", "v5p:512", "--devices", "h100:512")
    _, stage1 = _plans(capsys, STAGE1, "--devices", "v5p:512", "--devices", "h100:512")
    for s3, s1 in zip(stage3, stage1):
        assert s3["memory_total_gib"] <= s1["memory_total_gib"] + s3["memory_kv_exchange_gib"] + 1e-9
    # The K/V exchange of one global layer: 18 bytes x 65536 keys x kv_width 4096 (plan.KV_EXCHANGE_BYTES).
    assert stage3[0]["memory_kv_exchange_gib"] == pytest.approx(18 * 65536 * 4096 / 2**30)


def test_context_degrees_that_cannot_split_are_refused(capsys):
    assert plan_main([str(STAGE3_7B), "--devices", "v5p:512", "--jax.mesh.context=3"]) == 2
    err = capsys.readouterr().err
    assert "jax.mesh" in err or "context degree 3" in err
    assert plan_main([str(STAGE3_7B), "--devices", "h100:512", "--torch.context_parallel=3"]) == 2
    assert "torch.context_parallel=3 does not divide 512" in capsys.readouterr().err


def test_without_context_parallelism_stage3_names_the_context_knob(capsys):
    rc, plans = _plans(capsys, STAGE3_7B, "--devices", "v5p:64", "--jax.mesh.context=1")
    assert rc == 1 and not plans[0]["fits"]
    assert "jax.mesh.context=2" in plans[0]["advice"]


def test_expert_parallelism_splits_the_experts_state_as_each_trainer_places_it(capsys):
    """small-moe-64 (4 MoE layers, d 128, 64 experts of hidden 64) on 64 devices with EP 8. By hand:
    the routed experts are 4 x 64 x 3 x 128 x 64 = 6,291,456 parameters; torch keeps E / 8 of them
    per rank outside FSDP (dense over all 64 ranks), JAX splits them over expert x fsdp = 8 x 8 and
    its expert axis carries data, so the data-parallel size stays 64; 16 bytes of state each."""
    spec = get_preset("small-moe-64")
    routed = 4 * 64 * 3 * 128 * 64
    dense = param_counts(spec).total - routed
    args = ["--model=small-moe-64", "--train.global_batch_tokens=524288"]
    torch_args = [*args, "--torch.activation_checkpointing=false", "--devices", "h100:64"]
    rc, (torch_ep,) = _plans(capsys, STAGE1, *torch_args, "--torch.expert_parallel=8")
    assert rc == 0 and torch_ep["dp_size"] == 64
    assert torch_ep["memory_state_gib"] * 2**30 == pytest.approx(16 * (dense / 64 + routed / 8), rel=1e-12)
    # Without expert parallelism the experts are FSDP-sharded like every other weight.
    rc, (torch_fsdp,) = _plans(capsys, STAGE1, *torch_args)
    assert torch_fsdp["memory_state_gib"] * 2**30 == pytest.approx(16 * (dense + routed) / 64, rel=1e-12)
    rc, (jax,) = _plans(
        capsys,
        STAGE1,
        *args,
        "--jax.mesh.expert=8",
        "--jax.mesh.fsdp=-1",
        "--jax.mesh.data=1",
        "--devices",
        "v5p:64",
    )
    assert rc == 0 and jax["dp_size"] == 64 and jax["shard_group"] == 8
    assert jax["memory_state_gib"] * 2**30 == pytest.approx(16 * (dense / 8 + routed / 64), rel=1e-12)


def test_help_lists_every_device_kind_of_the_peak_table(capsys):
    """--help names the kinds --devices takes (the peak table's keys, read from olmo_model.PEAKS,
    eight of them: three NVIDIA Hopper / Ampere, two Blackwell, three TPU) and where another goes."""
    from olmo_model import PEAKS

    with pytest.raises(SystemExit) as done:
        plan_main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--devices KIND:COUNT" in out
    assert "KIND is one of h100, h200, b200, b300, a100, v5p, v6e, tpu7x" in out
    assert len(PEAKS) == 8 and all(kind in out for kind in PEAKS)
    assert "olmo-plan takes no other peak, so another kind needs its entry added there" in out

"""The dry-run glue both trainers share: its arguments, the planner's figure beside the
measurement, the JSON object and the exit status. The measurements themselves are tested in
each trainer's test_dry_run.py against the sharding's own arithmetic."""

from __future__ import annotations

import json

import pytest

from olmo_model import param_counts
from olmo_run.cli import INPUT_ERRORS, run_cli
from olmo_run.dry_run import DryRunReport, dry_run_target, parse_dry_run_args, print_report
from olmo_run.plan import GIB, make_plan
from olmo_run.recipe import RecipeError, load_recipe

RECIPE = "recipes/olmo3-7b/stage1.yaml"


def test_dry_run_flags_are_taken_out_of_the_overrides():
    rest, dry = parse_dry_run_args(["--train.steps=3", "--dry-run", "--devices", "v5p:512", "--json", "--x=1"])
    assert rest == ["--train.steps=3", "--x=1"]
    assert dry is not None and (dry.device_kind, dry.count, dry.as_json) == ("v5p", 512, True)
    rest, dry = parse_dry_run_args(["--devices=h100:64", "--dry-run"])
    assert rest == [] and dry is not None and (dry.device_kind, dry.count, dry.as_json) == ("h100", 64, False)
    assert parse_dry_run_args(["--train.steps=3"]) == (["--train.steps=3"], None)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dry-run"], "--dry-run needs --devices KIND:COUNT"),
        (["--dry-run", "--devices", "v5p"], "write KIND:COUNT"),
        (["--dry-run", "--devices", "v5p:0"], "write KIND:COUNT"),
        (["--devices", "v5p:8"], "add --dry-run"),
        (["--json"], "add --dry-run"),
        (["--dry-run", "--devices"], "--devices needs KIND:COUNT"),
    ],
)
def test_bad_dry_run_flags_are_one_line_errors(args, message):
    with pytest.raises(RecipeError, match=message):
        parse_dry_run_args(args)


def _report(peak: int, hbm: int = 95 * GIB) -> DryRunReport:
    return DryRunReport(
        framework="jax",
        device_kind="v5p",
        devices=512,
        mesh={"data": 1, "fsdp": 512, "tensor": 1},
        per_device_batch=1,
        accumulation_steps=1,
        peak_bytes_per_device=peak,
        hbm_bytes_per_device=hbm,
        memory_bytes={"arguments": peak // 2, "temporaries": peak - peak // 2},
        compile_seconds=1.5,
        model_flops_per_step=1e15,
        method="test",
    )


def test_report_json_has_the_planner_figure_and_the_exit_status_says_whether_it_fits(capsys):
    recipe = load_recipe(RECIPE, [])
    planner = make_plan(recipe, "v5p", 512, 0.40).memory_total_gib * GIB
    assert print_report(recipe, _report(10 * GIB), as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "devices",
        "ranks",
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
        assert key in out, key
    assert out["fits"] is True and out["peak_bytes_per_device"] == 10 * GIB
    assert out["planner_peak_bytes_per_device"] == int(planner)

    assert print_report(recipe, _report(96 * GIB), as_json=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("does not fit: v5p:512 needs 96.00 GiB per device, HBM is 95.00 GiB")


def test_a_dry_run_target_resolves_the_kind_lets_the_trainer_refuse_it_then_needs_the_sequence_length():
    recipe = load_recipe(RECIPE, ["--train.sequence_length=4096"])
    target = dry_run_target("torch", recipe, "NVIDIA H100 80GB HBM3", 64)
    assert (target.peak.kind, target.seq, target.count, target.spec) == ("h100", 4096, 64, recipe.model_spec())
    report = target.report(
        devices=64,
        mesh={"world": 64},
        per_device_batch=1,
        accumulation_steps=1,
        peak_bytes_per_device=GIB,
        hbm_bytes_per_device=80 * GIB,
        memory_bytes={},
        compile_seconds=1.0,
        method="test",
    )
    assert (report.framework, report.device_kind) == ("torch", "h100")
    # 6 N D for the matmul weights (the blocks and the output head; the embedding lookup is no
    # matmul), plus attention's scores, which add 8% for the 7B's mostly sliding layers at 4096.
    counts = param_counts(recipe.model_spec())
    matmul_params = counts.non_embedding + counts.embedding // 2
    assert report.model_flops_per_step == pytest.approx(6 * matmul_params * recipe.train.global_batch_tokens, rel=0.1)

    def gpus_only(peak):
        raise RecipeError(f"{peak.kind} refused")

    unset = load_recipe(RECIPE, ["--train.sequence_length=null"])
    with pytest.raises(RecipeError, match="v5p refused"):  # the kind first, before the recipe is read
        dry_run_target("torch", unset, "v5p", 8, gpus_only)
    with pytest.raises(RecipeError, match="--dry-run needs train.sequence_length in the recipe"):
        dry_run_target("jax", unset, "v5p", 8)


def test_run_cli_sends_dry_run_to_the_trainers_measurement_and_never_trains(capsys):
    calls = []

    def measure(recipe, kind, count):
        calls.append((recipe.train.sequence_length, kind, count))
        return _report(10 * GIB)

    def train():
        raise AssertionError("a dry run must not train")

    argv = [RECIPE, "--train.sequence_length=4096", "--dry-run", "--devices=v5p:512", "--json"]
    assert run_cli("olmo-train-x", None, argv, train, INPUT_ERRORS, dry_run=lambda: measure) == 0
    assert calls == [(4096, "v5p", 512)]
    assert json.loads(capsys.readouterr().out)["fits"] is True

    assert run_cli("olmo-train-x", None, [RECIPE, "--dry-run"], train, INPUT_ERRORS, dry_run=lambda: measure) == 2
    assert "--dry-run needs --devices" in capsys.readouterr().err


def test_print_recipe_prints_the_resolved_recipe_and_help_lists_the_keys(capsys):
    def train():
        raise AssertionError("--print-recipe must not train")

    argv = ["--print-recipe", RECIPE, "--optim.lr=1e-4"]
    assert run_cli("olmo-train-x", "DOC", argv, train, INPUT_ERRORS) == 0
    printed = capsys.readouterr().out
    assert load_recipe(RECIPE, ["--optim.lr=1e-4"]).to_yaml() == printed
    assert "lr: 0.0001" in printed

    assert run_cli("olmo-train-x", "DOC", ["--help"], train, INPUT_ERRORS) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "DOC"
    assert any(line.startswith("  --checkpoint.every=50  (int)") for line in lines)

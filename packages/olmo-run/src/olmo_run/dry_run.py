"""``--dry-run --devices KIND:COUNT [--json]``: one training step of a recipe, set up for a device
layout this machine does not have, and measured without running it (MaxText's train_compile,
torchtitan's fake-backend validation).

Each trainer measures in its own way and returns a ``DryRunReport``: JAX compiles the real
train step ahead of time for the TPU topology and reads the compiler's per-device memory;
torch builds the model on meta, parallelizes it over a fake process group of COUNT ranks and
tracks rank 0's memory through one step. This module owns what is the same for both: the
arguments, where a dry run starts (``dry_run_target``: the device kind, the trainer's refusal of
kinds it cannot target, the model and sequence length, in that order) and the parts of the report
that follow from it, the planner's estimate beside the measurement, the table, the JSON object and
the exit status (0 fits, 1 does not fit, with the reason on one line).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from olmo_model import DevicePeak, ModelSpec, flops_per_token, resolve_device_kind
from olmo_run.plan import GIB, make_plan, parse_devices
from olmo_run.recipe import Recipe, RecipeError

# The step time the planner's estimate assumes when it sits beside a measurement (olmo-plan's default).
PLANNER_MFU = 0.40


@dataclass(frozen=True)
class DryRunArgs:
    device_kind: str
    count: int
    as_json: bool


@dataclass
class DryRunReport:
    """One step of a recipe on one device layout, as the trainer's tool measured it."""

    framework: str  # "jax" or "torch"
    device_kind: str  # the peak-table key, e.g. "v5p", "h100"
    devices: int  # devices as the framework sees them (torch: ranks; JAX shows a tpu7x chip as 2)
    mesh: dict[str, int]  # axis name -> size, as the trainer would build it
    per_device_batch: int  # sequences per device per micro-batch
    accumulation_steps: int
    peak_bytes_per_device: int
    hbm_bytes_per_device: int
    memory_bytes: dict[str, int]  # the parts of the peak as the tool names them
    compile_seconds: float  # wall time to compile (JAX) or trace and measure (torch) the step
    model_flops_per_step: float  # olmo_model.flops_per_token x global batch tokens
    method: str  # what measured it, in a phrase (tool and topology)
    compiled_flops_per_step: float | None = None  # the compiler's own count, trip counts applied
    estimated_step_seconds: float | None = None  # the compiler's cost model, not a measurement
    estimated_mfu: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak_bytes_per_device <= self.hbm_bytes_per_device


@dataclass(frozen=True)
class DryRunTarget:
    """What a trainer's dry run measures: one step of ``recipe`` on ``count`` devices of ``peak``'s kind."""

    framework: str  # "jax" or "torch"
    recipe: Recipe
    spec: ModelSpec
    seq: int  # train.sequence_length: a dry run reads no data, so the recipe must state it
    peak: DevicePeak
    count: int

    @property
    def model_flops_per_step(self) -> float:
        """``olmo_model.flops_per_token`` x the recipe's global batch tokens."""
        return flops_per_token(self.spec, self.seq) * self.recipe.train.global_batch_tokens

    def report(self, **measured: Any) -> DryRunReport:
        """The trainer's measurement as a ``DryRunReport``, with the fields the target fixes."""
        return DryRunReport(
            framework=self.framework,
            device_kind=self.peak.kind,
            model_flops_per_step=self.model_flops_per_step,
            **measured,
        )


def dry_run_target(
    framework: str,
    recipe: Recipe,
    device_kind: str,
    count: int,
    check_kind: Callable[[DevicePeak], None] | None = None,
) -> DryRunTarget:
    """Where both trainers' dry runs start: the peak entry of ``device_kind``, ``check_kind``'s
    refusal (a ``RecipeError``) of a kind the trainer cannot target, then the recipe's model and
    its sequence length."""
    peak = resolve_device_kind(device_kind)
    if check_kind is not None:
        check_kind(peak)
    spec = recipe.model_spec()
    seq = recipe.train.sequence_length
    if seq is None:
        raise RecipeError("--dry-run needs train.sequence_length in the recipe (a dry run reads no data)")
    return DryRunTarget(framework, recipe, spec, seq, peak, count)


def parse_dry_run_args(args: list[str]) -> tuple[list[str], DryRunArgs | None]:
    """Take ``--dry-run``, ``--devices KIND:COUNT`` (or ``=``) and ``--json`` out of ``args``; the
    rest are recipe overrides. None when ``--dry-run`` is absent (then neither flag may appear)."""
    rest: list[str] = []
    dry = as_json = False
    devices: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--dry-run":
            dry = True
        elif a == "--json":
            as_json = True
        elif a == "--devices":
            if i + 1 == len(args):
                raise RecipeError("--devices needs KIND:COUNT, e.g. --devices v5p:512")
            devices = args[i + 1]
            i += 1
        elif a.startswith("--devices="):
            devices = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if not dry:
        if devices is not None or as_json:
            raise RecipeError("--devices and --json belong to --dry-run; add --dry-run (it trains nothing)")
        return rest, None
    if devices is None:
        raise RecipeError("--dry-run needs --devices KIND:COUNT, e.g. --devices v5p:512 or --devices h100:64")
    kind, count = parse_devices(devices)
    return rest, DryRunArgs(kind, count, as_json)


def planner_peak_bytes(recipe: Recipe, report: DryRunReport) -> int:
    """``olmo-plan``'s per-device estimate for the same recipe, layout and trainer."""
    plan = make_plan(recipe, report.device_kind, report.devices, PLANNER_MFU, report.framework)
    return int(plan.memory_total_gib * GIB)


def report_json(recipe: Recipe, report: DryRunReport) -> dict[str, Any]:
    out = asdict(report)
    out["ranks"] = report.devices
    out["fits"] = report.fits
    out["planner_peak_bytes_per_device"] = planner_peak_bytes(recipe, report)
    return out


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def print_report(recipe: Recipe, report: DryRunReport, as_json: bool) -> int:
    """Print the report (a rich table, or one JSON object on stdout); 0 when it fits, else 1 with
    the reason on one stderr line."""
    data = report_json(recipe, report)
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{report.framework} dry run: {report.device_kind}:{report.devices} ({report.method})")
        table.add_column("")
        table.add_column("value", justify="right")
        rows: list[tuple[str, str]] = [
            ("mesh", " x ".join(f"{k}={v}" for k, v in report.mesh.items())),
            ("per-device batch x accumulation", f"{report.per_device_batch} x {report.accumulation_steps}"),
            *((f"memory: {k} (GiB)", _gib(v)) for k, v in report.memory_bytes.items()),
            ("memory: peak / HBM (GiB)", f"{_gib(report.peak_bytes_per_device)} / {_gib(report.hbm_bytes_per_device)}"),
            ("olmo-plan's estimate (GiB)", _gib(data["planner_peak_bytes_per_device"])),
            ("fits", "yes" if report.fits else "NO"),
            ("model FLOPs per step", f"{report.model_flops_per_step:.3e}"),
        ]
        if report.compiled_flops_per_step is not None:
            rows.append(("compiled FLOPs per step", f"{report.compiled_flops_per_step:.3e}"))
        if report.estimated_step_seconds is not None:
            rows.append(("step time, compiler's estimate", f"{report.estimated_step_seconds:.3f}s"))
        if report.estimated_mfu is not None:
            rows.append(("MFU, compiler's estimate", f"{report.estimated_mfu:.1%}"))
        rows.append(("seconds to measure", f"{report.compile_seconds:.1f}"))
        for label, value in rows:
            table.add_row(label, value)
        console = Console()
        console.print(table)
        for note in report.notes:
            console.print(note)
    if report.fits:
        return 0
    print(
        f"does not fit: {report.device_kind}:{report.devices} needs {_gib(report.peak_bytes_per_device)} GiB per "
        f"device, HBM is {_gib(report.hbm_bytes_per_device)} GiB; shard more (mesh), checkpoint activations, "
        "lower train.micro_batch_size or use more devices",
        file=sys.stderr,
        flush=True,
    )
    return 1

"""The recipe: one YAML schema that drives both trainers.

The same file runs ``olmo-train-jax`` and ``olmo-train-torch``. Everything that changes the
maths (model, data, optimizer, schedule, batch, precision, seed) lives in framework-neutral
sections; framework knobs (mesh axes, remat policy, FSDP options, compile) sit in their own
``jax:`` / ``torch:`` sections and never change the maths.

Overrides on the command line are dotted keys: ``--optim.lr=6e-4 --train.steps=200``;
values are parsed as YAML scalars. An unknown key or a wrong type is a one-line error that
names the key and the fix; so is a recipe file that is missing, a folder, unreadable, not UTF-8,
not YAML (the line), empty, or that gives a key twice (``olmo_model.yamlfile``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from olmo_model.presets import SpecError, load_spec, spec_from_dict
from olmo_model.schedules import CosineSchedule, Schedule
from olmo_model.spec import ModelSpec
from olmo_model.yamlfile import parse_yaml, read_yaml

from .run_dir import RunPath, run_path

DEFAULT_NAME = "default"  # a recipe's name when it gives none (``Recipe.for_framework``)


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the file, the key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataSection(_Section):
    mixture: str = "sample"  # a mixture YAML path, or "sample" for the embedded default
    allow_leakage: bool = False  # start even if held-out data occurs in training (logged loudly)
    allow_fingerprint_mismatch: bool = False  # resume onto a changed mixture (logged loudly)
    prefetch: int = Field(2, ge=0)  # global batches the loader prepares ahead


class OptimSection(_Section):
    lr: float = Field(3e-3, gt=0)  # peak LR of the toy default (Olmo 3 7B stage 1 uses 3e-4)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW (beta1, beta2), as Olmo 3
    eps: float = Field(1e-8, gt=0)  # AdamW epsilon
    weight_decay: float = Field(0.1, ge=0)  # decoupled (AdamW)
    decay_embeddings: bool = False  # Olmo 3: no weight decay on the input embedding
    decay_norms: bool = True  # OLMo-core decays norm weights too; set false to exclude them
    grad_clip: float | None = Field(1.0, gt=0)  # global-norm clipping; null disables
    # fp32 master weights and AdamW moments sharded over data parallel (experts over their
    # expert-data-parallel group); gradients reduce-scattered, weights all-gathered after the step
    sharded: bool = False


class SpikeGuardSection(_Section):
    """Skip an update whose loss or grad norm is far above its recent history (OLMo-core's
    SkipStepAdamW idea): z-score over the last `window` accepted steps."""

    enabled: bool = False  # skip updates whose loss or grad norm spikes
    window: int = Field(128, ge=2)  # accepted steps the statistics come from
    sigma: float = Field(6.0, gt=0)  # skip when value > mean + sigma * std
    min_history: int = Field(20, ge=2)  # never skip before this many accepted steps
    # Stop the run after this many skipped steps in a row: the weights no longer produce sane
    # losses on fresh batches, so skipping more cannot recover and only spends compute.
    max_consecutive_skips: int = Field(10, ge=1)


class TrainSection(_Section):
    sequence_length: int | None = Field(None, gt=0)  # null: the mixture's sequence_length
    global_batch_tokens: int = Field(8192, gt=0)  # tokens per optimizer step, all devices (toy default)
    micro_batch_size: int | None = Field(None, gt=0)  # sequences per device per micro-step; null: no accumulation
    steps: int | None = Field(None, gt=0)  # optimizer steps; or give `tokens`
    tokens: int | None = Field(None, gt=0)  # token budget; steps = ceil(tokens / global_batch_tokens)
    seed: int = 0  # model init and any trainer RNG; the data order has its own seed in the mixture
    precision: Literal["bf16", "fp32"] = "bf16"  # bf16: bf16 compute, fp32 master weights and reductions
    # Mask attention across document boundaries inside an instance. Off by default: the Olmo 3
    # recipe trains on plain causal windows, and a mask forgoes the fused flash path on GPU.
    document_masking: bool = False

    @model_validator(mode="after")
    def _budget(self):
        if (self.steps is None) == (self.tokens is None):
            raise ValueError("give exactly one of train.steps and train.tokens")
        return self


class CheckpointSection(_Section):
    every: int = Field(50, gt=0)  # save after every N optimizer steps (and at the end)
    keep: int = Field(3, gt=0)  # complete checkpoints kept; older ones deleted
    async_save: bool = True  # save in the background where the framework supports it
    resume: bool = True  # resume from the latest complete checkpoint in the run dir
    fallback: bool = False  # newest checkpoint damaged: resume from the newest older one that verifies (loudly)
    # resume although precision/optim/schedule/steps changed (loudly); never a new global batch size
    allow_recipe_change: bool = False
    preempt_timeout_s: float = Field(300.0, gt=0)  # after SIGTERM/SIGINT: exit at once if not ended by then
    preempt_check_every: int = Field(1, gt=0)  # multi-process: steps between agreeing on a stop signal


class InitSection(_Section):
    """Start from another run's checkpoint (a curriculum stage starting from the previous one)."""

    checkpoint: str | None = None  # a checkpoint dir (ours) or hf:DIR
    load_optimizer: bool = False  # also take AdamW moments (and step) from it


class EvalSection(_Section):
    every: int = Field(50, gt=0)  # held-out evaluation every N steps (and at the end)
    batch_size: int = Field(8, gt=0)  # sequences per evaluation forward


class MoESection(_Section):
    """Mixture-of-experts run modes (used only when the model spec has `moe`)."""

    routing: Literal["learned", "random", "uniform"] = "learned"  # random/uniform: systems benchmarks
    mxfp8: bool = False  # emulated MXFP8 (e4m3 + e8m0 per 32) for the expert GEMMs
    # Assignments one sequence sends to one expert: min(S, ceil(factor x S x top_k / experts));
    # the later tokens' are dropped (olmo_model.moe.capacity_keep), the same in every layout. null: dropless.
    capacity_factor: float | None = Field(None, gt=0)


class WandbSection(_Section):
    """The Weights & Biases run (``log.sinks: [wandb]``)."""

    project: str = "olmo"  # W&B project
    entity: str | None = None  # W&B team or user; null: the account's default
    name: str | None = None  # run name; null: the recipe's name
    group: str | None = None  # groups runs in the W&B UI (e.g. one per recipe sweep)
    tags: list[str] = Field(default_factory=list)  # W&B run tags
    mode: Literal["online", "offline"] = "online"  # offline: written under the run dir, `wandb sync` uploads it


class LogSection(_Section):
    every: int = Field(1, gt=0)  # metrics line every N steps
    progress: bool = True  # progress bar on a terminal
    sinks: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)  # besides metrics.jsonl (always)
    wandb: WandbSection = WandbSection()


class ProfileSection(_Section):
    """A trace of chosen steps (jax.profiler / torch.profiler), written under <run dir>/profile."""

    start_step: int | None = Field(None, gt=0)  # first traced optimizer step; null: no trace
    steps: int = Field(3, gt=0)  # steps traced from start_step on


class JaxSection(_Section):
    """JAX-only knobs: never change the maths."""

    # Device mesh axis sizes (data, fsdp, context, tensor, expert); -1 takes the devices left.
    mesh: dict[str, int] = Field(default_factory=lambda: {"data": -1, "fsdp": 1, "tensor": 1})
    remat: Literal["none", "block", "save_dots"] = "none"  # recompute in backward: none, block, save_dots
    # auto: cuDNN's fused flash attention on GPU (bf16, no document masking), XLA elsewhere
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    # MoE grouped GEMM: auto (tiled on CPU, Mosaic GPU kernels on Hopper, ragged_dot on TPU), or one of them
    moe_gemm: Literal["auto", "ragged", "tiled", "mgpu"] = "auto"
    distributed: bool = False  # join a multi-process job (TPU VM / Slurm detected); implied by the three keys below
    coordinator_address: str | None = None  # HOST:PORT of process 0; null: $JAX_COORDINATOR_ADDRESS or detected
    num_processes: int | None = Field(None, gt=0)  # processes in the job; null: $JAX_NUM_PROCESSES or detected
    process_id: int | None = Field(None, ge=0)  # this process's index; null: $JAX_PROCESS_ID or detected
    heartbeat_timeout_seconds: int = Field(100, gt=0)  # a process silent this long is dead: all the others exit

    @field_validator("mesh")
    @classmethod
    def _mesh(cls, v: dict[str, int]) -> dict[str, int]:
        unknown = set(v) - {"data", "fsdp", "context", "tensor", "expert"}
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; use data, fsdp, context, tensor, expert")
        if sum(1 for x in v.values() if x == -1) > 1:
            raise ValueError("at most one mesh axis may be -1 (all remaining devices)")
        return v


class TorchSection(_Section):
    """Torch-only knobs: never change the maths."""

    parallel: Literal["fsdp", "hsdp", "ddp", "none"] = "fsdp"  # how parameters and gradients are split over ranks
    replicate: int = Field(1, gt=0)  # HSDP replicate groups (shard size = world / replicate)
    compile: bool = False  # torch.compile each block
    activation_checkpointing: bool = False  # per block
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on GPU, gloo on CPU
    expert_parallel: int = Field(1, gt=0)  # ranks the routed experts are split over (MoE only)
    context_parallel: int = Field(1, gt=0)  # ranks one sequence is split over (zigzag); 1: none


class Recipe(_Section):
    name: str = DEFAULT_NAME  # names the run dir unless run_dir is given
    # Default: runs/<name>, in either trainer, so that a curriculum stage's init.checkpoint
    # (runs/<previous stage>/checkpoints/latest) names the previous stage's run whichever trainer
    # ran it; the default name's is runs/default-<framework>, one per trainer, so that the
    # README's olmo-train-jax then olmo-train-torch make two fresh runs, not one the other refuses.
    run_dir: str | None = None
    model: str | dict[str, Any] = "small"  # a preset name, a spec file, or a dict of spec fields
    data: DataSection = DataSection()
    optim: OptimSection = OptimSection()
    schedule: Schedule = CosineSchedule(warmup_steps=10, alpha=0.1)  # Olmo 3 stage 1: warmup 2000
    train: TrainSection = TrainSection(steps=100)
    spike_guard: SpikeGuardSection = SpikeGuardSection()
    checkpoint: CheckpointSection = CheckpointSection()
    init: InitSection = InitSection()
    eval: EvalSection = EvalSection()
    moe: MoESection = MoESection()
    log: LogSection = LogSection()
    profile: ProfileSection = ProfileSection()
    jax: JaxSection = JaxSection()
    torch: TorchSection = TorchSection()

    # ---- derived ----------------------------------------------------------------------
    def model_spec(self) -> ModelSpec:
        if isinstance(self.model, str):
            return load_spec(self.model)
        return spec_from_dict(self.model, source="recipe model")

    def sequence_length(self, mixture_sequence_length: int) -> int:
        return self.train.sequence_length or mixture_sequence_length

    def global_batch_sequences(self, sequence_length: int) -> int:
        if self.train.global_batch_tokens % sequence_length:
            raise RecipeError(
                f"train.global_batch_tokens={self.train.global_batch_tokens} is not a multiple of the "
                f"sequence length {sequence_length}; set it to a multiple of {sequence_length}"
            )
        return self.train.global_batch_tokens // sequence_length

    def total_steps(self) -> int:
        if self.train.steps is not None:
            return self.train.steps
        assert self.train.tokens is not None
        return -(-self.train.tokens // self.train.global_batch_tokens)

    def for_framework(self, framework: str) -> Recipe:
        """This recipe as ``framework``'s trainer runs it: with the default name and no run_dir,
        run_dir is runs/default-<framework> (each trainer its own default run); else unchanged."""
        if self.run_dir or self.name != DEFAULT_NAME:
            return self
        return self.model_copy(update={"run_dir": f"runs/{DEFAULT_NAME}-{framework}"})

    def resolved_run_dir(self) -> RunPath:
        """The run dir: a local Path, or an `olmo_data.fileio.URLPath` for gs:// and s3:// (contract 8)."""
        if not self.run_dir:
            return Path("runs") / self.name
        try:
            return run_path(self.run_dir)
        except ValueError as err:
            raise RecipeError(f"run_dir={self.run_dir}: {err}") from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---- batch layout -----------------------------------------------------------------------


class BatchLayout(BaseModel):
    model_config = ConfigDict(frozen=True)
    global_batch: int  # sequences per optimizer step
    dp_size: int  # data-parallel ranks the batch is split over
    per_device_batch: int  # sequences per rank per micro-step
    accumulation_steps: int  # micro-steps per optimizer step

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch} = {self.per_device_batch} per device x "
            f"{self.dp_size} data-parallel x {self.accumulation_steps} accumulation"
        )


def batch_layout(global_batch: int, dp_size: int, micro_batch_size: int | None = None) -> BatchLayout:
    """Split a global batch of sequences over data-parallel ranks and accumulation steps.

    The global batch never changes with the device count: per-device batch and accumulation
    are derived, and a combination that does not divide is refused."""
    if dp_size <= 0 or global_batch % dp_size:
        raise RecipeError(
            f"a global batch of {global_batch} sequences cannot be split over {dp_size} data-parallel "
            f"ranks; use a device count that divides {global_batch}, or change train.global_batch_tokens"
        )
    per_rank = global_batch // dp_size
    if micro_batch_size is None:
        return BatchLayout(global_batch=global_batch, dp_size=dp_size, per_device_batch=per_rank, accumulation_steps=1)
    micro = min(micro_batch_size, per_rank)
    if per_rank % micro:
        raise RecipeError(
            f"train.micro_batch_size={micro_batch_size} does not divide the {per_rank} sequences each of "
            f"{dp_size} ranks gets; choose a divisor of {per_rank}"
        )
    return BatchLayout(
        global_batch=global_batch, dp_size=dp_size, per_device_batch=micro, accumulation_steps=per_rank // micro
    )


# ---- loading and overrides ----------------------------------------------------------------


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node: Any = tree
    fields: dict[str, Any] | None = dict(Recipe.model_fields)  # None: under a non-section field, keys unchecked
    for depth, key in enumerate(keys):
        if fields is not None and key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean '{'.'.join(keys[:depth] + [close[0]])}'?" if close else ""
            where = ".".join(keys[: depth + 1])
            raise RecipeError(f"{source}: unknown recipe key '{where}'{hint}")
        annotation = fields[key].annotation if fields is not None else None
        sub = getattr(annotation, "model_fields", None)
        if depth == len(keys) - 1:
            node[key] = value
            return
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
        fields = dict(sub) if sub is not None else None


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """``--a.b=value`` / ``--a.b value`` pairs; values parsed as YAML scalars."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise RecipeError(f"unexpected argument '{arg}'; overrides look like --optim.lr=6e-4")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        else:
            # The next argument is the value, unless it is another override: `--run_dir --x=1`
            # would otherwise set run_dir to "--x=1".
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise RecipeError(f"command line: override '{arg}' has no value; write --{body}=VALUE")
            key, raw = body, args[i + 1]
            i += 1
        fix = "fix its syntax, or put a string value in YAML quotes (--key=\"'...'\")"
        out.append((key, parse_yaml(raw, f"command line: override --{key}={raw}", RecipeError, fix) if raw else None))
        i += 1
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; a schedule of another kind replaces the base schedule whole, and a
    token budget replaces a default step budget (and the other way round)."""
    out = dict(base)
    for key, value in top.items():
        if key == "model" and isinstance(value, dict) and isinstance(out.get(key), str):
            out[key] = {"preset": out[key]}
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            if "kind" in value and value["kind"] != out[key].get("kind"):
                out[key] = dict(value)
                continue
            merged = _merge(out[key], value)
            if key == "train" and value.get("tokens") is not None and "steps" not in value:
                merged["steps"] = None
            if key == "train" and value.get("steps") is not None and "tokens" not in value:
                merged["tokens"] = None
            out[key] = merged
        else:
            out[key] = value
    return out


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe YAML over the defaults (or the defaults alone when path is None) and apply
    dotted command-line overrides."""
    source = str(path) if path is not None else "default recipe"
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        loaded = read_yaml(p, RecipeError, "recipe file")
        if loaded is None:
            # An empty file is most likely a mistake (a failed write, the wrong file): running
            # the defaults instead would hide it.
            raise RecipeError(
                f"{p}: the recipe file holds no keys (empty, or comments only); write its sections (model, data, ...), "
                "or name no recipe to run the defaults"
            )
        if not isinstance(loaded, dict):
            raise RecipeError(
                f"{p}: a recipe must be a mapping of sections (model, data, optim, ...), "
                f"not a {type(loaded).__name__}; see `--help` for the keys"
            )
        for key in loaded:
            if key not in Recipe.model_fields:
                _set_dotted({}, key, None, source)  # raises the unknown-key error with a hint
        tree = loaded
        mixture = (tree.get("data") or {}).get("mixture")
        if (
            isinstance(mixture, str)
            and mixture != "sample"
            and "://" not in mixture
            and not Path(mixture).is_absolute()
        ):
            # a mixture named in a recipe file is relative to that file, like paths in a mixture
            tree = {**tree, "data": {**tree["data"], "mixture": str((p.parent / mixture).resolve())}}
    over: dict[str, Any] = {}
    for key, value in parse_overrides(overrides or []):
        _set_dotted(over, key, value, "command line")
    defaults = Recipe().model_dump(mode="json")
    return recipe_from_dict(_merge(_merge(defaults, tree), over), source, over)


def _given(tree: dict[str, Any], loc: tuple[Any, ...]) -> bool:
    """Whether the nested dict ``tree`` holds the key path ``loc``."""
    node: Any = tree
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def recipe_from_dict(tree: dict[str, Any], source: str = "recipe", overrides: dict[str, Any] | None = None) -> Recipe:
    """Validate a recipe tree; an error names ``source``, or the command line where the bad key
    came from ``overrides``."""
    try:
        recipe = Recipe.model_validate(tree)
    except ValidationError as err:
        first = err.errors()[0]
        if overrides and _given(overrides, first["loc"]):
            source = "command line"
        loc = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            raise RecipeError(f"{source}: unknown recipe key '{loc}'; remove it or check the spelling") from None
        raise RecipeError(f"{source}: key '{loc}': {msg} (got {first.get('input')!r})") from None
    try:
        recipe.model_spec()
    except SpecError as err:
        raise RecipeError(f"{source}: model: {err}") from None
    return recipe

"""OLMo-core's own Olmo 3 model timed through a full train step; prints one JSON line.

Runs inside the isolated OLMo-core env (ai2-olmo-core pins torch <2.14, so it cannot join
this workspace). packages/olmo-train-torch/bench/bench_train.py starts it as

    uv run --isolated --no-project --python 3.11 --with ai2-olmo-core \
        python tools/bench/olmo_core/train_peer.py --spec SPEC.json --param-total N \
        --batches BATCHES.npy --modes eager compile

SPEC.json is ``olmo_model.ModelSpec.model_dump_json()``; N is ``olmo_model.param_counts(spec).total``
(the built model must have exactly that many parameters); BATCHES.npy holds the benchmark's
token batches, int32 (steps, batch, sequence + 1), so both sides train on the same tokens.
The model is peer_model.build (OLMo-core's ``TransformerConfig.olmo3_*`` where it names the
shape, SDPA attention). The step is the one OLMo-core's Olmo 3 recipes run
(olmo_core/internal/cookbook.py): forward with labels and ``z_loss_multiplier=1e-5`` (CE +
z-loss fused in its LM head), backward, ``clip_grad_norm_`` to 1.0, ``SkipStepAdamW``
(betas 0.9/0.95, weight decay 0.1 except embeddings, foreach) fed the CE loss and grad
norm as its train module does. ``compile`` applies OLMo-core's own ``apply_compile``
(``torch.compile`` per block and on the LM head), as its recipes do by default.

By default (``--device cpu --precision fp32``) that is all: one process, no process group,
fp32 parameters and compute. ``--device cuda`` or ``--precision bf16`` runs the model the
way OLMo-core's train module (``TransformerTrainModule`` + ``parallelize_model``) runs it
under ``torchrun --nproc-per-node 1``: a one-process group from OLMo-core's
``init_distributed`` (NCCL for CUDA tensors, gloo on CPU; MASTER_ADDR, a free MASTER_PORT,
RANK=0 and WORLD_SIZE=1 filled in where unset), the model built on the meta device, then
``apply_compile`` (mode compile), ``apply_fsdp`` (FSDP2 over the one-rank data-parallel mesh,
``param_dtype`` bf16 with ``--precision bf16``, ``reduce_dtype`` fp32, as the recipes'
``TransformerDataParallelConfig``) and ``init_weights`` on the device; the grad norm is
computed and clipped as its train module's ``_clip_grad_norm`` does (DTensor-aware). On CUDA
the attention backend is OLMo-core's default for its olmo3 configs (flash-attn 2) when
``flash_attn`` imports, else torch SDPA; ``config`` in the JSON says which. Steps are timed
with ``torch.cuda.synchronize()`` before each clock read. ``--max-seconds`` bounds each mode:
once that much wall time has passed since the mode started (model build included), it stops
after the current step (the first step and one timed step always run).

cached_path, which OLMo-core imports at import time, imports boto3/botocore and
google-cloud-storage at its own import time. Where those are not installed (the GPU machine
has no network and neither SDK, and botocore alone is ~17 MB of wheel) this script puts
placeholder modules in their place before importing OLMo-core; nothing here reads remote
paths, and any use of a placeholder raises. In a full env (uv --with ai2-olmo-core) the real
SDKs import and nothing is stubbed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import time
import types
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

# What cached_path's schemes (s3, r2, gs) import at module level.
_CLOUD_SDKS = ("boto3", "botocore", "google.api_core", "google.auth", "google.cloud.storage")


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a missing parent package, or a broken one
        return True


class _UnavailableMeta(type):
    def __getattr__(cls, attr: str):  # ``storage.Client`` where ``storage`` is a placeholder
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(cls.__module__, f"{cls.__qualname__}.{attr}")


class _Unavailable(Exception, metaclass=_UnavailableMeta):
    """Base of every placeholder attribute: usable in ``except`` tuples, as a base class, as a
    default value and in annotations, and raises the moment anything instantiates or calls it."""

    def __init__(self, *args, **kwargs):
        raise ModuleNotFoundError(
            f"{type(self).__module__} is not installed; train_peer.py put a placeholder "
            "module in its place so that cached_path (an OLMo-core dependency) imports"
        )


def _placeholder(module: str, qualname: str) -> type:
    return _UnavailableMeta(
        qualname.rsplit(".", 1)[-1], (_Unavailable,), {"__module__": module, "__qualname__": qualname}
    )


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _placeholder(self.__name__, attr)
        setattr(self, attr, value)
        return value


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if any(name == root or name.startswith(root + ".") for root in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module):
        pass


def _stub_missing_cloud_sdks() -> list[str]:
    """Placeholder modules for the cloud SDKs cached_path imports and this env lacks (each the
    highest missing package above the module, e.g. ``google.cloud``); the names stubbed."""
    roots: list[str] = []
    for name in _CLOUD_SDKS:
        if not _missing(name):
            continue
        parts = name.split(".")
        root = next(".".join(parts[:i]) for i in range(1, len(parts) + 1) if _missing(".".join(parts[:i])))
        if root not in roots:
            roots.append(root)
    if roots:
        finder = _PlaceholderFinder(tuple(roots))
        sys.meta_path.insert(0, finder)
        try:
            importlib.import_module("cached_path.schemes")  # cached_path and all its schemes
        finally:
            sys.meta_path.remove(finder)  # the imported placeholders stay in sys.modules
        print(
            f"train_peer: not installed, replaced by placeholders for cached_path: {', '.join(roots)}", file=sys.stderr
        )
    return roots


_stub_missing_cloud_sdks()

from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig  # noqa: E402  (after the SDK stubs)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_model  # noqa: E402  (a sibling file, not an installed package)


def build_optim(model: torch.nn.Module, lr: float):
    return SkipStepAdamWConfig(
        lr=lr,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        foreach=True,
        group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts=dict(weight_decay=0.0))],
    ).build(model)


def run_steps(step, batches: np.ndarray, sync, max_seconds: float | None, started: float) -> dict:
    """Time ``step`` over the batches (the first apart); ``sync`` waits for the device before
    each clock read; stops once ``max_seconds`` have passed since ``started``."""
    sync()
    t0 = time.perf_counter()
    first_loss = float(step(batches[0]))
    sync()
    first = time.perf_counter() - t0
    times: list[float] = []
    stopped_early = False
    for i, tokens in enumerate(batches[1:]):
        if max_seconds is not None and i >= 1 and time.perf_counter() - started >= max_seconds:
            stopped_early = True
            break
        t0 = time.perf_counter()
        step(tokens)
        sync()
        times.append(time.perf_counter() - t0)
    out = {"first_step_s": first, "step_times": times, "first_ce_loss": first_loss}
    if max_seconds is not None:
        out["stopped_early"] = stopped_early
    return out


def time_mode(
    spec: dict, param_total: int, batches: np.ndarray, compile_blocks: bool, lr: float, max_seconds: float | None = None
) -> dict:
    """The CPU fp32 path: one process, no process group (the default)."""
    started = time.perf_counter()
    model, how = peer_model.build(spec, param_total, seed=0)
    model.train()
    if compile_blocks:
        model.apply_compile()
    optim = build_optim(model, lr)
    z_loss = spec["z_loss_weight"]

    def step(tokens: np.ndarray) -> torch.Tensor:
        ids = torch.from_numpy(tokens[:, :-1]).long()
        labels = torch.from_numpy(tokens[:, 1:]).long()  # next-token labels, as OLMo-core's get_labels
        out = model(ids, labels=labels, z_loss_multiplier=z_loss)
        out.loss.backward()
        optim.latest_loss = out.ce_loss.detach()
        optim.latest_grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return out.ce_loss.detach()

    result = run_steps(step, batches, lambda: None, max_seconds, started)
    return {**result, "config": how}


def init_process_group(device: torch.device) -> str:
    """One-process group the way OLMo-core's prepare_training_environment makes it (its
    ``init_distributed`` fills in RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/a free MASTER_PORT
    where unset, and sets the CUDA device); the backend string."""
    import torch.distributed as dist
    from olmo_core.distributed.utils import init_distributed

    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        init_distributed(backend=backend)
    return backend


def attention_backend(device: torch.device):
    """OLMo-core's default for its olmo3 configs (flash-attn 2) on CUDA when flash_attn imports,
    else torch SDPA; (backend, why)."""
    from olmo_core.nn.attention.backend import AttentionBackendName

    if device.type != "cuda":
        return AttentionBackendName.torch, "SDPA (not CUDA)"
    if importlib.util.find_spec("flash_attn") is not None:
        return AttentionBackendName.flash_2, "flash-attn 2 (OLMo-core's default for olmo3)"
    return AttentionBackendName.torch, "SDPA (flash_attn not importable; OLMo-core's default would be flash_2)"


def time_mode_parallel(
    spec: dict,
    param_total: int,
    batches: np.ndarray,
    compile_blocks: bool,
    lr: float,
    device: torch.device,
    precision: str,
    max_seconds: float | None,
) -> dict:
    """The train-module path: FSDP2 over a one-rank mesh, bf16 (or fp32) params, fp32 reduce."""
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import (
        DataParallelConfig,
        DataParallelType,
        build_world_mesh,
        get_dp_model_mesh,
        get_world_mesh,
    )
    from torch.distributed.tensor import DTensor

    started = time.perf_counter()
    backend_pg = init_process_group(device)
    config, how = peer_model.olmo3_config(spec)
    attn, attn_why = attention_backend(device)
    blocks = config.block.values() if isinstance(config.block, dict) else [config.block]
    for block in [*blocks, *(getattr(config, "block_overrides", None) or {}).values()]:
        block.sequence_mixer.backend = attn
    how = how.replace("attn_backend='torch'", f"attn_backend='{attn.value}'")

    torch.manual_seed(0)
    model = config.build(init_device="meta")
    peer_model.check_matches(model, spec, param_total)  # shapes only: meta tensors have no values
    if compile_blocks:
        model.apply_compile()
    # The recipes' TransformerDataParallelConfig with FSDP in place of HSDP (one rank); its
    # wrapping_strategy (full) and prefetch_factor (0) defaults are apply_fsdp's defaults.
    dp_config = DataParallelConfig(
        name=DataParallelType.fsdp,
        param_dtype=DType.bfloat16 if precision == "bf16" else None,
        reduce_dtype=DType.float32,
    )
    # Built once per process (OLMo-core allows one); later modes reuse it.
    world_mesh = get_world_mesh() or build_world_mesh(dp=dp_config, device_type=device.type)
    model.apply_fsdp(
        dp_mesh=get_dp_model_mesh(world_mesh),
        param_dtype=dp_config.param_dtype.as_pt() if dp_config.param_dtype is not None else None,
        reduce_dtype=dp_config.reduce_dtype.as_pt(),
    )
    seq = batches.shape[2] - 1
    model.init_weights(
        max_seq_len=seq, max_local_microbatch_size=batches.shape[1] * seq, device=device, world_mesh=world_mesh
    )
    model.train()
    optim = build_optim(model, lr)
    z_loss = spec["z_loss_weight"]
    params = list(model.parameters())

    def clip_grad_norm(max_norm: float) -> torch.Tensor:  # TransformerTrainModule._clip_grad_norm
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def step(tokens: np.ndarray) -> torch.Tensor:
        batch = torch.from_numpy(tokens).to(device, non_blocking=True).long()
        ids, labels = batch[:, :-1], batch[:, 1:]  # next-token labels, as OLMo-core's get_labels
        out = model(ids, labels=labels, z_loss_multiplier=z_loss)
        out.loss.backward()
        optim.latest_loss = out.ce_loss.detach()
        optim.latest_grad_norm = clip_grad_norm(1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return out.ce_loss.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        sync = torch.cuda.synchronize
    else:

        def sync() -> None:
            pass

    result = run_steps(step, batches, sync, max_seconds, started)
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    param_dtype = "bf16" if precision == "bf16" else "fp32"
    result["config"] = (
        f"{how}; attention {attn_why}; FSDP2 (apply_fsdp) over 1 rank ({backend_pg}), "
        f"param_dtype {param_dtype}, reduce_dtype fp32; meta build, init_weights on {device.type}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="ModelSpec JSON file")
    parser.add_argument("--param-total", type=int, required=True, help="olmo_model.param_counts(spec).total")
    parser.add_argument("--batches", required=True, help=".npy int32 (steps, batch, sequence + 1)")
    parser.add_argument("--modes", nargs="+", choices=("eager", "compile"), default=["eager", "compile"])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda (or --precision bf16) runs OLMo-core's FSDP train-module path in a 1-process group",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: FSDP param_dtype bf16, reduce_dtype fp32 (OLMo-core's recipes)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="per mode: stop timing once this much wall time has passed since the mode started",
    )
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    batches = np.load(args.batches)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_peer: --device cuda but torch.cuda.is_available() is False")
    parallel = device.type == "cuda" or args.precision == "bf16"
    results = {}
    for mode in args.modes:
        if parallel:
            results[mode] = time_mode_parallel(
                spec, args.param_total, batches, mode == "compile", args.lr, device, args.precision, args.max_seconds
            )
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            results[mode] = time_mode(spec, args.param_total, batches, mode == "compile", args.lr, args.max_seconds)
    print(
        json.dumps(
            {
                "olmo_core": version("ai2-olmo-core"),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "precision": args.precision,
                "modes": results,
            }
        )
    )
    if parallel:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

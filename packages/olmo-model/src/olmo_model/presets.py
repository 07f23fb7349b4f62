"""Named model sizes as data. Shapes are OLMo-core 3.0.0's olmo3 presets (docs/design.md) and
OLMo-core 3's OLMoE3 MoE configurations (olmoe3-*, from its src/examples/olmo_ddp scripts);
the tiny ones exist for tests (2-4 layers, d_model 64-128, a window shorter than the
test sequences so both attention kinds are exercised)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .spec import ModelSpec

_OLMO3: dict[str, dict[str, Any]] = {
    "olmo3-14m": dict(d_model=128, n_layers=4, n_heads=8, mlp_hidden=512),
    "olmo3-30m": dict(d_model=256, n_layers=4, n_heads=8, mlp_hidden=768),
    "olmo3-60m": dict(d_model=384, n_layers=8, n_heads=8, mlp_hidden=1536),
    "olmo3-190m": dict(d_model=768, n_layers=12, n_heads=12, mlp_hidden=3072),
    "olmo3-1b": dict(d_model=2048, n_layers=16, n_heads=16, mlp_hidden=8192),
    "olmo3-7b": dict(d_model=4096, n_layers=32, n_heads=32, mlp_hidden=11008),
    # Co-design variant of the first report: 16 heads x head_dim 256 fills a 256x256
    # matrix unit; same parameter count and FLOPs as 32 x 128.
    "olmo3-7b-h16": dict(d_model=4096, n_layers=32, n_heads=16, mlp_hidden=11008),
    "olmo3-32b": dict(d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8, mlp_hidden=27648),
}

# Tiny specs for tests and the default toy run: small vocab so that the embedded
# sample tokenizer (vocab 4096) fits; a window of 32 so sequences >= 64 use both kinds.
_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=4096,
    padded_vocab_size=4096,
    eos_token_id=0,
    pad_token_id=1,
    sliding_window=32,
    max_position_embeddings=4096,
)
_TINY: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layers=4, n_heads=4, mlp_hidden=192, **_TINY_COMMON),
    "tiny-gqa": dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=192, **_TINY_COMMON),
    "tiny-yarn": dict(
        d_model=64,
        n_layers=4,
        n_heads=4,
        mlp_hidden=192,
        yarn=dict(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0),
        **{**_TINY_COMMON, "sliding_window": 16},
    ),
    "small": dict(d_model=128, n_layers=4, n_heads=4, mlp_hidden=384, **_TINY_COMMON),
    "tiny-moe": dict(
        d_model=64,
        n_layers=4,
        n_heads=4,
        mlp_hidden=192,
        moe=dict(n_experts=8, top_k=4, expert_hidden=64, n_shared_experts=1),
        **_TINY_COMMON,
    ),
    # Every MoE option off its default (sigmoid router, renormalised top-k, two shared experts of
    # another width, both aux losses weighted), 2 layers: the MoE tests' second configuration.
    "tiny-moe-sigmoid": dict(
        d_model=64,
        n_layers=2,
        n_heads=4,
        mlp_hidden=192,
        moe=dict(
            n_experts=8,
            top_k=3,
            expert_hidden=32,
            n_shared_experts=2,
            shared_expert_hidden=48,
            gating="sigmoid",
            normalize_top_k=True,
            load_balancing_loss_weight=0.05,
            router_z_loss_weight=0.01,
        ),
        **_TINY_COMMON,
    ),
    "small-moe-64": dict(
        d_model=128,
        n_layers=4,
        n_heads=4,
        mlp_hidden=384,
        moe=dict(n_experts=64, top_k=4, expert_hidden=64, n_shared_experts=1),
        **_TINY_COMMON,
    ),
}


def _olmoe3(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    n_experts: int,
    hidden: int,
    n_dense: int,
    lb_loss: float,
    router_z_loss: float = 2e-4,
    peri_norm: bool = True,
) -> dict[str, Any]:
    """One of OLMo-core 3's OLMoE3 models (src/examples/olmo_ddp/, branch olmo-ddp): top-4 of
    n_experts SwiGLU experts of width ``hidden`` plus one shared expert of the same width; the
    first ``n_dense`` blocks dense, OLMo-core's shared-expert-only blocks of hidden
    top_k * hidden + hidden; head_dim 128 (so n_heads * 128 may differ from d_model); QK-norm
    per head; RoPE theta 500000 on every layer, no sliding window; softmax router whose top-k
    weights are renormalised and scaled back by k; init std 0.01; z-loss 1e-4 (the train
    module's z_loss_multiplier); peri-norm blocks (``use_peri_norm``: an input RMSNorm on attention and
    on the MLP besides the two output norms) unless ``peri_norm`` is false (the reordered norms
    alone); the embedding times sqrt(d_model), then RMS-normalised (``embed_scale``,
    ``embedding_norm``). Vocab 100278 padded to 100352, RMSNorm eps 1e-6 (the defaults)."""
    top_k = 4
    return dict(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=128,
        mlp_hidden=top_k * hidden + hidden,
        qk_norm="per_head",
        norm_placement="peri" if peri_norm else "reordered",
        embedding_scale=math.sqrt(d_model),
        embedding_norm=True,
        sliding_window=None,
        init_std=0.01,
        z_loss_weight=1e-4,
        moe=dict(
            n_experts=n_experts,
            top_k=top_k,
            expert_hidden=hidden,
            n_shared_experts=1,
            gating="softmax",
            normalize_top_k=True,
            restore_weight_scale=True,
            load_balancing_loss_weight=lb_loss,
            router_z_loss_weight=router_z_loss,
            layers=tuple(range(n_dense, n_layers)),
        ),
    )


# OLMo-core 3's reference configurations, pinned by its src/test/examples/olmo_ddp_tech_report_test.py
# (active / total parameters in tests/test_olmoe3_presets.py, exactly OLMo-core 3.0.0's own counts).
# Every script's model embeds, scales by sqrt(d_model) and RMS-normalises; the OLMoE3-dev scripts'
# blocks, dense leading ones included, are peri-norm, the benchmark's reordered-norm.
_OLMOE3: dict[str, dict[str, Any]] = {
    # OLMoE3-dev-t001.py (Tiny-64E). OLMoE3-dev-t002.py is the same model at EP 8 (no separate preset).
    "olmoe3-t001": _olmoe3(
        d_model=2048, n_layers=16, n_heads=16, n_kv_heads=4, n_experts=64, hidden=2048, n_dense=1, lb_loss=0.01
    ),
    # OLMoE3-dev-s001.py (Small-64E; s001-random.py: the same model with random routing).
    "olmoe3-s001": _olmoe3(
        d_model=2560, n_layers=32, n_heads=24, n_kv_heads=6, n_experts=64, hidden=2560, n_dense=1, lb_loss=0.005
    ),
    # OLMoE3-dev-m001.py (Medium): 40 layers less the last pipeline stage's one.
    "olmoe3-m001": _olmoe3(
        d_model=3072, n_layers=39, n_heads=32, n_kv_heads=8, n_experts=96, hidden=3072, n_dense=2, lb_loss=0.005
    ),
    # OLMoE3-dev-m002.py (Medium-128E).
    "olmoe3-m002": _olmoe3(
        d_model=3072, n_layers=39, n_heads=32, n_kv_heads=8, n_experts=128, hidden=3072, n_dense=2, lb_loss=0.005
    ),
    # OLMoE3-dev-l001.py (Large-128E): 48 layers less one.
    "olmoe3-l001": _olmoe3(
        d_model=4096, n_layers=47, n_heads=40, n_kv_heads=10, n_experts=128, hidden=4096, n_dense=2, lb_loss=0.005
    ),
    # OLMoE3-dev-u001.py (Ultra-128E; trained in MXFP8 with per-layer recompute): 64 layers less one.
    "olmoe3-u001": _olmoe3(
        d_model=6144, n_layers=63, n_heads=64, n_kv_heads=32, n_experts=128, hidden=8192, n_dense=2, lb_loss=0.005
    ),
    # OLMoE3-dev-u002.py (Ultra-256E).
    "olmoe3-u002": _olmoe3(
        d_model=6144, n_layers=63, n_heads=64, n_kv_heads=32, n_experts=256, hidden=8192, n_dense=2, lb_loss=0.005
    ),
    # The expert-pool benchmark, moe_8l_common.py / moe_8l_ddp.py (TECH_REPORT_NUM_EXPERTS 8, 32, 64,
    # 128): 8 layers, the first dense; its blocks are reordered-norm (use_peri_norm=False there),
    # its embedding scaled and normalised as the OLMoE3-dev scripts'.
    **{
        f"olmoe3-bench-e{n}": _olmoe3(
            d_model=4096,
            n_layers=8,
            n_heads=32,
            n_kv_heads=8,
            n_experts=n,
            hidden=4096,
            n_dense=1,
            lb_loss=0.015,
            router_z_loss=1e-4,
            peri_norm=False,
        )
        for n in (8, 32, 64, 128)
    },
}

# olmoe3-t001 at test size for the twins: its features exactly (one dense leading block of hidden
# top_k * hidden + hidden, GQA 4:1, per-head QK-norm, peri-norm blocks, the embedding times
# sqrt(d_model) and RMS-normalised, full attention on every layer, the router's renormalised top-4
# weights scaled to sum to 4) at d_model 64 and the tiny vocab.
_TINY["tiny-olmoe3"] = {
    **_olmoe3(d_model=64, n_layers=4, n_heads=4, n_kv_heads=1, n_experts=8, hidden=32, n_dense=1, lb_loss=0.01),
    **{k: v for k, v in _TINY_COMMON.items() if k != "sliding_window"},
    "head_dim": 16,
}

PRESETS: dict[str, dict[str, Any]] = {**_OLMO3, **_TINY, **_OLMOE3}


class SpecError(ValueError):
    """A spec that cannot be built; the message names the field and the fix."""


def _one_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "spec"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(ModelSpec.model_fields)
        msg = f"unknown field '{loc}'; remove it or use one of: {allowed}"
    elif loc != "spec" and loc not in msg:
        msg = f"field '{loc}': {msg}"
    return f"{source}: {msg}"


def spec_from_dict(data: dict[str, Any], source: str = "spec") -> ModelSpec:
    """Validate a dict into a ModelSpec; a preset name under key ``preset`` is the base."""
    data = dict(data)
    base = data.pop("preset", None)
    if base is not None:
        merged = {**preset_dict(base), **data}
        data = merged
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_one_line(err, source)) from None


def preset_dict(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise SpecError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)} (or pass a YAML/JSON spec file)")
    return {"name": name, **PRESETS[name]}


def get_preset(name: str) -> ModelSpec:
    return spec_from_dict(preset_dict(name), source=f"preset {name}")


def load_spec(preset_or_file: str | Path) -> ModelSpec:
    """A preset name, or a YAML/JSON file holding a spec (optionally ``preset: NAME`` plus overrides)."""
    text = str(preset_or_file)
    if text in PRESETS:
        return get_preset(text)
    path = Path(text)
    if not path.exists():
        if path.suffix in (".yaml", ".yml", ".json"):
            raise SpecError(f"{path}: spec file not found; check the path")
        preset_dict(text)  # raises the unknown-preset error
    from .yamlfile import read_yaml  # yaml loads only when a spec file is read

    data = read_yaml(path, SpecError, "spec file")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a spec file must hold a mapping of ModelSpec fields")
    if "model" in data and isinstance(data["model"], dict) and len(data) == 1:
        data = data["model"]
    return spec_from_dict(data, source=str(path))

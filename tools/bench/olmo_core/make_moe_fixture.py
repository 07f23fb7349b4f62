"""Writes the OLMo-core MoE fixture: OLMo-core 3.0.0's OLMoDDP model (the ``moe_fused_v2`` block the
OLMoE3-dev scripts build), saved as OLMo-core saves a model, with OLMo-core's own fp32 logits on fixed
tokens (tools/tests/test_olmo_core_moe.py reads it). Runs inside an isolated OLMo-core env
(ai2-olmo-core pins its own torch, so it is not a dependency of this workspace):

    uv venv /tmp/olmocore-env --python 3.11 && uv pip install --python /tmp/olmocore-env ai2-olmo-core==3.0.0
    /tmp/olmocore-env/bin/python tools/bench/olmo_core/make_moe_fixture.py tools/tests/data/olmo_core_moe

DIR holds spec.json (``olmo_model.ModelSpec`` JSON: GQA, per-head QK-norm, window 32 on layers 0-1,
a dense first layer, top-2 of 8 experts with the k weights renormalised and scaled back by k, one
shared expert, vocab 256). The model is built the way OLMoE3-dev-t001.py builds its own (with
``use_peri_norm``, ``embed_scale`` and ``embedding_norm`` when the spec's norm_placement is "peri",
embedding_scale is set or embedding_norm is true): an
``OLMoDDPModelConfig`` with ``fused_v2`` attention (packed ``w_qkv``), ``use_head_qk_norm``, an
``OLMoDDPTransformerBlockConfig`` with routed experts, a softmax ``MoERouterConfigV2`` with
``normalize_expert_weights=1.0`` and ``restore_weight_scale=True``, one shared expert (no shared
router), and ``block_overrides`` making block 0 a shared-expert-only block of hidden
top_k x expert_hidden + shared_hidden. Every parameter is then redrawn at O(1) scale (matrices
std 1/sqrt(fan-in), norm weights 1 +- 0.3), so a swapped or transposed tensor moves the logits by
far more than the tests' bound. The script writes, each atomically:

- ``model_and_optim/``: the state dict through OLMo-core's ``save_model_and_optim_state`` (a
  torch.distributed.checkpoint directory, keys under ``model.``, the first form the OLMoDDP train
  module's checkpoint loader looks for);
- ``reference.npz``: ``tokens`` (2 x 96, longer than the window) and ``logits`` (OLMo-core's forward);
- ``provenance.json``: versions, the command, the parameter count, the self-check's figure.

OLMo-core's no-expert-parallel MoE forward (``nn/moe/v2/no_ep.py``) has three CUDA-only pieces;
the script replaces exactly these with CPU equivalents, everything else is OLMo-core's code
(router, ``F.grouped_mm`` over the experts, shared expert, attention, norms, head):

1. the side CUDA stream of the shared expert (``get_dense_stream``, ``torch.cuda.current_stream``,
   ``wait_stream_no_compile``): on CPU there is one stream, so the stream is None (which makes
   ``torch.cuda.stream`` a no-op) and the waits are no-ops: the work runs in program order;
2. Transformer Engine's ``moe_permute`` / ``moe_unpermute`` (index map): a stable sort of the
   flattened expert ids gathers the token rows grouped by expert, and the unpermute scatters
   them back and sums each token's k rows weighted by its router weights, as TE defines them;
3. the routed experts' check that the per-expert counts sit on the GPU: the counts are taken
   as host-side split sizes (``requires_host_side_split_sizes`` true in routed_experts.py
   only), which on CPU are the same tensor.

Before saving, each block's output is checked against a plain re-computation from the state dict
(attention through the block's own module, then the feed-forward by hand: each token through its
k experts one by one, the shared expert, the norm and both residuals); the largest difference is
recorded. ``--check-load CKPT`` proves the reverse direction: it loads an ``olmo-core:`` checkpoint
written by ``olmo-convert`` (a ``.pt``: torch 2.13, which ai2-olmo-core 3.0.0 pins, cannot read the
DCP metadata this workspace's newer torch writes) into a freshly built model and compares its
forward with reference.npz, recording the figure in provenance.json:

    uv run --frozen olmo-convert olmo-core:tools/tests/data/olmo_core_moe/model_and_optim jax:/tmp/moe-jax \
        --spec tools/tests/data/olmo_core_moe/spec.json
    uv run --frozen olmo-convert jax:/tmp/moe-jax olmo-core:/tmp/moe.pt
    /tmp/olmocore-env/bin/python tools/bench/olmo_core/make_moe_fixture.py tools/tests/data/olmo_core_moe \
        --check-load /tmp/moe.pt

``--shapes SPEC.json ...`` writes olmo_core_shapes.json instead: the parameter names and shapes of
each spec's OLMoDDP model built on the meta device (the full-size presets' JSON from
``olmo_model.load_spec(NAME).model_dump_json()``), for the layout test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from olmo_core.config import DType
from olmo_core.distributed.checkpoint import load_model_and_optim_state, save_model_and_optim_state
from olmo_core.nn.attention import AttentionConfig, AttentionType, SlidingWindowAttentionConfig
from olmo_core.nn.attention.backend import AttentionBackendName
from olmo_core.nn.ddp.block import OLMoDDPTransformerBlock, OLMoDDPTransformerBlockConfig
from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
from olmo_core.nn.lm_head import LMHeadConfig
from olmo_core.nn.moe import MoERouterGatingFunction
from olmo_core.nn.moe.v2 import no_ep, routed_experts
from olmo_core.nn.moe.v2.routed_experts import RoutedExpertsConfig
from olmo_core.nn.moe.v2.router import MoERouterConfigV2
from olmo_core.nn.moe.v2.shared_experts import SharedExpertsConfig
from olmo_core.nn.rope import RoPEConfig, RoPEType
from olmo_core.nn.transformer import OLMoDDPModelConfig, TransformerBlockType, TransformerType

BATCH, SEQ = 2, 96  # 96 > the spec's window of 32


def block_config(spec: dict, *, routed: bool) -> OLMoDDPTransformerBlockConfig:
    moe = spec["moe"]
    d, dtype = spec["d_model"], DType.float32
    norm = LayerNormConfig(name=LayerNormType.rms, eps=spec["norm_eps"], bias=False, dtype=dtype)
    pattern = [spec["sliding_window"] if t == "sliding_attention" else -1 for t in spec["layer_types"]]
    attention = AttentionConfig(
        name=AttentionType.fused_v2,
        n_heads=spec["n_heads"],
        n_kv_heads=spec["n_kv_heads"],
        head_dim=spec.get("head_dim"),
        bias=False,
        rope=RoPEConfig(name=RoPEType.default, theta=int(spec["rope_theta"]), full_precision=True),
        qk_norm=norm,
        use_head_qk_norm=spec["qk_norm"] == "per_head",
        backend=AttentionBackendName.torch,  # the scripts' flash_4 needs a GPU; SDPA is the CPU path
        sliding_window=SlidingWindowAttentionConfig(
            pattern=pattern, force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=False
        ),
        dtype=dtype,
    )
    shared_hidden = (moe["shared_expert_hidden"] or moe["expert_hidden"]) if routed else spec["mlp_hidden"]
    has_shared = moe["n_shared_experts"] == 1 or not routed
    return OLMoDDPTransformerBlockConfig(
        name=TransformerBlockType.moe_fused_v2,
        use_peri_norm=spec.get("norm_placement") == "peri",
        use_pre_norm=spec.get("norm_placement") == "pre",
        sequence_mixer=attention,
        layer_norm=norm,
        routed_experts=RoutedExpertsConfig(
            d_model=d, hidden_size=moe["expert_hidden"], num_experts=moe["n_experts"], bias=False, dtype=dtype
        )
        if routed
        else None,
        routed_experts_router=MoERouterConfigV2(
            d_model=d,
            num_experts=moe["n_experts"],
            top_k=moe["top_k"],
            gating_function=MoERouterGatingFunction.softmax,
            normalize_expert_weights=1.0 if moe["normalize_top_k"] else None,
            restore_weight_scale=moe["restore_weight_scale"],
            dtype=dtype,
        )
        if routed
        else None,
        shared_experts=SharedExpertsConfig(d_model=d, hidden_size=shared_hidden, num_experts=1, bias=False, dtype=dtype)
        if has_shared
        else None,
    )


def build_config(spec: dict) -> OLMoDDPModelConfig:
    moe = spec["moe"]
    assert moe["n_shared_experts"] <= 1, "more shared experts need OLMo-core's shared router, not built here"
    dense = [i for i in range(spec["n_layers"]) if moe["layers"] is not None and i not in moe["layers"]]
    return OLMoDDPModelConfig(
        d_model=spec["d_model"],
        vocab_size=spec["padded_vocab_size"],
        n_layers=spec["n_layers"],
        block=block_config(spec, routed=True),
        block_overrides={i: block_config(spec, routed=False) for i in dense} or None,
        lm_head=LMHeadConfig(
            layer_norm=LayerNormConfig(name=LayerNormType.rms, eps=spec["norm_eps"], bias=False, dtype=DType.float32),
            bias=False,
            dtype=DType.float32,
        ),
        name=TransformerType.moe_fused_v2,
        embed_scale=spec.get("embedding_scale"),
        embedding_norm=LayerNormConfig(name=LayerNormType.rms, eps=spec["norm_eps"], bias=False, dtype=DType.float32)
        if spec.get("embedding_norm")
        else None,
        dtype=DType.float32,
    )


def build(spec: dict, seed: int) -> torch.nn.Module:
    """OLMo-core's OLMoDDP model for ``spec`` on CPU in fp32, its weights redrawn from ``seed``."""
    torch.manual_seed(seed)
    model = build_config(spec).build(init_device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in(name, p, spec) ** 0.5)
    return model.eval()


def fan_in(name: str, p: torch.Tensor, spec: dict) -> int:
    if name.endswith("routed_experts_router.weight"):
        return spec["d_model"]  # stored flat [E * d]
    if name.endswith("shared_experts.w_up_gate"):
        return p.shape[0]  # [d, 2H_s], used as x @ W
    if name.endswith("w_down"):
        return p.shape[1]  # [E, H, d], used as h @ W[e]
    return p.shape[-1]  # nn.Linear [out, in], routed w_up_gate [E, 2H, d], embeddings [V, d]


def cpu_permute(inp, routing_map, num_out_tokens, map_type):
    """TE's index-map permute: rows grouped by expert id, token order kept within an expert."""
    assert map_type == "index" and num_out_tokens == routing_map.numel()
    order = torch.argsort(routing_map.reshape(-1), stable=True)
    return inp.index_select(0, order // routing_map.shape[1]), order


def cpu_unpermute(inp, row_id_map, restore_shape, map_type, merging_probs):
    """TE's index-map unpermute: each token's k rows back in place, summed with its router weights."""
    assert map_type == "index"
    rows = torch.empty_like(inp)
    rows[row_id_map] = inp
    n, k = merging_probs.shape
    return (rows.view(n, k, -1) * merging_probs.unsqueeze(-1).to(inp.dtype)).sum(1).view(restore_shape)


def cpu_patches() -> list:
    """The three replacements of the docstring (and nothing else)."""
    return [
        mock.patch.object(OLMoDDPTransformerBlock, "get_dense_stream", lambda self, for_x1=False: None),
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: None),
        mock.patch.object(no_ep, "wait_stream_no_compile", lambda this_stream, other_stream: None),
        mock.patch.object(no_ep, "moe_permute_no_compile", cpu_permute),
        mock.patch.object(no_ep, "moe_unpermute_no_compile", cpu_unpermute),
        mock.patch.object(routed_experts, "requires_host_side_split_sizes", lambda: True),
    ]


def forward(model: torch.nn.Module, tokens: np.ndarray, record: list | None = None) -> np.ndarray:
    """OLMo-core's logits, with the CPU replacements in place; ``record`` collects (block, input, output)."""
    hooks = []
    if record is not None:
        for block in model.blocks.values():
            hooks.append(block.register_forward_hook(lambda m, args, out: record.append((m, args[0], out))))
    patches = cpu_patches()
    for p in patches:
        p.start()
    try:
        with torch.no_grad():
            return model(torch.from_numpy(tokens)).float().numpy()
    finally:
        for p in patches:
            p.stop()
        for h in hooks:
            h.remove()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def swiglu(x: torch.Tensor, up: torch.Tensor, gate: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [d] through one expert; up / gate [d, H] (x @ W), down [H, d]."""
    return (x @ up * F.silu(x @ gate)) @ down


def block_by_hand(block, x: torch.Tensor, spec: dict) -> torch.Tensor:
    """One block's output recomputed from its state dict: reordered norms (and the input norms of a
    peri-norm block), the router, each token through its k experts one at a time, the shared expert
    added without a weight."""
    sd, eps, moe = block.state_dict(), spec["norm_eps"], spec["moe"]
    peri = spec.get("norm_placement") == "peri"  # input norms on both sublayers as well (use_peri_norm)
    attn_in = rms_norm(x, sd["attention_input_norm.weight"], eps) if peri else x
    h = x + rms_norm(block.attention(attn_in), sd["attention_norm.weight"], eps)
    mlp_in = rms_norm(h, sd["feed_forward_input_norm.weight"], eps) if peri else h
    hs = sd["shared_experts.w_up_gate"].shape[1] // 2
    shared_up, shared_gate = sd["shared_experts.w_up_gate"][:, :hs], sd["shared_experts.w_up_gate"][:, hs:]
    out = torch.empty_like(h)
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            tok = mlp_in[b, t]
            y = swiglu(tok, shared_up, shared_gate, sd["shared_experts.w_down"][0])
            if "routed_experts_router.weight" in sd:
                n_exp, k, eh = moe["n_experts"], moe["top_k"], moe["expert_hidden"]
                scores = torch.softmax(sd["routed_experts_router.weight"].view(n_exp, -1) @ tok, dim=-1)
                top = sorted(range(n_exp), key=lambda e: -float(scores[e]))[:k]
                weights = [float(scores[e]) / sum(float(scores[j]) for j in top) * k for e in top]
                for e, w in zip(top, weights):
                    wug = sd["routed_experts.w_up_gate"][e]  # [2H, d]: up rows, then gate rows
                    y = y + w * swiglu(tok, wug[:eh].T, wug[eh:].T, sd["routed_experts.w_down"][e])
            out[b, t] = y
    return h + rms_norm(out, sd["feed_forward_norm.weight"], eps)


def self_check(model: torch.nn.Module, tokens: np.ndarray, spec: dict) -> tuple[np.ndarray, float]:
    """OLMo-core's logits and the largest |difference| of any block's output from block_by_hand."""
    record: list = []
    logits = forward(model, tokens, record)
    assert len(record) == spec["n_layers"]
    worst = 0.0
    with torch.no_grad():
        for block, x, out in record:
            worst = max(worst, float((block_by_hand(block, x, spec) - out).abs().max()))
    if not worst < 1e-4:
        raise SystemExit(f"make_moe_fixture: OLMo-core's block output differs from the re-computation by {worst:.2e}")
    return logits, worst


def check_load(ckpt: Path, fixture: Path, spec: dict, seed: int) -> None:
    """Load an olmo-core: checkpoint (e.g. written by olmo-convert) into a model whose weights are first
    redrawn from another seed, and compare its logits with reference.npz: a DCP directory through
    OLMo-core's ``load_model_and_optim_state``, a ``.pt`` state dict through the model's strict
    ``load_state_dict`` (every key and shape checked by OLMo-core's modules)."""
    model = build(spec, seed + 1)
    if ckpt.is_dir():
        load_model_and_optim_state(str(ckpt), model)
    else:
        model.load_state_dict(torch.load(ckpt, weights_only=True), strict=True)
    ref = np.load(fixture / "reference.npz")
    diff = float(np.abs(forward(model, ref["tokens"]) - ref["logits"]).max())
    print(f"OLMo-core {version('ai2-olmo-core')} loaded {ckpt}: max |logits - reference| = {diff:.3e}")
    if diff != 0.0:
        raise SystemExit(1)
    provenance = json.loads((fixture / "provenance.json").read_text())
    provenance["check_load"] = {"checkpoint": ckpt.name, "max_abs_logit_diff": diff}
    (fixture / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")


def write_shapes(specs: list[Path], out: Path) -> None:
    """OLMo-core's parameter names and shapes of each spec's OLMoDDP model (built on the meta device,
    so a full-size preset costs nothing) as JSON: spec name -> {name: shape}."""
    shapes = {}
    for path in specs:
        spec = json.loads(path.read_text())
        model = build_config(spec).build(init_device="meta")
        shapes[spec["name"]] = {name: list(p.shape) for name, p in model.named_parameters()}
    command = "python tools/bench/olmo_core/make_moe_fixture.py " + " ".join(sys.argv[1:])
    out.write_text(json.dumps({"ai2-olmo-core": version("ai2-olmo-core"), "command": command, "shapes": shapes}) + "\n")
    print(f"wrote {out}: {', '.join(f'{k} ({len(v)} tensors)' for k, v in shapes.items())}")


def write_fixture(
    folder: Path, model, tokens, logits, worst: float, *, script: str, description: str, seed: int
) -> None:
    """The model's checkpoint (OLMo-core's own save), its logits on the tokens and the provenance,
    staged in a temporary folder next to spec.json and moved into place only when all are written."""
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        staging = Path(tmp)
        save_model_and_optim_state(staging / "model_and_optim", model)
        np.savez(staging / "reference.npz", tokens=tokens, logits=logits)
        provenance = {
            "ai2-olmo-core": version("ai2-olmo-core"),
            "torch": torch.__version__,
            "command": f"python tools/bench/olmo_core/{script} " + " ".join(sys.argv[1:]),
            "model": description,
            "parameters": sum(p.numel() for p in model.parameters()),
            "batch": BATCH,
            "sequence": SEQ,
            "seed": seed,
            "max_abs_block_diff_vs_recomputation": worst,
        }
        (staging / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
        for name in ("model_and_optim", "reference.npz", "provenance.json"):
            target = folder / name
            if target.is_dir():  # a directory cannot be replaced by rename: move the old one out first
                target.replace(staging / f"old-{name}")
            (staging / name).replace(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="fixture folder holding spec.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-load", type=Path, help="an olmo-core: DCP to load and compare instead of writing")
    parser.add_argument("--shapes", type=Path, nargs="+", help="spec JSON files: write OLMo-core's shapes instead")
    args = parser.parse_args()
    if args.shapes:
        write_shapes(args.shapes, args.dir / "olmo_core_shapes.json")
        return
    spec = json.loads((args.dir / "spec.json").read_text())
    if args.check_load is not None:
        check_load(args.check_load, args.dir, spec, args.seed)
        return
    model = build(spec, args.seed)
    tokens = np.random.default_rng(args.seed).integers(0, spec["vocab_size"], (BATCH, SEQ)).astype(np.int64)
    logits, worst = self_check(model, tokens, spec)
    write_fixture(
        args.dir,
        model,
        tokens,
        logits,
        worst,
        script="make_moe_fixture.py",
        description="OLMoDDPModelConfig(moe_fused_v2, fused_v2 attention, use_head_qk_norm, block 0 shared-only)",
        seed=args.seed,
    )
    print(f"wrote {args.dir}: logits {logits.shape}, |logits| max {np.abs(logits).max():.2f}, self-check {worst:.2e}")


if __name__ == "__main__":
    main()

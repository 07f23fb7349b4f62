"""olmo-parity: do two checkpoints/implementations compute the same model?

    uv run --frozen olmo-parity logits A B [--seq-len 128] [--batch 2] [--dtype float32|bfloat16]
        [--dtype-a D] [--dtype-b D] [--seed 0] [--tokens FILE] [--json] [--max-kl X] [--min-top1 Y]
        [--impl-a torch|jax] [--impl-b torch|jax]

A and B are ``hf:DIR``, ``olmo-core:PATH``, ``torch:DIR``, ``jax:DIR`` (olmo-convert's
formats) or ``hf-ref:DIR`` (transformers' own Olmo3ForCausalLM.from_pretrained(DIR)).
torch: runs our torch model, jax: our NNX model (jitted), hf:/olmo-core: our torch
model unless --impl-a/--impl-b say jax. --dtype sets both sides' weights and compute;
--dtype-a/--dtype-b override one side (e.g. ours in bf16 against an fp32 reference). Both
run on the same tokens (seeded random ids,
or a .npy / raw OLMo token file); on the host, in float64, per position:
KL(P_A || P_B), top-1 agreement and |logit_A - logit_B|. Logits are computed a few
sequences at a time, so B x S x V never has to fit at once. Exit status: 0 when every
threshold holds, 1 when --max-kl or --min-top1 is violated, 2 on bad input. E.g.

    uv run --frozen olmo-parity logits torch:ckpt/t hf-ref:out/hf --seq-len 256 --max-kl 1e-9 --min-top1 1.0

``olmo-parity train`` runs both trainers on one recipe and compares their training curves
(olmo_tools.train_parity).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from olmo_model import ModelSpec
from olmo_model.presets import SpecError

from .checkpoint import KINDS, CheckpointError, parse_location, require_jax, spec_disagreement, validate
from .formats import DTYPES, HFCheckpoint, open_checkpoint
from .train_parity import add_train_command

PARITY_KINDS = (*KINDS, "hf-ref")
DEFAULT_IMPL = {"hf": "torch", "olmo-core": "torch", "torch": "torch", "jax": "jax", "hf-ref": "transformers"}
# Float64 elements of one side's logits per chunk (256 MiB); the chunk is whole sequences.
CHUNK_ELEMENTS = 2**25


@dataclass
class Side:
    """One runnable side: its spec, which implementation runs it, and ids [b, S] -> float32 logits."""

    label: str
    impl: str
    spec: ModelSpec
    logits: Callable[[np.ndarray], np.ndarray]


def load_side(text: str, impl: str | None, dtype: str, spec: str | None = None) -> Side:
    loc = parse_location(text, PARITY_KINDS)
    impl = impl or DEFAULT_IMPL[loc.kind]
    if loc.kind == "hf-ref":
        if impl != "transformers":
            raise CheckpointError(f"{text}: hf-ref always runs transformers; drop --impl for this side")
        return _transformers_side(text, loc.path, dtype)
    with open_checkpoint(loc, spec) as ckpt:
        tensors = dict(ckpt.tensors())
        if impl == "torch":
            from olmo_train_torch import model_from_hf as torch_model_from_hf

            model = torch_model_from_hf(ckpt.spec, tensors, DTYPES[dtype]).eval()
            del tensors

            def run(ids: np.ndarray) -> np.ndarray:
                with torch.no_grad():
                    return model(torch.from_numpy(ids)).logits.float().numpy()

        elif impl == "jax":
            require_jax(text)
            import jax.numpy as jnp
            from flax import nnx

            from olmo_train_jax import model_from_hf as jax_model_from_hf

            from .native import torch_to_numpy

            jax_model = jax_model_from_hf(
                ckpt.spec, {n: torch_to_numpy(t) for n, t in tensors.items()}, param_dtype=dtype, dtype=dtype
            )
            del tensors
            forward = nnx.jit(lambda m, ids: m(ids).logits)

            def run(ids: np.ndarray) -> np.ndarray:
                return np.asarray(forward(jax_model, jnp.asarray(ids)), dtype=np.float32)

        else:
            raise CheckpointError(f"{text}: --impl '{impl}' is unknown; use torch or jax")
        return Side(text, impl, ckpt.spec, run)


def _transformers_side(text: str, path: Path, dtype: str) -> Side:
    from transformers import Olmo3ForCausalLM

    # Read config.json and the tensors through our checker first, so a bad folder fails
    # with our one-line message rather than a transformers warning about random init.
    with HFCheckpoint(path) as ckpt:
        validate(ckpt)
        spec = ckpt.spec
    model = Olmo3ForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()

    def run(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(ids)).logits.float().numpy()

    return Side(text, "transformers", spec, run)


def read_tokens(path: Path, batch: int, seq_len: int, vocab_size: int, raw_dtype: str) -> np.ndarray:
    """[batch, seq_len] int64 ids: from a .npy (1-D stream or 2-D rows) or a raw OLMo token file
    (a headerless array of ``raw_dtype`` ids, as OLMo's numpy datasets store them)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: token file not found")
    data = np.load(path, mmap_mode="r") if path.suffix == ".npy" else np.memmap(path, dtype=raw_dtype, mode="r")
    need = batch * seq_len
    if data.ndim == 2 and data.shape[0] >= batch and data.shape[1] >= seq_len:
        ids = np.asarray(data[:batch, :seq_len])
    elif data.size >= need:
        ids = np.asarray(data.reshape(-1)[:need]).reshape(batch, seq_len)
    else:
        raise CheckpointError(f"{path}: holds {data.size} tokens (shape {data.shape}), need batch x seq_len = {need}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise CheckpointError(f"{path}: token ids have dtype {ids.dtype}; expected integers")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise CheckpointError(
            f"{path}: token ids span [{ids.min()}, {ids.max()}], outside the vocabulary [0, {vocab_size}); "
            "check --tokens-dtype or the tokenizer the file was made with"
        )
    return ids.astype(np.int64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(a: Side, b: Side, ids: np.ndarray, chunk_elements: int = CHUNK_ELEMENTS) -> dict[str, float]:
    """KL(P_A || P_B) per position, top-1 agreement and max |logit diff|, in float64, chunk by chunk."""
    batch, seq_len = ids.shape
    vocab = a.spec.padded_vocab_size
    rows = max(1, chunk_elements // (seq_len * vocab))
    kl_sum, kl_max, agree, max_diff = 0.0, -np.inf, 0, 0.0
    for start in range(0, batch, rows):
        chunk = ids[start : start + rows]
        la = a.logits(chunk).astype(np.float64)
        lb = b.logits(chunk).astype(np.float64)
        expected = (len(chunk), seq_len, vocab)
        for side, out in ((a, la), (b, lb)):
            if out.shape != expected:
                raise CheckpointError(f"{side.label}: logits have shape {out.shape}, expected {expected}")
        max_diff = max(max_diff, float(np.abs(la - lb).max()))
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        pa, pb = _log_softmax(la), _log_softmax(lb)
        kl = (np.exp(pa) * (pa - pb)).sum(-1)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
    n = batch * seq_len
    return {
        "n_positions": n,
        "kl_mean": kl_sum / n,
        "kl_max": kl_max,
        "top1_agreement": agree / n,
        "max_abs_logit_diff": max_diff,
    }


def run_logits(args: argparse.Namespace) -> int:
    if args.seq_len <= 0 or args.batch <= 0:
        raise CheckpointError(f"--seq-len {args.seq_len} and --batch {args.batch} must be positive")
    dtype_a, dtype_b = args.dtype_a or args.dtype, args.dtype_b or args.dtype
    a = load_side(args.a, args.impl_a, dtype_a, args.spec)
    b = load_side(args.b, args.impl_b, dtype_b, args.spec)
    diff = spec_disagreement(a.spec, b.spec)
    if diff:
        raise CheckpointError(
            f"{args.a} and {args.b} are different models ({'; '.join(diff[:3])}); compare like with like"
        )
    if args.tokens:
        ids = read_tokens(Path(args.tokens), args.batch, args.seq_len, a.spec.vocab_size, args.tokens_dtype)
    else:
        ids = np.random.default_rng(args.seed).integers(0, a.spec.vocab_size, (args.batch, args.seq_len))
    metrics = compare(a, b, ids)
    failures = []
    if args.max_kl is not None and not metrics["kl_max"] <= args.max_kl:
        failures.append(f"kl_max {metrics['kl_max']:.3e} > --max-kl {args.max_kl:g}")
    if args.min_top1 is not None and not metrics["top1_agreement"] >= args.min_top1:
        failures.append(f"top1_agreement {metrics['top1_agreement']:.6f} < --min-top1 {args.min_top1:g}")
    report = {
        "a": args.a,
        "b": args.b,
        "impl_a": a.impl,
        "impl_b": b.impl,
        "spec": a.spec.name,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "dtype_a": dtype_a,
        "dtype_b": dtype_b,
        "tokens": args.tokens or f"random (seed {args.seed})",
        **metrics,
        "max_kl": args.max_kl,
        "min_top1": args.min_top1,
        "passed": not failures,
        "failures": failures,
    }
    if args.json:
        print(json.dumps(report))
    else:
        table = Table(title=f"olmo-parity logits: {a.spec.name}, {args.batch} x {args.seq_len} tokens")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_row("A", f"{args.a} ({a.impl}, {dtype_a})")
        table.add_row("B", f"{args.b} ({b.impl}, {dtype_b})")
        table.add_row("KL(A||B) mean", f"{metrics['kl_mean']:.3e}")
        table.add_row("KL(A||B) max", f"{metrics['kl_max']:.3e}")
        table.add_row("top-1 agreement", f"{metrics['top1_agreement']:.2%}")
        table.add_row("max |logit diff|", f"{metrics['max_abs_logit_diff']:.3e}")
        table.add_row("verdict", "PASS" if not failures else "FAIL: " + "; ".join(failures))
        Console().print(table)
    return 0 if not failures else 1


def add_logits_command(subparsers) -> None:
    p = subparsers.add_parser("logits", help="compare two models' logits on the same tokens")
    p.add_argument("a", help="A: hf:DIR | hf-ref:DIR | olmo-core:PATH | torch:DIR | jax:DIR")
    p.add_argument("b", help="B: same kinds as A")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="parameter and compute dtype of both sides"
    )
    p.add_argument("--dtype-a", choices=sorted(DTYPES), help="A's parameter and compute dtype (default: --dtype)")
    p.add_argument("--dtype-b", choices=sorted(DTYPES), help="B's parameter and compute dtype (default: --dtype)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (numpy default_rng)")
    p.add_argument("--tokens", help="token ids instead of random ones: .npy, or a raw OLMo token file")
    p.add_argument(
        "--tokens-dtype", choices=("uint16", "uint32"), default="uint32", help="element type of a raw token file"
    )
    p.add_argument("--impl-a", choices=("torch", "jax"), help="run A with this implementation (default by kind)")
    p.add_argument("--impl-b", choices=("torch", "jax"), help="run B with this implementation (default by kind)")
    p.add_argument("--spec", help="preset or spec file for olmo-core sides (they carry no config)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--max-kl", type=float, help="fail (exit 1) when the largest per-position KL exceeds this")
    p.add_argument("--min-top1", type=float, help="fail (exit 1) when top-1 agreement (0..1) is below this")
    p.set_defaults(func=run_logits)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="olmo-parity", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_logits_command(subparsers)
    add_train_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Only `train` takes extra --section.key=value arguments (recipe overrides).
    args, overrides = parser.parse_known_args(argv)
    if overrides and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    try:
        return args.func(args)
    except (CheckpointError, SpecError) as err:
        print(f"olmo-parity: error: {err}", file=sys.stderr)  # one line, never wrapped
        return 2


if __name__ == "__main__":
    sys.exit(main())

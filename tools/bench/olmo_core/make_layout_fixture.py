"""Writes the OLMo-core layout fixture: OLMo-core's real olmo3 model, saved as OLMo-core saves it,
with OLMo-core's own fp32 logits on fixed tokens (tools/tests/test_olmo_core_layout.py reads it).

Runs inside the isolated OLMo-core env (ai2-olmo-core pins torch 2.13, so it is not a test
dependency of this workspace). Regenerate from the repository root with

    uv run --isolated --no-project --python 3.11 --with ai2-olmo-core \
        python tools/bench/olmo_core/make_layout_fixture.py tools/tests/data/olmo_core_olmo3

DIR must hold spec.json (``olmo_model.ModelSpec`` JSON, committed: tiny-gqa with the vocabulary
cut to 256 so the fixture stays near 1 MB in fp32). The script writes, each atomically:

- ``model_and_optim/``: the model state dict through OLMo-core's own
  ``save_model_and_optim_state`` (a torch.distributed.checkpoint directory, keys under
  ``model.``, no optimizer), as its trainer writes ``stepN/model_and_optim``;
- ``reference.npz``: ``tokens`` (int64, batch x sequence, sequence longer than the window so
  sliding and global layers both matter) and ``logits`` (float32, OLMo-core's forward on them);
- ``provenance.json``: OLMo-core and torch versions and the config OLMo-core built.

The model is built by OLMo-core (peer_model.build: ``TransformerConfig.llama_like`` with the
reordered-norm block, QK-norm and our window pattern) and initialised by OLMo-core; every
parameter, norm weights included, is then redrawn from a seeded generator (matrices with
std 1/sqrt(fan-in), norm weights 1 +- 0.3) so that logits are O(1) and a swapped, transposed
or mis-windowed tensor moves them by far more than the test's 1e-4 tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from olmo_core.distributed.checkpoint import save_model_and_optim_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_model  # noqa: E402  (a sibling file, not an installed package)

BATCH, SEQ = 2, 96  # 96 > the spec's window of 32


def redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="fixture folder holding spec.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = json.loads((args.dir / "spec.json").read_text())
    model, how = peer_model.build(spec, None, seed=args.seed)
    redraw(model, args.seed)
    model.eval()
    tokens = np.random.default_rng(args.seed).integers(0, spec["vocab_size"], (BATCH, SEQ)).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).float().numpy()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        staging = Path(tmp)
        save_model_and_optim_state(staging / "model_and_optim", model)
        np.savez(staging / "reference.npz", tokens=tokens, logits=logits)
        (staging / "provenance.json").write_text(
            json.dumps(
                {
                    "ai2-olmo-core": version("ai2-olmo-core"),
                    "torch": torch.__version__,
                    "config": how,
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "batch": BATCH,
                    "sequence": SEQ,
                    "seed": args.seed,
                },
                indent=2,
            )
            + "\n"
        )
        for name in ("model_and_optim", "reference.npz", "provenance.json"):
            target = args.dir / name
            if target.is_dir():  # a directory cannot be replaced by rename: move the old one out first
                target.replace(staging / f"old-{name}")
            (staging / name).replace(target)
    print(f"wrote {args.dir}: {how}, logits {logits.shape}, |logits| max {np.abs(logits).max():.2f}")


if __name__ == "__main__":
    main()

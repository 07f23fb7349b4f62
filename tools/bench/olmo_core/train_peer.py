"""OLMo-core's own Olmo 3 model timed through a full fp32 train step; prints one JSON line.

Runs inside the isolated OLMo-core env (ai2-olmo-core pins torch 2.13, so it cannot join
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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_model  # noqa: E402  (a sibling file, not an installed package)


def time_mode(spec: dict, param_total: int, batches: np.ndarray, compile_blocks: bool, lr: float) -> dict:
    model, how = peer_model.build(spec, param_total, seed=0)
    model.train()
    if compile_blocks:
        model.apply_compile()
    optim = SkipStepAdamWConfig(
        lr=lr, weight_decay=0.1, betas=(0.9, 0.95), foreach=True,
        group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts=dict(weight_decay=0.0))],
    ).build(model)
    z_loss = spec["z_loss_weight"]

    def step(tokens: np.ndarray) -> float:
        ids = torch.from_numpy(tokens[:, :-1]).long()
        labels = torch.from_numpy(tokens[:, 1:]).long()  # next-token labels, as OLMo-core's get_labels
        out = model(ids, labels=labels, z_loss_multiplier=z_loss)
        out.loss.backward()
        optim.latest_loss = out.ce_loss.detach()
        optim.latest_grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return float(out.ce_loss)

    t0 = time.perf_counter()
    first_loss = step(batches[0])
    first = time.perf_counter() - t0
    times = []
    for tokens in batches[1:]:
        t0 = time.perf_counter()
        step(tokens)
        times.append(time.perf_counter() - t0)
    return {"first_step_s": first, "step_times": times, "first_ce_loss": first_loss, "config": how}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="ModelSpec JSON file")
    parser.add_argument("--param-total", type=int, required=True, help="olmo_model.param_counts(spec).total")
    parser.add_argument("--batches", required=True, help=".npy int32 (steps, batch, sequence + 1)")
    parser.add_argument("--modes", nargs="+", choices=("eager", "compile"), default=["eager", "compile"])
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    batches = np.load(args.batches)
    results = {mode: time_mode(spec, args.param_total, batches, mode == "compile", args.lr) for mode in args.modes}
    print(json.dumps({
        "olmo_core": version("ai2-olmo-core"), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "modes": results,
    }))


if __name__ == "__main__":
    main()

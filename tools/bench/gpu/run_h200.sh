#!/usr/bin/env bash
# The one command a lent GPU machine runs (the device tool; README "GPU benchmarks"):
#   bash tools/bench/gpu/run_h200.sh [DEADLINE_S] [bench_gpu.py all options...]
# There: python3 is the image's own (torch, jax, flax, optax, transformers); what it lacks
# (pydantic, zstandard, grain, ai2-olmo-core, ...) travels as wheels in .whl/ (git-ignored,
# made by tools/bench/gpu/fetch_wheels.sh). Our packages run from source on PYTHONPATH.
# Results: $OUT/results.jsonl, $OUT/all.log, $OUT/logs.tgz (one log per contender).
set -u
OUT=${OUT:-/tmp/bench_gpu_out}
DEADLINE=${1:-330}
shift || true
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "warning: carried wheels did not install"
fi
export PYTHONPATH=/tmp/site:packages/olmo-model/src:packages/olmo-data/src:packages/olmo-train-jax/src:packages/olmo-train-torch/src
export PYTHONUNBUFFERED=1
# JAX takes 75% of the card by default; the olmo3-1b step at 32k tokens needs more (run 1: OOM).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
{ nvidia-smi; python3 -m pip list 2>/dev/null | grep -iE '^(torch|jax|jaxlib|flax|optax|orbax|chex|transformers|numpy|pydantic|ai2-olmo-core|triton) '; } > "$OUT/env.txt" 2>&1
python3 tools/bench/gpu/bench_gpu.py all --out "$OUT" --deadline-s "$DEADLINE" "$@" 2>&1 | tee "$OUT/all.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"

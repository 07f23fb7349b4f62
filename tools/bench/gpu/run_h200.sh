#!/usr/bin/env bash
# The one command a lent GPU machine runs (the device tool; README "GPU benchmarks"):
#   bash tools/bench/gpu/run_h200.sh [DEADLINE_S] [bench_gpu.py all options...]
# No arguments: the default plan (bench_gpu.DEFAULT_PLAN, README "Default plan"), 480 s of
# contenders, about 8 minutes with the set-up. There: python3 is the image's own (torch, jax,
# flax, optax, transformers); what it lacks (pydantic, zstandard, grain, ai2-olmo-core, ...)
# travels as wheels in .whl/ (git-ignored, see README). Our packages run from source on PYTHONPATH.
# Results, named with the UTC date and time: $OUT/h200-STAMP-results.jsonl (one line per contender,
# appended as each ends), -all.log (the table at the end), -env.txt, -logs.tgz (one log per
# contender). $OUT is the device tool's folder there; elsewhere tools/bench/gpu/results/.
set -u
STAMP=$(date -u +%Y-%m-%d-%H%M)
OUT=${OUT:-tools/bench/gpu/results/h200-$STAMP}
DEADLINE=${1:-480}
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
for f in results.jsonl all.log env.txt logs.tgz; do
  [ -e "$OUT/$f" ] && mv "$OUT/$f" "$OUT/h200-$STAMP-$f"
done
exit 0

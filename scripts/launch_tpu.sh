#!/usr/bin/env bash
# Launch olmo-train-jax on a TPU slice (multi-host JAX): the same command runs on every host of
# the slice, and jax.distributed.initialize() finds its peers from the TPU metadata.
#
#   scripts/launch_tpu.sh recipes/olmo3-7b/stage1.yaml --device tpu7x --devices 512 --tpu-name my-slice --zone us-central1-c
#   scripts/launch_tpu.sh recipes/olmo3-7b/stage1.yaml --device v5p --devices 128 --dry-run
#
# --devices is the number of JAX devices of the slice (a tpu7x chip shows as 2). Moving the run to
# another generation or to a quarter of the slice changes only --device/--devices: olmo-plan
# derives the per-device batch and accumulation for the same global batch and refuses what cannot
# fit. Set REPO_DIR to the checkout on the TPU hosts (default: this checkout's path).
set -euo pipefail
usage() { echo "usage: $0 RECIPE.yaml --device KIND --devices N [--tpu-name NAME --zone ZONE] [--dry-run] [-- overrides...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
RECIPE=$1; shift
DEVICE=""; DEVICES=""; TPU_NAME=${TPU_NAME:-}; ZONE=${ZONE:-}; DRY=0; OVERRIDES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --devices) DEVICES=$2; shift 2 ;;
        --tpu-name) TPU_NAME=$2; shift 2 ;;
        --zone) ZONE=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --) shift; OVERRIDES=("$@"); break ;;
        *) usage ;;
    esac
done
[ -n "$DEVICE" ] && [ -n "$DEVICES" ] || usage
REPO_DIR=${REPO_DIR:-$(cd "$(dirname "$0")/.." && pwd)}

PLAN=(uv run --frozen olmo-plan "$RECIPE" --devices "$DEVICE:$DEVICES" "${OVERRIDES[@]}")
REMOTE="cd $REPO_DIR && uv run --frozen olmo-train-jax $RECIPE --jax.distributed=true ${OVERRIDES[*]}"
SSH=(gcloud compute tpus tpu-vm ssh "${TPU_NAME:-TPU_NAME}" --zone "${ZONE:-ZONE}" --worker=all --command "$REMOTE")
if [ "$DRY" = 1 ]; then
    echo "# plan: $DEVICE x $DEVICES JAX devices"
    echo "${PLAN[*]}"
    printf '%q ' "${SSH[@]}"; echo
    exit 0
fi
[ -n "$TPU_NAME" ] && [ -n "$ZONE" ] || { echo "launch_tpu.sh: set --tpu-name and --zone (or TPU_NAME/ZONE)" >&2; exit 2; }
"${PLAN[@]}"
exec "${SSH[@]}"

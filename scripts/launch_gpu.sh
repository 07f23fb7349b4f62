#!/usr/bin/env bash
# Launch olmo-train-torch on a GPU cluster with torchrun; run the same command on every node.
#
#   NNODES=64 NODE_RANK=0 MASTER_ADDR=node0 scripts/launch_gpu.sh recipes/olmo3-7b/stage1.yaml --device h100
#   NNODES=16 scripts/launch_gpu.sh recipes/olmo3-7b/stage1.yaml --device b200 --dry-run -- --optim.lr=2e-4
#
# Nodes come from the environment (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT; under Slurm
# SLURM_NNODES / SLURM_NODEID / the first host of SLURM_JOB_NODELIST), GPUS_PER_NODE defaults to 8.
# The recipe's global batch is kept whatever the device count: olmo-plan derives the per-device
# batch and accumulation first and refuses a layout that cannot fit, so moving to a quarter of the
# nodes or another GPU generation changes no recipe line, only --device and the node count.
set -euo pipefail
usage() { echo "usage: $0 RECIPE.yaml --device KIND [--dry-run] [-- recipe overrides...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
RECIPE=$1; shift
DEVICE=""; DRY=0; OVERRIDES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --) shift; OVERRIDES=("$@"); break ;;
        *) usage ;;
    esac
done
[ -n "$DEVICE" ] || usage
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
DEVICES=$((NNODES * GPUS_PER_NODE))

PLAN=(uv run --frozen olmo-plan "$RECIPE" --devices "$DEVICE:$DEVICES" "${OVERRIDES[@]}")
TRAIN=(uv run --frozen torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK"
       --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "olmo-$(basename "$RECIPE" .yaml)"
       -m olmo_train_torch "$RECIPE" "${OVERRIDES[@]}")
if [ "$DRY" = 1 ]; then
    echo "# plan: $DEVICE x $DEVICES ($NNODES nodes x $GPUS_PER_NODE GPUs)"
    echo "${PLAN[*]}"
    echo "${TRAIN[*]}"
    exit 0
fi
"${PLAN[@]}"
exec "${TRAIN[@]}"

#!/usr/bin/env bash
# Launch a recipe on a GPU cluster: run the same command on every node (srun --ntasks-per-node=1
# does that under Slurm).
#
#   NNODES=64 NODE_RANK=0 MASTER_ADDR=node0 scripts/launch_gpu.sh recipes/olmo3-7b/stage1.yaml --device h100
#   srun --nodes=16 --ntasks-per-node=1 scripts/launch_gpu.sh recipes/olmo3-7b/stage1.yaml --device b200
#   srun --nodes=4 --ntasks-per-node=1 scripts/launch_gpu.sh RECIPE.yaml --device h100 --framework jax
#   NNODES=16 MASTER_ADDR=node0 scripts/launch_gpu.sh RECIPE.yaml --device b200 --dry-run -- --optim.lr=2e-4
#
# Nodes come from the environment: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (default 29500);
# under Slurm SLURM_NNODES, SLURM_NODEID and the first host of SLURM_JOB_NODELIST. Several nodes
# need a MASTER_ADDR every node reaches: localhost is refused. GPUs per node: GPUS_PER_NODE, else
# SLURM_GPUS_ON_NODE, else what nvidia-smi lists.
#
# --framework torch (default): torchrun, one process per GPU, c10d rendezvous (id: RDZV_ID, else
# the Slurm job id, else the recipe's name). Several nodes default to HSDP with one replica per
# node (--torch.parallel=hsdp --torch.replicate=NNODES: the all-gathers stay inside a node's
# NVLink) unless the overrides set torch.parallel or torch.replicate.
# --framework jax: olmo-train-jax, one process per node using all of its GPUs, joined through
# jax.coordinator_address (MASTER_ADDR:MASTER_PORT), jax.num_processes and jax.process_id; it
# needs the cuda extra, installed once: uv sync --frozen --all-packages --extra cuda.
#
# The recipe's global batch is kept whatever the device count: olmo-plan derives the per-device
# batch and accumulation first and refuses a layout that cannot fit, so moving to a quarter of the
# nodes or another GPU generation changes no recipe line, only --device and the node count.
set -euo pipefail
usage() { echo "usage: $0 RECIPE.yaml --device KIND [--framework torch|jax] [--dry-run] [-- recipe overrides...]" >&2; exit 2; }
fail() { echo "launch_gpu.sh: $*" >&2; exit 2; }
[ $# -ge 1 ] || usage
RECIPE=$1; shift
DEVICE=""; FRAMEWORK=torch; DRY=0; OVERRIDES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --framework) FRAMEWORK=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --) shift; OVERRIDES=("$@"); break ;;
        *) usage ;;
    esac
done
[ -n "$DEVICE" ] || usage
case "$FRAMEWORK" in torch | jax) ;; *) fail "--framework $FRAMEWORK: use torch or jax" ;; esac
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    command -v scontrol >/dev/null || fail "under Slurm without scontrol: set MASTER_ADDR to the first node's address"
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads to the end: head would close the pipe early, and scontrol's SIGPIPE fails the script under pipefail
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
case "$MASTER_ADDR" in
    localhost | 127.* | ::1)
        [ "$NNODES" -le 1 ] || fail "NNODES=$NNODES but MASTER_ADDR=$MASTER_ADDR: the other nodes cannot reach it; set MASTER_ADDR to node 0's address (under Slurm it is the first host of the job)" ;;
esac
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
if [ -z "$GPUS_PER_NODE" ] && command -v nvidia-smi >/dev/null; then
    GPUS_PER_NODE=$(nvidia-smi -L | grep -c '^GPU ' || true)
fi
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || fail "GPUs per node unknown (GPUS_PER_NODE='$GPUS_PER_NODE'): set GPUS_PER_NODE"
DEVICES=$((NNODES * GPUS_PER_NODE))

# HSDP across nodes, placed after the overrides only when they leave the layout open.
LAYOUT=()
if [ "$FRAMEWORK" = torch ] && [ "$NNODES" -gt 1 ]; then
    LAYOUT=(--torch.parallel=hsdp "--torch.replicate=$NNODES")
    for o in "${OVERRIDES[@]}"; do
        case "$o" in --torch.parallel* | --torch.replicate*) LAYOUT=() ;; esac
    done
fi
ARGS=("$RECIPE" "${OVERRIDES[@]}" "${LAYOUT[@]}")
PLAN=(uv run --frozen olmo-plan "$RECIPE" --devices "$DEVICE:$DEVICES" "${OVERRIDES[@]}" "${LAYOUT[@]}")
if [ "$FRAMEWORK" = torch ]; then
    RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:+slurm-$SLURM_JOB_ID}}
    TRAIN=(uv run --frozen torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK"
           --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-olmo-$(basename "$RECIPE" .yaml)}"
           -m olmo_train_torch "${ARGS[@]}")
    CHECK=()
else
    # One process per node: under srun JAX would give it one GPU; the trainer gives it all of them.
    TRAIN=(uv run --frozen --no-sync olmo-train-jax "${ARGS[@]}" "--jax.coordinator_address=$MASTER_ADDR:$MASTER_PORT"
           "--jax.num_processes=$NNODES" "--jax.process_id=$NODE_RANK")
    CHECK=(uv run --frozen --no-sync python -c "import jax_cuda12_plugin")
fi
quote() {  # one shell word per argument: as it is when plain, else in single quotes
    local a
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then printf '%s ' "$a"; else printf "'%s' " "${a//\'/\'\\\'\'}"; fi
    done
    echo
}
if [ "$DRY" = 1 ]; then
    echo "# plan: $DEVICE x $DEVICES ($NNODES nodes x $GPUS_PER_NODE GPUs), $FRAMEWORK"
    quote "${PLAN[@]}"
    [ ${#CHECK[@]} -eq 0 ] || { echo "# the cuda extra is installed"; quote "${CHECK[@]}"; }
    quote "${TRAIN[@]}"
    exit 0
fi
if [ ${#CHECK[@]} -gt 0 ] && ! "${CHECK[@]}" 2>/dev/null; then
    fail "JAX has no CUDA plugin here; install the cuda extra once: uv sync --frozen --all-packages --extra cuda"
fi
"${PLAN[@]}"
exec "${TRAIN[@]}"

#!/usr/bin/env bash
# Launch olmo-train-jax on a TPU slice (multi-host JAX): every worker of the slice runs the same
# command; with the tpu extra (libtpu) installed, jax.distributed.initialize() finds its peers in
# the TPU VM metadata (--jax.distributed=true), and every process reads its own rows.
#
#   scripts/launch_tpu.sh recipes/olmo3-7b/stage1.yaml --device v5p --devices 512 \
#       --tpu-name my-slice --zone us-east5-a --run-dir /mnt/shared/runs/7b-stage1 -- --optim.lr=2e-4
#   scripts/launch_tpu.sh recipes/olmo3-7b/stage1.yaml --device v5p --devices 128 --dry-run
#
# --devices is the number of JAX devices of the slice (a tpu7x chip shows as 2). Moving the run to
# another generation or to a quarter of the slice changes only --device/--devices: olmo-plan
# derives the per-device batch and accumulation for the same global batch and refuses what cannot
# fit.
#
# --run-dir must be where every worker sees the same files: a path on a file system all workers
# mount at the same place (Filestore/NFS, a GCS FUSE mount), or a remote URL (gs://...; object-store
# run dirs are the trainer's storage layer). A worker's own disk is not: the trainer refuses a run
# dir its processes do not share, at start.
#
# Steps, each printed by --dry-run: plan here; on every worker, install uv if missing and
# olmo-train-jax with the tpu extra (from the lock; no torch, no dev tools) in REPO_DIR (default:
# this checkout's path; it must be a checkout on every worker); start the trainer detached (setsid, nohup), with
# one log and one PID file per worker under ~/olmo-logs/; then print how to follow and stop it.
set -euo pipefail
usage() {
    echo "usage: $0 RECIPE.yaml --device KIND --devices N --tpu-name NAME --zone ZONE --run-dir DIR|URL [--dry-run] [-- overrides...]" >&2
    exit 2
}
[ $# -ge 1 ] || usage
RECIPE=$1; shift
DEVICE=""; DEVICES=""; TPU_NAME=${TPU_NAME:-}; ZONE=${ZONE:-}; RUN_DIR=""; DRY=0; OVERRIDES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --devices) DEVICES=$2; shift 2 ;;
        --tpu-name) TPU_NAME=$2; shift 2 ;;
        --zone) ZONE=$2; shift 2 ;;
        --run-dir) RUN_DIR=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --) shift; OVERRIDES=("$@"); break ;;
        *) usage ;;
    esac
done
[ -n "$DEVICE" ] && [ -n "$DEVICES" ] || usage
case "$RUN_DIR" in
    "" | /* | *://*) ;;
    *) echo "launch_tpu.sh: --run-dir $RUN_DIR is relative, i.e. on each worker's own disk; give a path on a shared file system every worker mounts, or a URL (gs://...)" >&2; exit 2 ;;
esac
if [ "$DRY" = 0 ]; then
    [ -n "$TPU_NAME" ] && [ -n "$ZONE" ] || { echo "launch_tpu.sh: set --tpu-name and --zone (or TPU_NAME/ZONE)" >&2; exit 2; }
    [ -n "$RUN_DIR" ] || { echo "launch_tpu.sh: set --run-dir to a path on a shared file system every worker mounts, or a URL (gs://...); a worker's own disk cannot hold a multi-host run" >&2; exit 2; }
fi
REPO_DIR=${REPO_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
NAME=${RUN_NAME:-$(basename "$RECIPE" .yaml)}
[[ "$NAME" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "launch_tpu.sh: RUN_NAME=$NAME names the log files; use letters, digits, . _ -" >&2; exit 2; }
LOG="\$HOME/olmo-logs/$NAME-\$(hostname).log"   # expanded on each worker
PID="\$HOME/olmo-logs/$NAME.pid"

# One shell word per argument, whatever it contains: as it is when plain, else in single quotes.
quote() {
    local a
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then printf '%s ' "$a"; else printf "'%s' " "${a//\'/\'\\\'\'}"; fi
    done
}
PLAN=(uv run --frozen olmo-plan "$RECIPE" --devices "$DEVICE:$DEVICES" "${OVERRIDES[@]}")
TRAIN=(uv run --frozen --no-sync olmo-train-jax "$RECIPE" --jax.distributed=true --run_dir="${RUN_DIR:-RUN_DIR}" "${OVERRIDES[@]}")
INSTALL="export PATH=\$HOME/.local/bin:\$PATH; command -v uv >/dev/null || python3 -m pip install --user uv; cd $(quote "$REPO_DIR")&& uv sync --frozen --package olmo-train-jax --no-dev --extra tpu"
# The inner shell records its PID (setsid made it a process-group leader) and becomes the trainer.
INNER="echo \$\$ > $PID; exec $(quote "${TRAIN[@]}")"
START="export PATH=\$HOME/.local/bin:\$PATH; mkdir -p \$HOME/olmo-logs && cd $(quote "$REPO_DIR")&& setsid nohup bash -c $(quote "$INNER")> $LOG 2>&1 < /dev/null &"
ON_ALL=(gcloud compute tpus tpu-vm ssh "${TPU_NAME:-TPU_NAME}" --zone "${ZONE:-ZONE}" --worker=all --command)
FOLLOW=(gcloud compute tpus tpu-vm ssh "${TPU_NAME:-TPU_NAME}" --zone "${ZONE:-ZONE}" --worker=0 --command "tail -f $LOG")
STOP=("${ON_ALL[@]}" "kill -- -\$(cat $PID)")

if [ "$DRY" = 1 ]; then
    echo "# plan: $DEVICE x $DEVICES JAX devices"
    quote "${PLAN[@]}"; echo
    echo "# install on every worker"
    quote "${ON_ALL[@]}" "$INSTALL"; echo
    echo "# start on every worker, detached"
    quote "${ON_ALL[@]}" "$START"; echo
    echo "# follow (worker 0; --worker=N for another)"
    quote "${FOLLOW[@]}"; echo
    echo "# stop"
    quote "${STOP[@]}"; echo
    exit 0
fi
"${PLAN[@]}"
"${ON_ALL[@]}" "$INSTALL"
"${ON_ALL[@]}" "$START"
echo "started on every worker of $TPU_NAME; run dir $RUN_DIR"
echo "follow: $(quote "${FOLLOW[@]}")"
echo "stop:   $(quote "${STOP[@]}")"

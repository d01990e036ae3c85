#!/bin/bash
# One node's part of recipes/slurm/train.sbatch: torchrun with a c10d rendezvous.
#   bash recipes/slurm/node.sh RECIPE.yaml [trainer flags]
# Reads NNODES, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT, RDZV_ID, SUBQ_ENTRY and SUBQ_LOG_DIR
# (train.sbatch exports them) and Slurm's SLURM_NODEID (else NODE_RANK) to name the log. torchrun
# gives every worker RANK, LOCAL_RANK and WORLD_SIZE, the only variables megatron reads; c10d
# assigns the ranks, so the nodes need no fixed order. The log's tee ignores SIGTERM: Slurm signals
# the whole task, and the workers must still be able to print while they save on the way out
# (--exit-signal-handler).
set -euo pipefail
RECIPE=$1
shift
NODE=${SLURM_NODEID:-${NODE_RANK:-0}}
LOG=${SUBQ_LOG_DIR:-logs}/node$NODE.attempt${SUBQ_ATTEMPT:-0}.log
mkdir -p "$(dirname "$LOG")"
echo "$(date -u +%FT%TZ) node $NODE ($(hostname)): torchrun --nnodes $NNODES" \
     "--nproc-per-node $GPUS_PER_NODE, log $LOG"
exec "${SUBQ_PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" \
    --max-restarts 0 \
    "${SUBQ_ENTRY:-examples/pretrain_gpt.py}" --config "$RECIPE" "$@" > >(trap '' TERM INT; exec tee -a "$LOG") 2>&1

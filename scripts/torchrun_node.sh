#!/usr/bin/env bash
# One node's share of a multi-node job: torchrun with a c10d rendezvous, NPROC_PER_NODE ranks here.
# scripts/pretrain_slurm.sbatch (LAUNCHER=torchrun) runs it once per node through srun; without SLURM,
# run it on each machine yourself (the two-node test runs it twice on one machine):
#   NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 RDZV_ENDPOINT=host0:29500 bash scripts/torchrun_node.sh <flags>
#   NNODES=2 NODE_RANK=1 NPROC_PER_NODE=8 RDZV_ENDPOINT=host0:29500 bash scripts/torchrun_node.sh <flags>
# RDZV_ID names the job (default: SLURM_JOB_ID, else megatron_zero); NODE_RANK defaults to SLURM_NODEID.
# The c10d rendezvous, not NODE_RANK, decides which ranks each node gets; pretrain_gpt.py gets
# --exit-signal-handler, and torchrun runs under scripts/pretrain_torchrun.sh, which passes SIGTERM on to
# the workers: every rank saves and exits 0.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${NNODES:?set NNODES, the number of nodes}" "${RDZV_ENDPOINT:?set RDZV_ENDPOINT to host:port of the first node}"
exec bash "$root/scripts/pretrain_torchrun.sh" --nnodes "$NNODES" --node_rank "${NODE_RANK:-${SLURM_NODEID:-0}}" \
    --nproc_per_node "${NPROC_PER_NODE:-1}" --rdzv_id "${RDZV_ID:-${SLURM_JOB_ID:-megatron_zero}}" \
    --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" "$root/pretrain_gpt.py" --exit-signal-handler "$@"

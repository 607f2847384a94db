#!/usr/bin/env bash
# Launch pretrain_gpt.py on this machine with torchrun.
#   NPROC=4 bash scripts/pretrain_local.sh --tensor-model-parallel-size 2 ... (any pretrain_gpt.py flags)
# NPROC ranks (default 4); MASTER_PORT picks the rendezvous port, else torchrun's standalone rendezvous binds
# a free one itself (port 0: no port is found first and then left for another job to take), so two jobs on
# one machine never share a port. SIGTERM to this script makes every rank stop after the current iteration,
# save a checkpoint (with --save) and exit 0 (scripts/pretrain_torchrun.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
if [ -n "${MASTER_PORT:-}" ]; then
    rendezvous=(--master_addr 127.0.0.1 --master_port "$MASTER_PORT")
else
    rendezvous=(--standalone)
fi
exec bash "$root/scripts/pretrain_torchrun.sh" --nproc_per_node "${NPROC:-4}" "${rendezvous[@]}" \
    "$root/pretrain_gpt.py" --exit-signal-handler "$@"

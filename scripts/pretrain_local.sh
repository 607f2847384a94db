#!/usr/bin/env bash
# Launch pretrain_gpt.py on this machine with torchrun.
#   NPROC=4 bash scripts/pretrain_local.sh --tensor-model-parallel-size 2 ... (any pretrain_gpt.py flags)
# NPROC ranks (default 4); MASTER_PORT picks the rendezvous port (default: a free one), so two
# jobs on one machine never share a port. SIGTERM to this script makes every rank stop after the
# current iteration, save a checkpoint (with --save) and exit 0 (scripts/pretrain_torchrun.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
py="$root/.venv/bin/python"
port=${MASTER_PORT:-$("$py" -c "from megatron_zero.testing.multirank import free_port; print(free_port())")}
exec bash "$root/scripts/pretrain_torchrun.sh" --nproc_per_node "${NPROC:-4}" --master_addr 127.0.0.1 \
    --master_port "$port" "$root/pretrain_gpt.py" --exit-signal-handler "$@"

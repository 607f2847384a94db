#!/usr/bin/env bash
# The main job (README, first command). Sets up .venv if needed, then runs the
# end-to-end demo on 4 CPU ranks. It grows with the project: today it launches
# 4 gloo ranks with torchrun and checks every process group of the TP2 x PP2 layout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh
port=${MASTER_PORT:-$(.venv/bin/python -c "from megatron_zero.testing.multirank import free_port; print(free_port())")}
.venv/bin/torchrun --nproc_per_node 4 --master_port "$port" tools/check_topology.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

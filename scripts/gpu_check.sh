#!/usr/bin/env bash
# The GPU acceptance run, one command on a machine with NVIDIA GPUs:
#   bash scripts/gpu_check.sh REPORT.md     install the wheels carried under .whl/ (offline), build the kernels in
#                                           place against this machine's torch, bench/bench_gpu.py (bf16, compiled,
#                                           FP8), a short training run per layout that fits the GPUs, a save and a
#                                           (reshaped / universal) resume, the gpu-marked tests, in that order; write REPORT.md (pass/fail per step, MFU, peak GPU memory, host
#                                           RSS), rewritten after every step
#   bash scripts/gpu_check.sh --budget 780 REPORT.md
#                                           the same within 780 s: each step's timeout cut to what is left, the
#                                           steps after the budget is spent listed in the report as not run
#   bash scripts/gpu_check.sh --plan N      list the steps for N GPUs without running anything
#                                           (also GPU_CHECK_DRY_RUN=1 GPU_CHECK_GPUS=N)
# Uses the machine's python (PYTHON=..., default python3) and its torch, not a virtual environment; nothing is
# downloaded. Ends with the report's path and a one-line summary. Exit status: 0 all steps passed, 1 a step
# failed, 2 bad usage, 3 no CUDA device (one sentence), 4 none failed but the budget left steps not run.
# The steps and the report: scripts/gpu_check.py.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-$(command -v python3 || command -v python || true)}"
if [ -z "$py" ]; then
    echo "gpu_check.sh: no python3 on PATH, so there is no torch and no CUDA to check; set PYTHON to a CUDA torch's python" >&2
    exit 3
fi
# ---- planner check: tools/plan.py's prediction against a measured run (peak memory, step time), appended to
# ${PLAN_CHECK_OUT:-plan_check.jsonl}; on a CUDA machine, not in a dry run; PLAN_CHECK=0 skips it -------------
if [ "${PLAN_CHECK:-1}" != 0 ] && [ -z "${GPU_CHECK_DRY_RUN:-}" ] && [[ " $* " != *" --plan "* ]] \
        && "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    timeout "${PLAN_CHECK_TIMEOUT:-240}" "$py" "$here/plan_check.py" --out "${PLAN_CHECK_OUT:-plan_check.jsonl}" \
        --iters 4 || echo "gpu_check.sh: scripts/plan_check.py did not finish; the check goes on" >&2
fi
# ---- end of the planner check -------------------------------------------------------------------------------
exec "$py" "$here/gpu_check.py" "$@"

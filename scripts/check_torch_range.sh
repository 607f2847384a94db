#!/usr/bin/env bash
# Check the package on another torch than the pinned one (setup.py declares torch>=2.4,<2.14; CI has
# only the pin). Builds a separate venv OUTSIDE the tree with that torch from PyPI, never installs the
# package into it (the tree is used through PYTHONPATH, so no kernels are built: ops use PyTorch), and runs
#   1. import megatron_zero
#   2. the single-process tests (-m "not multirank and not gpu"), less the two files below
#   3. a multi-rank subset: the reduce-scatter fallback, TP2 / PP2 / DP2 ZeRO parity, save/resume (ZeRO-3, async, TP2xPP2xDP2),
#      universal conversion and reshaped resume, pretrain_gpt.py through torchrun.
# Left out, and why (none is about the package's use of torch):
#   tests/test_deepspeed_config.py   imports deepspeed, a peer library not installed in this venv
#   tests/test_console_scripts.py    checks the console scripts `pip install` makes; nothing is installed
#   test_data_indexed_dataset.py's two Megatron-DeepSpeed file tests: they import megatron-core (a peer)
#   test_ops_cpu_adam.py's two tests of the built kernel: nothing is built here (BUILD_KERNELS=1 builds the
#     C++ CPU Adam against this torch into a temporary directory, runs test_ops_cpu_adam.py, removes it)
#
#   scripts/check_torch_range.sh [TORCH_VERSION]      default 2.4.1 (the lower end)
#   VENV=/path PYTHON=python3.11 scripts/check_torch_range.sh 2.13.0
# A CUDA torch from PyPI pulls its nvidia-* wheels (~3 GB). Exit status: pytest's, 1 for a failed step.
set -euo pipefail
torch_version="${1:-2.4.1}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-${TMPDIR:-/tmp}/megatron_zero_torch${torch_version}}"
case "$venv" in "$root"/*) echo "check_torch_range.sh: VENV=$venv is inside the tree; use a path outside it" >&2; exit 1;; esac
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
# what requirements.txt lists, torch at the version under test (no deepspeed, megatron-core, transformers)
"$venv/bin/python" -m pip install -q "torch==$torch_version" numpy sentencepiece "crc32c>=2.3" tensorboard \
    pytest "safetensors>=0.4,<1" "tokenizers>=0.20,<1"
got="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
echo "check_torch_range.sh: torch $got in $venv"

cd "$root"
export PYTHONPATH="$root" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$venv/bin/python" -c "import megatron_zero, megatron_zero.training.trainer, megatron_zero.checkpoint, megatron_zero.zero"

pytest=("$venv/bin/python" -m pytest -q -p no:cacheprovider -rfEs)
"${pytest[@]}" -m "not multirank and not gpu" tests \
    --ignore=tests/test_deepspeed_config.py --ignore=tests/test_console_scripts.py \
    --deselect tests/test_data_indexed_dataset.py::test_megatron_deepspeed_append_eod_files_read_with_each_eod \
    --deselect tests/test_data_indexed_dataset.py::test_extra_tokens_that_are_not_eods_are_still_refused \
    --deselect tests/test_ops_cpu_adam.py::test_cpu_adam_kernel_is_built \
    --deselect tests/test_ops_cpu_adam.py::test_rejects_mismatched_sizes_overlap_and_step_zero
if [ "${BUILD_KERNELS:-0}" = 1 ]; then
    if compgen -G "megatron_zero/_C_cpu_adam*.so" > /dev/null; then
        echo "check_torch_range.sh: megatron_zero/ already holds a built CPU Adam (for the pinned torch); run" \
             "BUILD_KERNELS=1 from a checkout without one (e.g. a git worktree)" >&2
        exit 1
    fi
    build="$(mktemp -d)"
    # JIT-built with setup.py's flags (csrc/extensions.py), CPU sources only: setup.py would also try the
    # CUDA kernels, which a CUDA torch refuses to build against a toolkit of another CUDA version
    "$venv/bin/python" - "$build" <<'PY'
import glob, sys
from torch.utils import cpp_extension
cpp_extension.load("_C_cpu_adam", sorted(glob.glob("csrc/cpu/*.cpp")), build_directory=sys.argv[1],
                   extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"],
                   extra_ldflags=["-fopenmp"])
PY
    so="$build/_C_cpu_adam.so"
    [ -f "$so" ] || { echo "check_torch_range.sh: the C++ CPU Adam did not build against torch $got" >&2; exit 1; }
    cp "$so" megatron_zero/
    trap 'rm -f megatron_zero/_C_cpu_adam.so; rm -rf "$build"' EXIT
    "${pytest[@]}" tests/test_ops_cpu_adam.py
    rm -f megatron_zero/_C_cpu_adam.so
fi
"${pytest[@]}" tests/test_reduce_scatter.py \
    "tests/test_model_parity.py::test_tp_matches_reference[2-exact]" \
    "tests/test_model_parity.py::test_tp_matches_reference[2-padded]" \
    "tests/test_model_parity.py::test_pipeline_stages_compose_to_the_whole_model" \
    "tests/test_pipeline_gpt.py::test_pipeline_matches_reference[1-2-1-4-None-False]" \
    "tests/test_pipeline_gpt.py::test_pipeline_matches_reference[2-2-2-2-None-False]" \
    "tests/test_pipeline_gpt.py::test_pipeline_matches_reference[2-1-1-2-None-True]" \
    "tests/test_zero_gpt.py::test_gpt_zero_matches_adamw[2]" \
    "tests/test_checkpoint_resume.py::test_resume_is_bit_identical[1-1-4-3-False]" \
    "tests/test_checkpoint_resume.py::test_resume_is_bit_identical[2-2-8-2-True]" \
    "tests/test_universal_checkpoint.py::test_universal_files" \
    "tests/test_universal_checkpoint.py::test_universal_resume[b-tp1pp1dp4]" \
    "tests/test_universal_checkpoint.py::test_universal_resume[f-zero3]" \
    "tests/test_universal_checkpoint.py::test_direct_reshaped_resume" \
    "tests/test_training_e2e.py::test_four_ranks_train_and_log_tensorboard" \
    "tests/test_training_e2e.py::test_sigterm_saves_and_exits_zero_then_resumes"
echo "check_torch_range.sh: torch $got passed"

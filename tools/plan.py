"""Predict memory per rank and step time of a layout, or search the layouts of a cluster, before launching.

    python tools/plan.py <pretrain_gpt.py's flags> --gpus 64 [--gpus-per-node 8 --gpu-memory 80
        --gpu-tflops 989 --intra-node-bandwidth 450 --inter-node-bandwidth 50 --host-memory 2048] [--json] [--search]

The model is built by the training code on fake tensors (megatron_zero/planning/): parameter counts and
model states are those of the run, activations those of a traced micro-batch; see docs/planning.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.planning.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""Pretrain a GPT with tensor, pipeline and ZeRO data parallelism (Megatron's flags).

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 256 ... --data-path PREFIX

See scripts/ for launchers (local torchrun, SLURM) and `--help` for every flag.
"""
import sys

from megatron_zero.training import pretrain

if __name__ == "__main__":
    sys.exit(pretrain(sys.argv[1:]))

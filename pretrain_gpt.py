"""Pretrain a GPT with tensor, pipeline and ZeRO data parallelism (Megatron's flags).

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 256 ... --data-path PREFIX

See scripts/ for launchers (local torchrun, SLURM) and `--help` for every flag.

The flags are parsed and checked before torch and the model are imported, so a bad flag is refused at once
(one sentence from rank 0, exit status 2); only then does training load (megatron_zero.training.trainer.pretrain).
"""
import sys

from megatron_zero.distributed.initialize import LaunchError, read_launch_env
from megatron_zero.elastic.restart import parse_for_launch


def main(argv) -> int:
    try:
        launch = read_launch_env()
    except LaunchError:
        args = None  # pretrain() says what is wrong with the environment, in one sentence
    else:
        args = parse_for_launch(argv, launch.rank, launch.world_size)  # a refusal: SystemExit(2)
    from megatron_zero.training import pretrain

    return pretrain(argv, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

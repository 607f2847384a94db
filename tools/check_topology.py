"""Launch under torchrun or srun: build every process group and check it with an all-reduce.

    torchrun --nproc_per_node 4 tools/check_topology.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2
"""
import argparse
import sys

import torch
import torch.distributed as dist

from megatron_zero.distributed import LaunchError, init_distributed, shutdown_distributed
from megatron_zero.topology import GROUP_KINDS, TopologyError, build_parallel_state


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        init_distributed()
        state = build_parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    except (LaunchError, TopologyError) as err:
        print(f"check_topology: {err}", file=sys.stderr)
        return 2
    lay, rank = state.layout, state.rank
    for kind in GROUP_KINDS:
        members = getattr(lay, f"{kind}_group")(rank)
        if rank in members:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=state.groups[kind])
            assert t.item() == sum(members), (kind, members, t.item())
    dist.barrier()
    pp, dp, tp = lay.coords(rank)
    print(f"rank {rank}: pp={pp} dp={dp} tp={tp} mp_rank={lay.mp_rank(rank)} "
          f"tp_group={lay.tp_group(rank)} dp_group={lay.dp_group(rank)} pp_group={lay.pp_group(rank)} ok",
          flush=True)
    state = None
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

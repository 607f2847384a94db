"""Launch under torchrun or srun: build every process group and check it with an all-reduce.

    torchrun --nproc_per_node 4 tools/check_topology.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2
    torchrun --nproc_per_node 8 tools/check_topology.py --tensor-model-parallel-size 2 \
        --expert-model-parallel-size 4 --expert-tensor-parallel-size 1

With --expert-model-parallel-size / --expert-tensor-parallel-size it also builds and checks the expert
groups (carved out of TP x DP as Megatron-Core does) and prints each rank's.
"""
import argparse
import sys

import torch
import torch.distributed as dist

from megatron_zero.distributed.initialize import LaunchError, init_distributed, shutdown_distributed
from megatron_zero.distributed.topology import GROUP_KINDS, TopologyError, build_parallel_state


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: TP")
    args = parser.parse_args(argv)
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    try:
        init_distributed()
        state = build_parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                     ep=ep, etp=etp)
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
    expert = ""
    if state.expert_dp_group is not None:
        kinds = ("ep", "expert_dp") + (("expert_tp",) if "expert_tp" in state.groups else ())
        for kind in kinds:
            members = getattr(lay, f"{kind}_group")(rank, ep, state.etp_size)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=state.groups[kind])
            assert t.item() == sum(members), (kind, members, t.item())
        etp_rank, ep_rank, edp_rank = lay.expert_coords(rank, ep, state.etp_size)
        expert = (f" etp={etp_rank} ep={ep_rank} edp={edp_rank} expert_tp_group="
                  f"{lay.expert_tp_group(rank, ep, state.etp_size)} ep_group={lay.ep_group(rank, ep, state.etp_size)} "
                  f"expert_dp_group={lay.expert_dp_group(rank, ep, state.etp_size)}")
    dist.barrier()
    pp, dp, tp = lay.coords(rank)
    print(f"rank {rank}: pp={pp} dp={dp} tp={tp} mp_rank={lay.mp_rank(rank)} "
          f"tp_group={lay.tp_group(rank)} dp_group={lay.dp_group(rank)} pp_group={lay.pp_group(rank)}{expert} ok",
          flush=True)
    state = None
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

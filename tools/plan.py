"""Predict memory per rank and step time of a layout, or search the layouts of a cluster, before launching.

    python tools/plan.py <pretrain_gpt.py's flags> --gpus 64 [--gpus-per-node 8 --gpu-memory 80
        --gpu-tflops 989 --intra-node-bandwidth 450 --inter-node-bandwidth 50 --host-memory 2048] [--json] [--search]

The model is built by the training code on fake tensors (megatron_zero/planning/): parameter counts and
model states are those of the run, activations those of a traced micro-batch; see docs/planning.md.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.planning import time_model  # noqa: E402


def cluster_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the cluster (default: the layout's)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--gpu-tflops", type=float, default=time_model.H100_BF16_TFLOPS, help="bf16 dense peak")
    p.add_argument("--intra-node-bandwidth", type=float, default=time_model.NVLINK_GBPS, help="GB/s per GPU")
    p.add_argument("--inter-node-bandwidth", type=float, default=time_model.IB_GBPS, help="GB/s per GPU")
    p.add_argument("--host-memory", type=float, default=2048.0, help="GiB per node")
    p.add_argument("--json", action="store_true")
    p.add_argument("--search", action="store_true", help="rank the layouts that fit by tokens/s")
    return p


def main(argv=None) -> int:
    from megatron_zero.arguments import parse_args
    from megatron_zero.config import from_args
    from megatron_zero.model.architecture import gpt_config
    from megatron_zero.planning import memory, report, search

    cluster_args, rest = cluster_parser().parse_known_args(argv)
    layout_gpus = _layout_gpus(rest)
    gpus = cluster_args.gpus or layout_gpus
    args = parse_args(rest, world_size=gpus)
    if args.vocab_size is None:
        print("plan.py: error: give --vocab-size (the tokenizer's vocabulary) to plan without loading a tokenizer",
              file=sys.stderr)
        return 2
    sections = from_args(args)
    par, opt = sections.parallel, sections.optimizer
    config = gpt_config(args, args.vocab_size)
    dtype = __import__("torch").bfloat16 if opt.bf16 else (__import__("torch").float16 if opt.fp16
                                                          else __import__("torch").float32)
    degrees = par.degrees()
    dp = gpus // (degrees["tp"] * degrees["pp"] * degrees["cp"])
    plan = memory.Plan(config, degrees["tp"], degrees["pp"], degrees["cp"], degrees["ep"], dp, opt.zero_stage,
                       par.micro_batch_size, par.global_batch_size, dtype, opt.offload,
                       getattr(args, "optimizer", "adam"), virtual_stages=par.virtual_pipeline_model_parallel_size)
    cluster = time_model.Cluster(gpus, cluster_args.gpus_per_node, cluster_args.gpu_memory, cluster_args.gpu_tflops,
                                 cluster_args.intra_node_bandwidth, cluster_args.inter_node_bandwidth,
                                 cluster_args.host_memory)
    recompute = "full" if config.recompute_granularity == "full" else (config.recompute_granularity or "none")
    cand = search.evaluate(plan, recompute, cluster, {}, fp8=bool(getattr(args, "fp8_format", None)))
    parameters = _model_parameters(plan)
    host = memory.host_bytes_per_node(cand.plan, list(cand.ranks), cluster.gpus_per_node)
    found = search.search(plan, cluster, offload=plan.offload != "none" or cluster_args.search and gpus == 1) \
        if cluster_args.search else []
    if cluster_args.json:
        object.__setattr__(cand, "total_parameters", parameters)
        print(report.as_json(cand, cluster, host, found))
    else:
        print(report.as_table(cand, cluster, host, parameters))
        if cluster_args.search:
            print(report.ranking(found))
    return 0


def _layout_gpus(argv) -> int:
    p = argparse.ArgumentParser(add_help=False)
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        p.add_argument(name, type=int, default=1)
    known, _ = p.parse_known_args(argv)
    return known.tensor_model_parallel_size * known.pipeline_model_parallel_size * known.context_parallel_size


def _model_parameters(plan) -> int:
    """The whole model's parameters, counted on the fake model of one process (TP = PP = EP = 1)."""
    from megatron_zero.planning.fake_rank import trace_rank
    whole = trace_rank(plan.config, dict(tp=1, pp=1, cp=1, ep=1, etp=None), 0, 1, plan.dtype, trace=False)
    return sum(k for _, k, _ in whole.params)


if __name__ == "__main__":
    sys.exit(main())

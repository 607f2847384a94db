"""tools/plan.py's command line: pretrain_gpt.py's own flags plus the cluster's; `python -m
megatron_zero.planning.cli` is the same (pretrain_gpt.py's start-up check runs it in a subprocess, since the
planner's fake process group cannot live beside the run's real one)."""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from ..config.fields import add_section_flags
from . import memory, report, search, time_model
from .fake_rank import Conversion
from .host_step import HostConfig


def cluster_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the cluster (default: the layout's)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--gpu-tflops", type=float, default=time_model.H100_BF16_TFLOPS,
                   help="bf16 dense peak TFLOP/s (FP8: FP8_SPEEDUP times that on the matmuls)")
    p.add_argument("--intra-node-bandwidth", type=float, default=time_model.NVLINK_GBPS, help="GB/s per GPU")
    p.add_argument("--inter-node-bandwidth", type=float, default=time_model.IB_GBPS, help="GB/s per GPU")
    p.add_argument("--host-memory", type=float, default=2048.0, help="GiB per node")
    add_section_flags(p, HostConfig)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--search", action="store_true", help="rank the layouts that fit by predicted tokens/s")
    return p


def _layout_gpus(argv) -> int:
    p = argparse.ArgumentParser(add_help=False)
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        p.add_argument(name, type=int, default=1)
    known, _ = p.parse_known_args(argv)
    return known.tensor_model_parallel_size * known.pipeline_model_parallel_size * known.context_parallel_size


def model_parameters(plan: memory.Plan) -> int:
    """The whole model's parameters, counted on the fake model of one process (TP = PP = EP = 1)."""
    from .fake_rank import trace_rank
    whole = trace_rank(plan.config, dict(tp=1, pp=1, cp=1, ep=1, etp=None), 0, 1, plan.dtype, trace=False)
    return sum(p.numel for p in whole.params)


def plan_from(sections, config, gpus: int) -> memory.Plan:
    """The Plan of a run: its checked configuration sections and its GPTConfig, on `gpus` GPUs."""
    par, opt = sections.parallel, sections.optimizer
    dtype = torch.bfloat16 if opt.bf16 else torch.float16 if opt.fp16 else torch.float32
    degrees = par.degrees()
    dp = gpus // (degrees["tp"] * degrees["pp"] * degrees["cp"])
    return memory.Plan(config, degrees["tp"], degrees["pp"], degrees["cp"], degrees["ep"], dp, opt.zero_stage,
                       par.micro_batch_size, par.global_batch_size, dtype, opt.offload,
                       sections.muon.optimizer, bucket_elements=opt.ddp_bucket_size,
                       persistence_threshold=opt.zero_param_persistence_threshold,
                       virtual_stages=par.virtual_pipeline_model_parallel_size, conversion=conversion(sections))


def conversion(sections) -> Conversion:
    """What the run's model converters change in a stage (model_converters.py reads the same sections): its FP8
    settings (fp8/settings.py; None without --fp8-format) and whether the output loss is fused."""
    fp8 = None
    if sections.fp8.fp8_format is not None:
        from ..fp8.settings import Float8Settings
        fp8 = Float8Settings.from_args(sections.fp8)
    return Conversion(fp8, sections.loss.cross_entropy_loss_fusion)


def main(argv=None) -> int:
    from ..arguments import parse_args
    from ..config import from_args
    from ..model.architecture import gpt_config

    cluster_args, rest = cluster_parser().parse_known_args(argv)
    if cluster_args.host_cores < 1 or cluster_args.pcie_bandwidth <= 0:
        print(f"plan.py: error: --host-cores {cluster_args.host_cores} and --pcie-bandwidth "
              f"{cluster_args.pcie_bandwidth} must be positive (cores per node, GB/s per GPU)", file=sys.stderr)
        return 2
    gpus = cluster_args.gpus or _layout_gpus(rest)
    args = parse_args(rest, world_size=gpus)
    if args.vocab_size is None:
        print("plan.py: error: give --vocab-size (the tokenizer's vocabulary) to plan without loading a tokenizer",
              file=sys.stderr)
        return 2
    plan_sections = from_args(args)
    plan = plan_from(plan_sections, gpt_config(args, args.vocab_size), gpus)
    cluster = time_model.Cluster(gpus, cluster_args.gpus_per_node, cluster_args.gpu_memory, cluster_args.gpu_tflops,
                                 cluster_args.intra_node_bandwidth, cluster_args.inter_node_bandwidth,
                                 cluster_args.host_memory, host_cores=cluster_args.host_cores,
                                 pcie_gbps=cluster_args.pcie_bandwidth)
    recompute = plan.config.recompute_granularity or "none"
    fp8 = plan_sections.fp8.fp8_format is not None
    with contextlib.redirect_stdout(sys.stderr):  # what the traced model code says is not the plan (--json)
        cand = search.evaluate(plan, recompute, cluster, fp8=fp8)
        parameters = model_parameters(plan)
        host = memory.host_bytes_per_node(cand.plan, list(cand.ranks), cluster.gpus_per_node)
        found = search.search(plan, cluster, offload=plan.offload != "none" or gpus == 1, fp8=fp8) \
            if cluster_args.search else []
    if cluster_args.json:
        print(report.as_json(cand, cluster, host, parameters, found))
    else:
        print(report.as_table(cand, cluster, host, parameters))
        if cluster_args.search:
            print(report.ranking(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())

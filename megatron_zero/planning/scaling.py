"""The scaling tables of docs/planning.md: predicted tokens/s per GPU and MFU of the Llama-3 family and
DeepSeek-V3 from 8 to 16,384 GPUs, weak scaling (a fixed batch per DP rank) and strong scaling (a fixed global
batch), and the same time model at the layouts of published runs, set beside their figures. Each row is one
layout (no search) with time_model.py's constants; parameters per stage from the model code (fake_rank.py).

    python -m megatron_zero.planning.scaling     # prints the page's three tables
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch

from ..checkpoint.export.hf import deepseek_v3
from ..model.config import GPTConfig
from .fake_rank import stage_params
from .memory import Plan
from .time_model import Cluster, step_time

LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, vocab_size=128256, seq_length=8192,
             max_position_embeddings=8192, hidden_dropout=0.0, attention_dropout=0.0)
# DeepSeek-V3's released config.json (its model keys), as tools/convert_to_hf.py's importer reads it: multi-latent
# attention, 61 blocks of which the first 3 dense, 256 routed experts (top-8 from 4 of 8 groups) and one shared
DEEPSEEK_V3_CONFIG = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                          num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                          n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                          qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                          num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
                          max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
                          tie_word_embeddings=False,
                          rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                                            original_max_position_embeddings=4096, type="yarn"))


def deepseek_v3_config() -> GPTConfig:
    """DeepSeek-V3 as pre-trained: seq 4096, one multi-token-prediction depth (the report's D = 1)."""
    return dataclasses.replace(deepseek_v3.config_from_hf(DEEPSEEK_V3_CONFIG), seq_length=4096,
                               max_position_embeddings=4096, mtp_num_layers=1)


MODELS = {
    "Llama-3-8B": lambda: GPTConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                    ffn_hidden_size=14336, **LLAMA),
    "Llama-3-70B": lambda: GPTConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                                     ffn_hidden_size=28672, **LLAMA),
    "Llama-3-405B": lambda: GPTConfig(num_layers=126, hidden_size=16384, num_attention_heads=128,
                                      num_query_groups=8, ffn_hidden_size=53248, **LLAMA),
    "DeepSeek-V3": deepseek_v3_config,
}


class Layout(NamedTuple):
    tp: int = 1
    pp: int = 1
    vp: int = 1        # virtual pipeline stages (interleaved 1F1B, --num-layers-per-virtual-pipeline-stage)
    ep: int = 1
    cp: int = 1
    zero: int = 1
    mb: int = 1        # micro-batch size

    def describe(self, dp: int) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + ([f"VP{self.vp}"] if self.vp > 1 else []) \
            + ([f"CP{self.cp}"] if self.cp > 1 else []) + [f"DP{dp}"] + ([f"EP{self.ep}"] if self.ep > 1 else [])
        return " ".join(parts) + (f" ZeRO-{self.zero}" if self.zero != 1 else "") \
            + (f" mb{self.mb}" if self.mb > 1 else "")


# weak scaling: (model, layout, sequences per DP rank and step, GPUs)
WEAK = (("Llama-3-8B", Layout(), 8, (8, 64, 1024, 16384)),
        ("Llama-3-70B", Layout(tp=4, pp=8, vp=5), 16, (64, 1024, 16384)),
        ("Llama-3-405B", Layout(tp=8, pp=14, vp=3), 32, (1792, 7168, 14336)),
        ("DeepSeek-V3", Layout(pp=16, ep=64), 32, (1024, 2048, 16384)))
# strong scaling: (model, layout, global batch in sequences, GPUs)
STRONG = (("Llama-3-8B", Layout(), 1024, (8, 64, 512, 1024)),
          ("Llama-3-70B", Layout(tp=4, pp=8, vp=5), 512, (64, 256, 1024, 4096, 16384)),
          ("Llama-3-405B", Layout(tp=8, pp=14, vp=3), 2048, (1792, 7168, 14336)),
          ("DeepSeek-V3", Layout(pp=16, ep=64), 15360, (1024, 2048, 16384)))
H800 = dict(intra_node_gbps=160.0, inter_node_gbps=50.0)  # DeepSeek-V3 report, section 3.1: NVLink 160, IB 50 GB/s


class Published(NamedTuple):
    source: str            # who, what, where
    model: str
    gpus: int
    layout: Layout
    global_batch: int      # sequences
    recompute: Optional[str]
    fp8: bool
    figure: float          # tokens/s per GPU, or MFU (a fraction) where `mfu`
    why: str               # what differs; {comm}: the exposed communication's share of our step, in %
    mfu: bool = False
    cluster: dict = {}


TORCHTITAN = "torchtitan's benchmarks/llama3_h100_202412_torchtitan.md"
NEMO = "Megatron-Bridge's docs/performance-summary.md, DGX-H100"
PUBLISHED = (
    Published(f"{TORCHTITAN}, table 1: Llama-3.1-8B, FSDP, bf16, selective recompute", "Llama-3-8B", 8,
              Layout(zero=3, mb=2), 16, None, False, 5762,
              "torchtitan's H100s ran at 500 W with HBM2e, below the 989 TFLOP/s peak assumed here (their footnote); "
              "our efficiency is our own H200 run's 46.2 % MFU"),
    Published("the same, table 3: 128 GPUs", "Llama-3-8B", 128, Layout(zero=3, mb=2), 256, None, False, 5605,
              "agrees for a wrong reason: ours loses 24 % from 8 to 128 GPUs (ZeRO-3's gathers and reduce-scatter "
              "over InfiniBand, DP_EXPOSED of them exposed), torchtitan 2.7 %: FSDP2's prefetch hides more"),
    Published("the same, table 4: Llama-3.1-70B, FSDP 32 x TP 8, FP8, async TP, full recompute", "Llama-3-70B", 256,
              Layout(tp=8, zero=3, mb=16), 512, "full", True, 876,
              "FP8 at the data sheet's speed-up (FP8_SPEEDUP, FP8_MATMUL_SHARE: not measured); async TP hides the "
              "TP all-reduces ours exposes; their GPUs' lower peak"),
    Published("the same, table 5: Llama-3.1-405B, FSDP 8 x TP 8 x PP 8, FP8, async TP, 1F1B, full recompute",
              "Llama-3-405B", 512, Layout(tp=8, pp=8, mb=1), 256, "full", True, 100,
              "their GPUs' lower peak (the 8B row: 1.42) and FP8 as above; ours runs ZeRO-1 in the pipeline "
              "(ZeRO-3 is not offered with PP) with the same 32 micro-batches of 1"),
    Published(f"{NEMO}, 25.11: Llama-3-8B, FSDP, FP8-CS", "Llama-3-8B", 8, Layout(zero=3), 128, None, True, 14451,
              "FP8 at the data sheet's speed-up"),
    Published("the same: Llama-3-70B, TP4 PP8 VP5, FP8-CS", "Llama-3-70B", 64, Layout(tp=4, pp=8, vp=5), 128,
              None, True, 1602, "as the 8B row; Megatron-Core overlaps the TP collectives with the GEMMs "
              "(--tp-comm-overlap, not in our code), ours exposes them"),
    Published("the same: Llama-3.1-405B, TP8 PP8 CP2 VP8, FP8-CS (ours without VP8: 126 layers do not split into "
              "8 x 8 virtual stages)", "Llama-3-405B", 1024, Layout(tp=8, pp=8, cp=2), 512, None, True, 292,
              "as the 70B row, and our plain 1F1B's bubble is 7 / 64 of the compute where VP8 makes it 7 / 512"),
    Published(f"{NEMO}, 25.09: DeepSeek-V3, TP2 PP8 VP4 EP64, FP8 blockwise, dropless, balanced routing (ours "
              "without VP4: 61 layers do not split into 8 x 4 virtual stages)", "DeepSeek-V3", 1024,
              Layout(tp=2, pp=8, ep=64), 8192, None, True, 1297,
              "Megatron-Core overlaps the experts' all-to-alls with another micro-batch's compute; ours exposes "
              "them, over InfiniBand once EP spans nodes: they are {comm:.0f} % of our step"),
    Published("Llama 3 paper (Dubey et al. 2024), table 4: 405B on 8,192 GPUs, TP8 PP16 DP64, bf16, 16M tokens a "
              "step, MFU (ours: DP64 with the same batch per DP rank on TP8 PP14 VP3, where 126 layers split evenly)",
              "Llama-3-405B", 7168, Layout(tp=8, pp=14, vp=3), 2048, None, False, 0.43,
              "Meta overlaps the TP communication, ours exposes it", mfu=True),
    Published("the same on 16,384 GPUs, DP128: strong scaling (ours: DP128, 14,336 GPUs)", "Llama-3-405B", 14336,
              Layout(tp=8, pp=14, vp=3), 2048, None, False, 0.41,
              "as above; halving the micro-batches a DP rank doubles our bubble's share", mfu=True),
    Published("DeepSeek-V3 report, table 1 and section 3: 2.664M H800 GPU hours of pre-training for 14.8T tokens, "
              "PP16 EP64 ZeRO-1, FP8, DualPipe, batch 15,360 x 4,096", "DeepSeek-V3", 2048, Layout(pp=16, ep=64),
              15360, None, True, 14.8e12 / (2.664e6 * 3600),
              "DualPipe hides the all-to-alls behind compute and dispatches in FP8 to at most 4 nodes a token; ours "
              "sends 8 bf16 copies a token over IB, exposed ({comm:.0f} % of our step); H800's NVLink (160 GB/s) and IB "
              "(50 GB/s) as the report gives them", cluster=H800),
)


@functools.lru_cache(maxsize=None)
def _stage_parameters(model: str, layout: Layout) -> int:
    """The largest pipeline stage's parameters (first or last), built by the model code on fake tensors."""
    config = MODELS[model]()
    degrees = dict(tp=layout.tp, pp=layout.pp, cp=1, ep=layout.ep, etp=None)
    ranks = {0, layout.pp - 1}
    return max(sum(p.numel for p in stage_params(config, degrees, r, torch.bfloat16, virtual_stages=layout.vp))
               for r in ranks)


def predict(model: str, layout: Layout, gpus: int, global_batch: int, recompute: Optional[str] = None,
            fp8: bool = False, **cluster):
    config = MODELS[model]()
    if recompute == "full":
        config = dataclasses.replace(config, recompute_granularity="full", recompute_method="uniform")
    dp = gpus // (layout.tp * layout.pp * layout.cp)
    plan = Plan(config, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, dp=dp, zero_stage=layout.zero,
                micro_batch=layout.mb, global_batch=global_batch, virtual_stages=layout.vp)
    return dp, step_time(plan, Cluster(gpus=gpus, **cluster), _stage_parameters(model, layout), recompute, fp8)


def _row(model, layout, gpus, global_batch) -> str:
    dp, t = predict(model, layout, gpus, global_batch)
    return (f"| {model} | {gpus:,} | {layout.describe(dp)} | {global_batch:,} | {t.tokens_per_second / gpus:,.0f} "
            f"| {100 * t.mfu:.1f} % |")


HEAD = ("| model | GPUs | layout | global batch | tokens/s per GPU | MFU |", "|---|---:|---|---:|---:|---:|")


def weak_table() -> str:
    return "\n".join([*HEAD, *(_row(m, lay, g, per_dp * (g // (lay.tp * lay.pp * lay.cp)))
                               for m, lay, per_dp, gpus in WEAK for g in gpus)])


def strong_table() -> str:
    return "\n".join([*HEAD, *(_row(m, lay, g, batch) for m, lay, batch, gpus in STRONG for g in gpus)])


def published_table() -> str:
    lines = ["| published | GPUs | figure | ours | ours / figure | within 20 %? | what differs |",
             "|---|---:|---:|---:|---:|---|---|"]
    for p in PUBLISHED:
        _, t = predict(p.model, p.layout, p.gpus, p.global_batch, p.recompute, p.fp8, **p.cluster)
        ours = t.mfu if p.mfu else t.tokens_per_second / p.gpus
        shown = (lambda v: f"{100 * v:.1f} % MFU") if p.mfu else (lambda v: f"{v:,.0f} tokens/s")
        ratio = ours / p.figure
        verdict = "yes" if abs(ratio - 1) <= 0.2 else "no"
        lines.append(f"| {p.source} | {p.gpus:,} | {shown(p.figure)} | {shown(ours)} | {ratio:.2f} | {verdict} "
                     f"| {p.why.format(comm=100 * t.exposed_comm / t.seconds)} |")
    return "\n".join(lines)


def tables() -> str:
    return "\n\n".join((weak_table(), strong_table(), published_table()))


if __name__ == "__main__":
    print(tables())

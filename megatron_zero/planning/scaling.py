"""The scaling table of docs/planning.md: predicted tokens/s per GPU and MFU of the Llama-3 family and a
DeepSeek-V3-class MoE from 8 to 16,384 GPUs, weak scaling (a fixed batch per DP rank), each model at one
fixed layout of the published runs' kind (no search), H100 defaults of time_model.py.

    python -m megatron_zero.planning.scaling     # prints the markdown table
"""
from __future__ import annotations

import torch

from ..model.config import GPTConfig
from .fake_rank import trace_rank
from .memory import Plan
from .time_model import Cluster, step_time

LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, vocab_size=128256, seq_length=8192,
             max_position_embeddings=8192, hidden_dropout=0.0, attention_dropout=0.0)
MODELS = {  # name -> (config, tp, pp, ep, micro-batches per DP rank)
    "Llama-3-8B": (GPTConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             ffn_hidden_size=14336, **LLAMA), 1, 1, 1, 8),
    "Llama-3-70B": (GPTConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                              ffn_hidden_size=28672, **LLAMA), 8, 4, 1, 16),
    "Llama-3-405B": (GPTConfig(num_layers=126, hidden_size=16384, num_attention_heads=128, num_query_groups=8,
                               ffn_hidden_size=53248, **LLAMA), 8, 14, 1, 32),
    # DeepSeek-V3's shape with grouped-query attention for MLA (not yet in the model code): 61 layers, 256
    # routed experts of width 2048, top-8, one shared expert, seq 4096
    "DeepSeek-V3-class": (GPTConfig(num_layers=61, hidden_size=7168, num_attention_heads=128, num_query_groups=8,
                                    ffn_hidden_size=18432, num_experts=256, moe_ffn_hidden_size=2048,
                                    moe_router_topk=8, moe_shared_expert_intermediate_size=2048,
                                    **{**LLAMA, "vocab_size": 129280, "seq_length": 4096,
                                       "max_position_embeddings": 4096}), 1, 16, 64, 32),
}
GPUS = (8, 64, 512, 1024, 1792, 4096, 7168, 16384)


def rows():
    for name, (config, tp, pp, ep, per_dp) in MODELS.items():
        mp = tp * pp
        stage = None
        for gpus in GPUS:
            if gpus % mp or gpus // mp < ep:
                continue
            dp = gpus // mp
            if stage is None:
                traced = trace_rank(config, dict(tp=tp, pp=pp, cp=1, ep=min(ep, dp), etp=None), 0, 1,
                                    torch.bfloat16, trace=False)
                stage = sum(p.numel for p in traced.params)
            plan = Plan(config, tp=tp, pp=pp, ep=min(ep, dp), dp=dp, zero_stage=1, micro_batch=1,
                        global_batch=dp * per_dp)
            t = step_time(plan, Cluster(gpus=gpus), stage)
            yield name, gpus, f"TP{tp} PP{pp} DP{dp}" + (f" EP{min(ep, dp)}" if ep > 1 else ""), \
                t.tokens_per_second / gpus, t.mfu


def table() -> str:
    lines = ["| model | GPUs | layout | tokens/s per GPU | MFU |", "|---|---:|---|---:|---:|"]
    for name, gpus, layout, tps, mfu in rows():
        lines.append(f"| {name} | {gpus:,} | {layout} | {tps:,.0f} | {100 * mfu:.1f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())

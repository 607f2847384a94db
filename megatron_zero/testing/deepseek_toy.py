"""The DeepSeek-V3-shaped toy every DeepSeek test trains through pretrain_gpt.py: the tiny Llama of cli.py with
DeepSeek-V3's pieces at toy sizes, in Megatron-LM's flags.

    attention   multi-latent (q and kv LoRA ranks, their norms through --qk-layernorm, the decoupled RoPE part,
                YaRN scaling)
    router      sigmoid scores, the aux-loss-free expert bias, 8 experts in 4 groups of which a token's best 2,
                top-2 scaled by 2.5, the sequence-level aux loss, the router's GEMM in fp32
    experts     a shared expert beside them; the first block dense (--moe-layer-freq "[0]+[1]*1")
    MTP         one depth, built as the last block: an MoE layer

    flags = deepseek_toy_flags(data, cache, {"expert-model-parallel-size": 2})
    config = deepseek_toy_config(100, **{"seq-length": 8})   # the model those flags build, for in-process runs
    rtol = deepseek_toy_rtol()        # a step's roundoff bound on the logged losses of two layouts
"""
from __future__ import annotations

from typing import List

from .cli import TINY, cli_flags

DEEPSEEK_TOY = {
    # multi-latent attention (replacing the Llama's grouped-query attention), YaRN by default with it
    "multi-latent-attention": True, "q-lora-rank": 16, "kv-lora-rank": 12, "qk-head-dim": 8,
    "qk-pos-emb-head-dim": 4, "v-head-dim": 6, "qk-layernorm": True, "rotary-scaling-factor": 4.0,
    "mscale": 0.707, "mscale-all-dim": 0.707, "original-max-position-embeddings": 8,
    "group-query-attention": None, "num-query-groups": None,
    # DeepSeek-V3's router and experts
    "num-experts": 8, "moe-router-topk": 2, "moe-ffn-hidden-size": 16, "moe-shared-expert-intermediate-size": 16,
    "moe-router-score-function": "sigmoid", "moe-router-enable-expert-bias": True,
    "moe-router-bias-update-rate": 0.01, "moe-router-num-groups": 4, "moe-router-group-topk": 2,
    "moe-router-topk-scaling-factor": 2.5, "moe-router-load-balancing-type": "seq_aux_loss",
    "moe-aux-loss-coeff": 1e-3, "moe-router-dtype": "fp32", "moe-layer-freq": "[0]+[1]*1",
    # one multi-token prediction depth (an MoE layer: the last block is one)
    "mtp-num-layers": 1,
}


def deepseek_toy_flags(data: str, cache: str, *changes: dict) -> List[str]:
    """pretrain_gpt.py's flags of the toy on `data`, then each dict of `changes` (cli_flags' order)."""
    return cli_flags(data, cache, "llama", DEEPSEEK_TOY, *changes)


def deepseek_toy_config(vocab_size: int = 257, **changes):
    """The GPTConfig pretrain_gpt.py builds from the toy's flags (with `changes`: flag -> value) for `vocab_size`
    (257: the ByteTokenizer's)."""
    from ..arguments import parse_args
    from ..model.architecture import gpt_config

    args = parse_args(deepseek_toy_flags("unused", "unused", {"train-iters": 1, **changes}), world_size=1)
    return gpt_config(args, vocab_size)


def deepseek_toy_rtol() -> float:
    """The logged losses' tolerance between two layouts: one step's summation path of the toy (its blocks and
    the MTP depth, tolerances.mtp_path_length) over a global batch."""
    from .tolerances import model_rtol, mtp_path_length

    return model_rtol(mtp_path_length(deepseek_toy_config(), TINY["global-batch-size"] * TINY["seq-length"]))



# Megatron-LM's examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh MODEL_ARGS in its order, the sizes
# (layers, widths, heads, ranks, experts, top-k and groups, sequence) cut to a toy, the dense first layers with them
# ([0]*3+[1]*58 -> [0]*1+[1]*3), the tokenizer the byte-level one; every other flag as the script has it
MEGATRON_DEEPSEEK_R1 = """
    --save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear
    --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm
    --swiglu --num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --kv-channels 8
    --multi-latent-attention --kv-lora-rank 12 --v-head-dim 8 --q-lora-rank 16 --qk-head-dim 8 --qk-layernorm
    --qk-pos-emb-head-dim 4 --num-experts 8 --moe-layer-freq [0]*1+[1]*3 --moe-ffn-hidden-size 16
    --moe-router-dtype fp32 --moe-router-score-function sigmoid --moe-router-bias-update-rate 1e-3
    --moe-router-enable-expert-bias --moe-router-topk 2 --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 16
    --moe-shared-expert-overlap --moe-aux-loss-coeff 1e-4 --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
    --moe-token-drop-policy probs --seq-length 16 --max-position-embeddings 163840 --tokenizer-type ByteTokenizer
    --make-vocab-size-divisible-by 1280 --use-mcore-models --rotary-base 10000 --rotary-percent 1.0
    --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --recompute-activations --moe-layer-recompute
    --sequence-parallel
""".split()


SEQ_AUX = dict(batch=3, seq=4, experts=4, topk=2)  # 12 tokens, 6 a TP rank: rank 0 holds sequence 0 and half of 1


def seq_aux_route(sequence_parallel: bool):
    """The sigmoid router's sequence-level aux loss (its tracked value) and the logits' gradient through it alone,
    on SEQ_AUX's fixed logits: all rows here, or (`sequence_parallel`, 2 ranks) this rank's share of the batch-major
    rows with the world as the TP group, a share that crosses a sequence."""
    import torch
    import torch.distributed as dist

    from ..moe.router import aux_losses, reset_aux_losses, route, set_aux_loss_scale

    b, s, e, k = SEQ_AUX["batch"], SEQ_AUX["seq"], SEQ_AUX["experts"], SEQ_AUX["topk"]
    rank = dist.get_rank() if sequence_parallel else 0
    rows = slice(rank * b * s // 2, (rank + 1) * b * s // 2) if sequence_parallel else slice(None)
    logits = torch.randn(b * s, e, generator=torch.Generator().manual_seed(0))[rows].clone().requires_grad_()
    set_aux_loss_scale(1.0)
    reset_aux_losses()
    weights, _ = route(logits, k, False, "seq_aux_loss", 1e-2, None, "sigmoid", None, b, True, None,
                       dist.group.WORLD if sequence_parallel else None)
    (weights * 0).sum().backward()
    return float(aux_losses()["seq_load_balancing_loss"]), logits.grad

"""The model FLOPs that the log's TFLOP/s and MFU and tools/plan.py's step time count (metrics/throughput.py) equal
Megatron-LM's count for the same pretrain_gpt.py flags: DeepSeek-V3 (dense first layers, a shared expert, MLA, one MTP
depth), Qwen3-MoE (GQA with kv_channels x heads != hidden) and Llama-3 at their published sizes, and the DeepSeek-V3
toy (arithmetic only: no model is built).

Megatron-LM's count is its megatron/training/training.py `num_floating_point_operations` at tag core_v0.16.1
(55ac708; that package is not on PyPI), evaluated on these flags as Megatron-LM parses them (vocabulary padded to a
multiple of 128), global batch 1024: MEGATRON_LM_FLOPS. A change to a model's flags here needs its value re-taken
from that function."""
import pytest

from megatron_zero.arguments import parse_args
from megatron_zero.metrics.throughput import model_flops_per_iteration
from megatron_zero.model.architecture import gpt_config
from megatron_zero.testing.cli import cli_flags
from megatron_zero.testing.deepseek_toy import DEEPSEEK_TOY

LLAMA3_8B = {"num-layers": 32, "hidden-size": 4096, "num-attention-heads": 32, "num-query-groups": 8,
             "ffn-hidden-size": 14336, "seq-length": 8192, "max-position-embeddings": 8192}
QWEN3_30B_A3B = {"num-layers": 48, "hidden-size": 2048, "num-attention-heads": 32, "num-query-groups": 4,
                 "kv-channels": 128, "qk-layernorm": True, "ffn-hidden-size": 6144, "num-experts": 128,
                 "moe-router-topk": 8, "moe-ffn-hidden-size": 768, "moe-layer-freq": "([1]*48)", "seq-length": 4096,
                 "max-position-embeddings": 4096}
# Megatron-LM's DeepSeek-R1.sh model sizes (examples/post_training/modelopt/conf/deepseek-ai/), MTP as DeepSeek-V3's
DEEPSEEK_V3 = {**DEEPSEEK_TOY, "num-layers": 61, "hidden-size": 7168, "ffn-hidden-size": 18432,
               "num-attention-heads": 128, "kv-channels": 128, "q-lora-rank": 1536, "kv-lora-rank": 512,
               "qk-head-dim": 128, "qk-pos-emb-head-dim": 64, "v-head-dim": 128, "num-experts": 256,
               "moe-layer-freq": "[0]*3+[1]*58", "moe-ffn-hidden-size": 2048, "moe-shared-expert-intermediate-size": 2048,
               "moe-router-topk": 8, "moe-router-num-groups": 8, "moe-router-group-topk": 4, "seq-length": 4096,
               "max-position-embeddings": 4096, "original-max-position-embeddings": 4096, "mtp-num-layers": 1}
MEGATRON_LM_FLOPS = {"deepseek_v3": 1090489473445134336, "deepseek_v3_toy": 5267914752,
                     "llama3_8b": 431765022088101888, "qwen3_30b_a3b": 96495339476877312}
MODELS = {"llama3_8b": (LLAMA3_8B, 128256), "qwen3_30b_a3b": (QWEN3_30B_A3B, 151936),
          "deepseek_v3": (DEEPSEEK_V3, 129280),
          # the toy: its dense first layer's MLP (64) narrower than an MoE layer's (2 x 16 + 16 shared)
          "deepseek_v3_toy": ({**DEEPSEEK_TOY, "ffn-hidden-size": 64}, 257)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flops_equal_megatron_lms_count(name):
    changes, vocab = MODELS[name]
    argv = cli_flags("unused", "unused", "llama", changes, {"train-iters": 1, "global-batch-size": 1024})
    ours = model_flops_per_iteration(gpt_config(parse_args(argv, world_size=1), vocab), 1024)
    megatron = MEGATRON_LM_FLOPS[name]
    assert abs(ours - megatron) <= 1e-12 * megatron, (name, ours, megatron)

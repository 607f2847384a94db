"""Multi-latent attention against grouped-query attention at equal parameters: training tokens/s and the
activation bytes a step keeps for backward, on the CPU in fp32.

    .venv/bin/python bench/bench_mla.py [--seq 512] [--layers 2] [--hidden 512] [--heads 8] [--reps 5]

Both models are the transformer blocks of the Llama family (RMSNorm, RoPE, SwiGLU, no embedding or logits),
one process, one micro-batch [1, s, h], forward and backward. The baseline is GQA with hidden / heads per
head and 4 query groups; the MLA model (DeepSeek-V3's shape scaled down: qk head 64, rotary part 32, v head
64, kv latent 128, latent norms, YaRN) takes the q latent rank that gives it the baseline's parameter count
(printed: equal within a few hundred). Timed steps alternate between the two models, `--reps` each after a
warm-up; the table shows the median and the ratio to GQA. Activation bytes: the distinct storages autograd
saves for backward during the forward (torch.autograd.graph.saved_tensors_hooks), the same every run.
"""
import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_zero.model.config import GPTConfig  # noqa: E402
from megatron_zero.model.gpt import GPTModel  # noqa: E402
from megatron_zero.model.layer_indices import block_layer_index  # noqa: E402

LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
             hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True)
MLA = dict(multi_latent_attention=True, kv_lora_rank=128, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64,
           qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
           original_max_position_embeddings=128)


def blocks(config: GPTConfig) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(config, None, layer_indices=range(block_layer_index(0), block_layer_index(config.num_layers)))


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def configs(a):
    common = dict(vocab_size=1024, hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=a.heads,
                  seq_length=a.seq, max_position_embeddings=a.seq, ffn_hidden_size=4 * a.hidden, **LLAMA)
    gqa = GPTConfig(num_query_groups=4, **common)
    target = params(blocks(gqa))
    def mla(rank):
        return GPTConfig(q_lora_rank=rank, **MLA, **common)
    low = params(blocks(mla(16)))
    per_rank = params(blocks(mla(17))) - low  # the count grows linearly in the q latent's rank
    return gqa, mla(16 + round((target - low) / per_rank))


def saved_bytes(model, x) -> int:
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return sum(seen.values())


def step_seconds(model, x) -> float:
    start = time.perf_counter()
    model(x).sum().backward()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    gqa, mla = configs(a)
    models = {"GQA (4 groups)": blocks(gqa), f"MLA (q latent {mla.q_lora_rank})": blocks(mla)}
    x = torch.randn(1, a.seq, a.hidden, requires_grad=True)
    memory = {name: saved_bytes(m, x) for name, m in models.items()}
    times = {name: [] for name in models}
    for _ in range(a.reps):
        for name, m in models.items():
            times[name].append(step_seconds(m, x))
    base = next(iter(models))
    print(f"\nseq {a.seq}, {a.layers} layers, hidden {a.hidden}, {a.heads} heads, fp32, forward + backward")
    print("| attention | params | tokens/s | ratio | saved MiB | ratio |\n|---|---|---|---|---|---|")
    for name, m in models.items():
        tps = a.seq / statistics.median(times[name])
        base_tps = a.seq / statistics.median(times[base])
        print(f"| {name} | {params(m):,} | {tps:,.0f} | {tps / base_tps:.2f} | {memory[name] / 2**20:.1f} | "
              f"{memory[name] / memory[base]:.2f} |")


if __name__ == "__main__":
    main()

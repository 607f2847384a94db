"""The flags tools/convert_from_hf.py prints (and writes to megatron_flags.txt) build the Hugging Face model itself:
parsed by pretrain_gpt.py's own parser, every model setting (sizes, architecture switches, epsilon, dropout,
init std) equals what the HF config says, so nothing is left at a Megatron default that differs from it (HF
Llama trains without dropout, our defaults are 0.1). Tiny random models are built with transformers here."""
import json
import shlex
from dataclasses import fields

import pytest
import torch

from megatron_zero.arguments import parse_args
from megatron_zero.checkpoint.export.hf import for_hf_config
from megatron_zero.model.architecture import ARCHITECTURE_FIELDS, architecture_kwargs
from megatron_zero.model.config import GPTConfig
from tools import convert_from_hf

transformers = pytest.importorskip("transformers")

NOT_FROM_HF = {"vocab_size", "params_dtype", "seed", "make_vocab_size_divisible_by", "recompute_granularity",
               "recompute_method", "recompute_num_layers", "attention_backend", "sequence_parallel",
               "moe_use_rts"}  # random token selection: no flag sets it (Megatron-DeepSpeed keeps DeepSpeed's default)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=5000.0,
        initializer_range=0.01)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=32, sliding_window=16, attention_dropout=0.05)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=40)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.2, embd_pdrop=0.2,
        attn_pdrop=0.0, layer_norm_epsilon=1e-6)),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_printed_flags_build_the_hf_model(tmp_path, kind, capsys):
    torch.manual_seed(0)
    src, ckpt = tmp_path / kind, tmp_path / "ckpt"
    MODELS[kind]().save_pretrained(src)
    capsys.readouterr()
    assert convert_from_hf.main(["--input-dir", str(src), "--output-dir", str(ckpt),
                                 "--tensor-model-parallel-size", "2"]) == 0  # the tool's main, in this process
    printed = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == shlex.split(open(ckpt / "megatron_flags.txt").read())
    args = parse_args(printed + ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                                 "--lr", "1e-4", "--tokenizer-type", "ByteTokenizer"],
                      world_size=2, report=False)
    hf = json.load(open(src / "config.json"))
    want = for_hf_config(hf, str(src / "config.json")).config_from_hf(hf)
    parsed = {**{f.name: getattr(args, f.name) for f in fields(GPTConfig) if hasattr(args, f.name)},
              **architecture_kwargs(vars(args))}
    if parsed.get("moe_ffn_hidden_size") is None:  # unset: the experts' width is the MLP's (GPTConfig fills it)
        parsed["moe_ffn_hidden_size"] = parsed.get("ffn_hidden_size")
    differ = {f.name: (parsed.get(f.name), getattr(want, f.name)) for f in fields(GPTConfig)
              if f.name not in NOT_FROM_HF and parsed.get(f.name) != getattr(want, f.name)}
    assert differ == {}, f"flag value vs HF config: {differ}"
    assert set(ARCHITECTURE_FIELDS) <= {f.name for f in fields(GPTConfig)}
    dropout = {"llama": (0.0, 0.0), "mistral": (0.0, 0.05), "gpt2": (0.2, 0.0)}.get(kind, (0.0, 0.0))
    assert (args.hidden_dropout, args.attention_dropout) == dropout

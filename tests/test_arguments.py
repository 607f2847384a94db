"""Flag validation: every inconsistency is one sentence naming the flags, no traceback."""
import json

import pytest

from megatron_zero.arguments import parse_args
from megatron_zero.testing.flag_checks import BASE, refused, with_flags


def test_good_args_derive_dp_and_accumulation():
    args = parse_args(with_flags(BASE, tensor_model_parallel_size=2), world_size=8)
    assert (args.data_parallel_size, args.num_micro_batches) == (4, 2)
    assert args.max_position_embeddings == 32 and args.ffn_hidden_size == 256


@pytest.mark.parametrize("changes,world,words", [
    (dict(global_batch_size=10), 4, ["--global-batch-size 10", "--micro-batch-size 2", "data-parallel size 4"]),
    (dict(num_attention_heads=6, hidden_size=96, tensor_model_parallel_size=4), 4,
     ["--num-attention-heads 6", "--tensor-model-parallel-size 4"]),
    (dict(pipeline_model_parallel_size=8), 8, ["--num-layers 4", "--pipeline-model-parallel-size 8"]),
    (dict(max_position_embeddings=16), 1, ["--seq-length 32", "--max-position-embeddings 16"]),
    (dict(fp16=True, bf16=True), 1, ["--fp16", "--bf16"]),
    (dict(tensor_model_parallel_size=4), 6, ["world size 6", "--tensor-model-parallel-size 4"]),
    (dict(train_samples=100), 1, ["--train-iters", "--train-samples"]),
    (dict(pipeline_model_parallel_size=4, global_batch_size=4), 4,
     ["micro-batches", "--pipeline-model-parallel-size 4"]),
    (dict(hidden_size=66), 1, ["--hidden-size 66", "--num-attention-heads 4"]),
    (dict(lr=-1), 1, ["--lr"]),
    (dict(save_interval=5), 1, ["--save-interval", "--save"]),
    (dict(load="/nonexistent/ckpt"), 1, ["--load /nonexistent/ckpt"]),
    (dict(zero_stage=7), 1, ["--zero-stage", "7"]),
    (dict(zero_stage=3, pipeline_model_parallel_size=2, global_batch_size=8), 2,
     ["--zero-stage 3", "--pipeline-model-parallel-size 2"]),
    (dict(data_path="0.3"), 1, []),
    (dict(device="cpu", distributed_backend="nccl"), 1, ["--distributed-backend nccl", "--device cpu"]),
])
def test_inconsistencies_are_one_sentence(changes, world, words, capsys):
    argv = with_flags(BASE, **changes)
    if "data_path" in changes:  # weights without prefixes
        argv = BASE + ["--data-path", "0.3", "a", "0.7"]
        words = ["--data-path", "pairs"]
    err = refused(argv, world, capsys)
    for word in words:
        assert word in err, (word, err)


def test_unknown_flag_and_bad_type(capsys):
    assert "--no-such-flag" in refused(BASE + ["--no-such-flag"], 1, capsys)
    assert "--hidden-size" in refused(with_flags(BASE, hidden_size="big"), 1, capsys)


def test_deepspeed_config_fills_and_conflicts(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                               "gradient_clipping": 0.5, "zero_optimization": {"stage": 2},
                               "bf16": {"enabled": True}}))
    argv = [a for a in BASE]
    argv = with_flags(argv, deepspeed_config=cfg)
    for flag, value in (("--micro-batch-size", "2"), ("--global-batch-size", "16")):
        argv.remove(flag)
        argv.remove(value)
    args = parse_args(argv, world_size=2)
    assert (args.micro_batch_size, args.global_batch_size, args.zero_stage) == (4, 32, 2)
    assert args.bf16 and args.clip_grad == 0.5 and args.num_micro_batches == 4
    err = refused(with_flags(BASE, deepspeed_config=cfg), 2, capsys)
    assert "--micro-batch-size 2" in err and "train_micro_batch_size_per_gpu=4" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert f"{bad} is not valid JSON" in refused(with_flags(BASE, deepspeed_config=bad), 1, capsys)


def test_no_fusion_flags_reach_the_ops_switches():
    from megatron_zero.ops import get_fusion_flags, set_fusion_flags
    from megatron_zero.training.trainer import fusion_flags
    from megatron_zero.config import from_args

    args = parse_args(BASE + ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-rope-fusion"], world_size=1)
    old = set_fusion_flags(**fusion_flags(from_args(args)))
    try:
        flags = get_fusion_flags()
        assert not flags.masked_softmax_fusion and not flags.bias_gelu_fusion and flags.persist_layer_norm
        assert not flags.rope_fusion
    finally:
        set_fusion_flags(**{k: getattr(old, k) for k in fusion_flags(from_args(args))})


LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
DS_LLAMA = ["--normalization", "rmsnorm", "--use-rotary-position-embeddings", "--swiglu", "--num-key-value-heads", "2",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def test_architecture_flags_and_their_megatron_deepspeed_spellings():
    from megatron_zero.arguments import args_to_dict
    from megatron_zero.model.architecture import ARCHITECTURE_FIELDS, architecture_kwargs
    from megatron_zero.model.config import GPTConfig
    megatron, deepspeed = (parse_args(BASE + flags, world_size=4) for flags in (LLAMA, DS_LLAMA))
    recorded = args_to_dict(megatron)  # what a checkpoint records
    assert {k: recorded[k] for k in ARCHITECTURE_FIELDS} == {
        "normalization": "RMSNorm", "apply_layernorm_1p": False, "position_embedding_type": "rope",
        "rotary_base": 10000, "rotary_percent": 1.0,
        "swiglu": True, "num_query_groups": 2, "untie_embeddings_and_output_weights": True, "add_bias_linear": False,
        "add_qkv_bias": False, "qk_layernorm": False, "kv_channels": None}
    assert architecture_kwargs(vars(deepspeed)) == architecture_kwargs(recorded)
    assert megatron.ffn_hidden_size == 128  # Megatron's SwiGLU default: 2/3 of 4h, rounded down to 64
    config = GPTConfig(vocab_size=100, hidden_size=64, num_layers=4, num_attention_heads=4, seq_length=32,
                       max_position_embeddings=32, **architecture_kwargs(recorded))
    assert config.qkv_size == (4 + 2 * 2) * 16 and config.mlp_in_size == 256
    gpt2 = parse_args(BASE, world_size=1)
    assert architecture_kwargs(vars(gpt2))["num_query_groups"] == 4 and not gpt2.swiglu
    assert parse_args(BASE + ["--group-query-attention"], world_size=1).num_query_groups == 1  # Megatron's default


@pytest.mark.parametrize("flags,world,words", [
    (["--num-query-groups", "3"], 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--num-query-groups", "6", "--tensor-model-parallel-size", "4", "--num-attention-heads", "12",
      "--hidden-size", "96"], 4, "--num-query-groups 6 and --tensor-model-parallel-size 4 must divide one another"),
    (["--normalization", "BatchNorm"], 1, "'BatchNorm' is not one of LayerNorm, RMSNorm"),
    (["--position-embedding-type", "alibi"], 1, "--position-embedding-type"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.1"], 1, "rotates an odd number"),
    (["--rotary-percent", "1.5"], 1, "--rotary-percent 1.5 must lie in (0, 1]"),
])
def test_bad_architecture_flags_are_one_sentence(flags, world, words, capsys):
    assert words in refused(BASE + flags, world, capsys)


def test_device_flags_choose_one_device(capsys, monkeypatch):
    import torch

    from megatron_zero.distributed.device import backend_for, select_device
    from megatron_zero.training import pretrain

    assert parse_args(BASE + ["--no-cuda"], world_size=1).device == "cpu"
    assert parse_args(BASE, world_size=1).device == "auto"
    assert select_device("cpu", 3) == torch.device("cpu") and backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto", 0) == torch.device("cpu")
    assert pretrain(BASE + ["--device", "cuda"]) == 2  # refused before any process group starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda" in err and "--device cpu" in err and "Traceback" not in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device("auto", 3) == torch.device("cuda", 1)  # LOCAL_RANK modulo the node's GPUs


def test_validating_a_namespace_again_gives_what_once_would():
    """Derived values (a --pipeline-partition parsed to a list, MoE defaults filled) are not flags given again;
    a value the holder set after the first validation is."""
    from megatron_zero.arguments import validate_args

    argv = with_flags(BASE, pipeline_model_parallel_size=2, pipeline_partition="1,3", num_experts=4,
                      expert_model_parallel_size=2)
    once = parse_args(argv, world_size=4)
    twice = validate_args(parse_args(argv, world_size=4), 4)
    assert vars(twice) == vars(once) and twice.pipeline_partition == [1, 3]
    assert validate_args(twice, 8).data_parallel_size == 4  # another world size: derived from the flags again
    twice.global_batch_size = 32
    assert validate_args(twice, 8).num_micro_batches == 4

"""One reading of the model a run's arguments describe (model/architecture.py), used for a checkpoint's args and
this run's flags alike: a checkpoint of the model the flags describe is accepted whoever wrote its args (this
trainer, Megatron-LM, Megatron-DeepSpeed), another model is refused, and the saved-config readers
(generate_text, convert_to_hf) build the model those args describe."""
import shlex

from megatron_zero.arguments import args_to_dict, parse_args
from megatron_zero.checkpoint.compat import disagreements
from megatron_zero.checkpoint.saved_config import saved_config
from megatron_zero.model.architecture import model_settings

SIZES = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 " \
        "--lr 1e-3 --train-iters 4 --tokenizer-type ByteTokenizer"
LLAMA = "--normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope --swiglu " \
        "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights --disable-bias-linear"
COMMON = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
              max_position_embeddings=16, make_vocab_size_divisible_by=128, swiglu=True,
              untie_embeddings_and_output_weights=True, add_bias_linear=False)


def flags(text):
    return parse_args(shlex.split(f"{SIZES} {text}"))


def differences(saved: dict, args) -> list:
    return disagreements({"args": saved}, args, 257, lambda tp: 384 * tp)


def test_our_llama_checkpoint_matches_its_own_flags():
    args = flags(LLAMA)
    assert differences(args_to_dict(args), args) == []
    assert model_settings(args)["add_position_embedding"] is False
    assert set(differences(args_to_dict(flags("")), args)) == {
        "--layernorm-epsilon 1e-05 in the checkpoint vs 1e-06 here", "--ffn-hidden-size 128 in the checkpoint vs 64 here",
        "--num-query-groups 4 in the checkpoint vs 2 here", "swiglu False in the checkpoint vs True here",
        "normalization LayerNorm in the checkpoint vs RMSNorm here",
        "untie_embeddings_and_output_weights False in the checkpoint vs True here",
        "add_bias_linear True in the checkpoint vs False here",
        "position_embedding_type learned_absolute in the checkpoint vs rope here",
        "add_position_embedding True in the checkpoint vs False here"}


def test_megatron_lm_args_of_the_same_model_match():
    """Megatron-LM records norm_epsilon, keeps num_query_groups 1 (ignored) without --group-query-attention,
    and leaves add_position_embedding at True beside position_embedding_type rope."""
    saved = dict(COMMON, normalization="RMSNorm", norm_epsilon=1e-6, position_embedding_type="rope",
                 add_position_embedding=True, group_query_attention=False, num_query_groups=1)
    args = flags(LLAMA.replace("--group-query-attention --num-query-groups 2", ""))
    assert differences(saved, args) == []
    assert differences(dict(saved, group_query_attention=True), args) == [
        "--num-query-groups 1 in the checkpoint vs 4 here"]


def test_megatron_deepspeed_spellings_match_and_both_position_encodings_are_refused():
    saved = dict(COMMON, normalization="rmsnorm", layernorm_epsilon=1e-6, use_rotary_position_embeddings=True,
                 add_position_embedding=False, num_key_value_heads=2)
    assert differences(saved, flags(LLAMA)) == []
    assert differences(dict(saved, add_position_embedding=True), flags(LLAMA)) == [  # RoPE and a position table
        "add_position_embedding True in the checkpoint vs False here"]


def test_one_key_value_head_without_the_switch_stays_multi_query():
    args = flags(LLAMA.replace("--group-query-attention --num-query-groups 2", "--num-key-value-heads 1"))
    assert args.num_query_groups == 1 and model_settings(args)["num_query_groups"] == 1
    assert differences(args_to_dict(args), args) == []


def test_saved_config_reads_megatron_deepspeed_spellings():
    """generate_text.py and convert_to_hf.py build their model from recorded args through saved_config."""
    saved = dict(COMMON, normalization="rmsnorm", layernorm_epsilon=1e-6, use_rotary_position_embeddings=True,
                 add_position_embedding=False, num_key_value_heads=2)
    shapes = {"1.word_embeddings.weight": (257, 32), "7.lm_head.weight": (257, 32)}
    config = saved_config(list(shapes), shapes.__getitem__, saved)
    assert (config.normalization, config.position_embedding_type, config.num_query_groups,
            config.layernorm_epsilon, config.untie_embeddings_and_output_weights) == ("RMSNorm", "rope", 2, 1e-6, True)

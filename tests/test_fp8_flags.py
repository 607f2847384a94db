"""Megatron-LM's FP8 flags: what each maps to in torchao's float8 training, and each refusal in one sentence."""
import pytest
import torch

from megatron_zero.config import from_args
from megatron_zero.arguments import parse_args
from megatron_zero.fp8.settings import Float8Error, Float8Settings
from megatron_zero.model_converters import model_converters
from megatron_zero.testing.flag_checks import BASE, refused, with_flags

pytest.importorskip("torchao.float8")


@pytest.mark.parametrize("changes, words", [
    (dict(fp8_recipe="mxfp8", fp8_format="hybrid"), ["--fp8-recipe mxfp8 is refused", "rowwise"]),
    (dict(fp8_amax_history_len=1024, fp8_format="hybrid", fp8_recipe="tensorwise"),
     ["--fp8-amax-history-len", "--fp8-recipe tensorwise scales each tensor by its current amax"]),
    (dict(fp8_amax_compute_algo="max"), ["--fp8-amax-compute-algo", "--fp8-format turns on"]),
    (dict(fp8_amax_history_len=0, fp8_format="hybrid"), ["--fp8-amax-history-len 0 must be at least 1"]),
    (dict(fp8_format="hybrid", checkpoint_activations=True),
     ["--fp8-recipe delayed with --recompute-granularity full"]),
    (dict(fp8_param_gather=True), ["--fp8-param-gather shape FP8 training", "--fp8-format turns on"]),
    (dict(fp8_param_gather=True, fp8_format="hybrid", fp8_recipe="rowwise"),
     ["--fp8-param-gather with --fp8-recipe rowwise", "tensorwise only"]),
    (dict(fp8_param_gather=True, fp8_format="hybrid", zero_stage=0),
     ["--fp8-param-gather with --zero-stage 0", "no weight all-gather"]),
    (dict(fp8_param_gather=True, fp8_format="hybrid", zero_stage=3, zero_quantized_weights=True),
     ["--fp8-param-gather with ZeRO++"]),
    (dict(fp8_emulate=True), ["--fp8-format turns on", "--fp8-emulate"]),
    (dict(fp8_format="e4m3", fp8_margin=-1), ["--fp8-margin -1"]),
])
def test_fp8_flags_refused_in_one_sentence(changes, words, capsys):
    err = refused(with_flags(BASE, **changes), 2, capsys)
    for word in words:
        assert word in err, (word, err)


def test_flags_map_onto_torchaos_config():
    args = parse_args(with_flags(BASE, fp8_format="e4m3", fp8_recipe="rowwise", fp8_margin=1, fp8_emulate=True),
                      world_size=2)
    config = Float8Settings(args.fp8_format, args.fp8_recipe, args.fp8_margin, args.fp8_emulate).linear_config()
    assert config.emulate and config.round_scales_to_power_of_2
    assert config.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    delayed = Float8Settings.from_args(parse_args(with_flags(BASE, fp8_format="hybrid", fp8_amax_history_len=1024,
                                                             fp8_amax_compute_algo="max"), world_size=2))
    assert (delayed.recipe, delayed.amax_history_len, delayed.amax_compute_algo) == ("delayed", 1024, "max")
    assert Float8Settings.from_args(parse_args(with_flags(BASE, fp8_format="e4m3"), world_size=2)).recipe == "delayed"
    hybrid = Float8Settings("hybrid", "tensorwise").linear_config()
    assert hybrid.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert hybrid.cast_config_input.target_dtype == torch.float8_e4m3fn and not hybrid.emulate


class _State:
    cp_size, cp_group, dp_size, dp_group, expert_dp_group = 1, None, 1, None, None


def test_cpu_without_emulation_is_refused():
    args = parse_args(with_flags(BASE, fp8_format="hybrid"), world_size=2)
    with pytest.raises(Float8Error, match="FP8 tensor cores .* this rank trains on the CPU; .* --fp8-emulate"):
        model_converters(from_args(args), _State(), torch.device("cpu"))
    args.fp8_emulate = True
    assert model_converters(from_args(args), _State(), torch.device("cpu")).names == ["fp8", "output_loss"]
    args.fp8_format = None
    assert model_converters(from_args(args), _State(), torch.device("cpu")).names == ["output_loss"]


def test_fp8_with_moe_experts_is_accepted():
    """--fp8-format with --num-experts: the experts' GEMMs run in FP8 (docs/fp8.md, tests/test_fp8_moe.py)."""
    args = parse_args(with_flags(BASE, fp8_format="hybrid", fp8_emulate=True, num_experts=4), world_size=2)
    assert (args.fp8_format, args.num_experts) == ("hybrid", 4)

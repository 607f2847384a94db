"""--moe-layer-freq in Megatron-LM's list form (one 0 / 1 per layer, as a Python list expression: DeepSeek-V3's
`[0]*3+[1]*58`, Qwen3-MoE's `([1]*48)`): parsed without evaluating code, a pattern of every N-th layer read as that
interval, any other pattern kept per layer; a model with its first layer dense trains at EP2 x DP2 ZeRO-1 as the
one-process reference does (losses and gradient norms, fp32, the MoE parity tests' tolerance), and
pretrain_gpt.py takes the flag and saves it in the checkpoint's args, a resume reading it back."""
import pytest

from megatron_zero.arguments import parse_args
from megatron_zero.model import reference_model
from megatron_zero.model.moe_layers import parse_moe_layer_freq, placement
from megatron_zero.testing import run_ranks
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.launch import byte_data, tiny_flags, torchrun
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol


def test_list_forms_parse_safely():
    assert parse_moe_layer_freq("[0]*3+[1]*5") == (0, 0, 0, 1, 1, 1, 1, 1)
    assert parse_moe_layer_freq("([1]*4)") == (1, 1, 1, 1) and parse_moe_layer_freq("2") == 2
    assert placement((1, 1, 1, 1), 4) == (1, 0) and placement((0, 1, 0, 1), 4) == (2, 1)
    assert placement((0, 1, 1, 1), 4) == ((0, 1, 1, 1), 0)
    for bad in ("__import__('os').getcwd()", "[2]*3", "[0]*3+", "[1.0]*4"):
        with pytest.raises(Exception, match="neither an interval"):
            parse_moe_layer_freq(bad)


def test_flag_refusals_in_one_sentence(capsys):
    flags = with_flags(BASE, num_experts=4, moe_layer_freq="[0]*3+[1]*5")
    line = refused(flags, 1, capsys)
    assert "--moe-layer-freq has 8 entries" in line and "--num-layers" in line
    args = parse_args(with_flags(BASE, num_experts=4, moe_layer_freq="([1]*4)"), world_size=1)
    assert (args.moe_layer_freq, args.moe_layer_offset) == (1, 0)


def test_first_layer_dense_matches_reference():
    cfg = moe_config(True, moe_layer_freq=(0, 1, 1, 1))
    assert [cfg.is_moe_layer(b) for b in range(4)] == [False, True, True, True]
    mb, steps = 2, 3
    ref_losses, ref_norms = reference_run(cfg, 2, mb, steps)
    results = run_ranks(parallel_run, 2, cfg, 1, 1, 2, 1, mb, steps, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, "first layer dense, EP2 loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), "first layer dense, EP2 grad norm")


@pytest.mark.slow  # default tier: test_first_layer_dense_matches_reference and test_flag_refusals_in_one_sentence
def test_cli_trains_saves_and_resumes_the_pattern(tmp_path):
    data = byte_data(str(tmp_path / "bytes"))
    moe = {"num-experts": 4, "expert-model-parallel-size": 2, "moe-layer-freq": "[0]*1+[1]*1", "save-interval": 2}
    run = torchrun(2, tiny_flags(tmp_path, data, **moe))
    assert run.returncode == 0, run.stderr[-3000:]
    resume = torchrun(2, tiny_flags(tmp_path, data, **moe, **{"train-iters": 3, "load": tmp_path / "ckpt",
                                                             "override-opt_param-scheduler": True}))
    assert resume.returncode == 0, resume.stderr[-3000:]
    out = resume.stdout + resume.stderr
    assert "loaded checkpoint" in out and "iteration        3/" in out


def test_router_dtype_fp32_runs_the_router_gemm_in_fp32(monkeypatch, capsys):
    """--moe-router-dtype fp32 under bf16: the router's GEMM takes fp32 tokens and weight (its logits then differ from
    the bf16 GEMM's by bf16 rounding); fp64 is refused in one sentence; --moe-permute-fusion is accepted."""
    import torch
    import torch.nn.functional as F

    from megatron_zero.model.architecture import gpt_config
    from megatron_zero.model.transformer import ParallelMLP
    from megatron_zero.moe import MoELayer
    from megatron_zero.moe import layer as moe_layer

    args = parse_args(with_flags(BASE, num_experts=4, moe_router_dtype="fp32", moe_permute_fusion=True), world_size=1)
    assert args.moe_router_dtype == "fp32"
    assert "--moe-router-dtype fp64" in refused(with_flags(BASE, num_experts=4, moe_router_dtype="fp64"), 1, capsys)
    seen = []
    real = F.linear
    monkeypatch.setattr(moe_layer.F, "linear", lambda x, w, *a: seen.append((x.dtype, w.dtype)) or real(x, w, *a))
    x = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    for dtype in (None, "fp32"):
        cfg = gpt_config(args, 100)
        cfg.moe_router_dtype, cfg.params_dtype = dtype, torch.bfloat16
        torch.manual_seed(0)
        MoELayer(cfg, None, None, ParallelMLP)(x)
    assert seen[0] == (torch.bfloat16, torch.bfloat16) and (torch.float32, torch.float32) in seen

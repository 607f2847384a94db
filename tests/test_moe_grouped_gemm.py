"""`--moe-grouped-gemm` (moe/grouped_mlp.py): the local experts evaluated together give the per-expert loop's
outputs and gradients (fp32, GeLU experts with biases and SwiGLU experts without), grouped_mm's
forward on the CPU agrees with the loop (its offsets and transposes are right), the parameters and
checkpoints are those of a run without the flag, and on a GPU grouped_mm in bf16 agrees with the loop.
The multi-rank runs with the flag (EP2, EP2 x TP2) are in tests/test_moe_parity.py."""
import pytest
import torch

from megatron_zero.model.gpt import reference_model
from megatron_zero.model.transformer import ParallelMLP
from megatron_zero.moe import reset_aux_losses
from megatron_zero.moe.grouped_mlp import GroupedMLP, grouped_linear, grouped_mm_fits
from megatron_zero.testing.moe_train import moe_config
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from megatron_zero.testing.tolerances import assert_close_scaled, model_rtol, reduction_atol

TOKENS = 16


def _output_and_grads(moe, x):
    out = moe(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    reset_aux_losses()
    return out.detach(), grads


@pytest.mark.parametrize("llama", [False, True])
def test_grouped_experts_match_the_per_expert_loop(llama):
    cfg = moe_config(llama)
    moe = reference_model(cfg)._modules["2"].mlp.deepspeed_moe
    x = torch.randn(2, TOKENS // 2, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).requires_grad_()
    assert moe.experts.grouped is None
    want_out, want = _output_and_grads(moe, x)
    moe.experts.grouped = GroupedMLP(cfg, None)
    out, got = _output_and_grads(moe, x)
    rtol = model_rtol(4 * (cfg.hidden_size + cfg.moe_ffn_hidden_size) + 2 * TOKENS)  # two matmuls, and back
    assert_close_scaled(out, want_out, rtol, "output")
    for (name, _), g, w in zip([("x", x), *moe.named_parameters()], got, want):
        assert_close_scaled(g, w, rtol, f"gradient of {name}")
    assert sum(float(g.abs().sum()) for g in got[2:]) > 0


def test_grouped_mm_forward_on_the_cpu_matches_the_loop():
    """fp32 grouped_mm runs forward on the CPU (16-byte aligned rows): the same products as F.linear per
    expert, an expert with no rows included."""
    g = torch.Generator().manual_seed(3)
    counts, k, n = [5, 0, 7, 4], 16, 12
    x = torch.randn(sum(counts), k, generator=g)
    weights = [torch.randn(n, k, generator=g) for _ in counts]
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    assert grouped_mm_fits(torch.float32, k, n)
    got = grouped_linear(x, weights, counts, offs, grouped=True)
    want = grouped_linear(x, weights, counts, None, grouped=False)
    magnitude = grouped_linear(x.abs(), [w.abs() for w in weights], counts, None, grouped=False)
    assert torch.all((got - want).abs() <= reduction_atol(k, magnitude))


@pytest.mark.parametrize("flag_on_save", [False, True])
def test_checkpoints_load_either_way(flag_on_save):
    """The flag changes how the experts run, not what they hold: same names, shapes, values, either way."""
    saved = reference_model(moe_config(True, moe_grouped_gemm=flag_on_save)).state_dict()
    model = reference_model(moe_config(True, moe_grouped_gemm=not flag_on_save, init_method_std=0.5))
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in saved.items()}
    model.load_state_dict(saved, strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_mm_in_bf16_matches_the_loop_on_a_gpu(swiglu, cuda_device):
    """CUDA bf16: grouped_mm against the per-expert loop, output and every gradient. Both accumulate
    in fp32 and round each matmul's output to bf16 (u = 2^-8); the activation rounds once more, so the
    two differ by a few roundings of the values that formed an element: 8 u, relative to the tensor's size."""
    device = cuda_device
    cfg = tiny_llama_config(swiglu=swiglu, add_bias_linear=not swiglu, hidden_size=64, moe_ffn_hidden_size=128,
                            num_experts=4, params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    experts = [ParallelMLP(cfg, None, ffn_hidden_size=cfg.moe_ffn_hidden_size).to(device) for _ in range(4)]
    for e in experts:
        for p in e.parameters():
            torch.nn.init.normal_(p, std=0.05)
    counts = [9, 0, 17, 6]
    rows = torch.randn(sum(counts), cfg.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    mlp = GroupedMLP(cfg, None)
    assert mlp.uses_grouped_mm(experts, rows)
    params = [rows, *(p for e in experts for p in e.parameters())]
    results = []
    for grouped in (True, False):
        mlp.uses_grouped_mm = lambda experts, rows, grouped=grouped: grouped
        out = mlp(experts, rows, counts)
        results.append((out.float(), [g.float() for g in torch.autograd.grad(out.float().square().sum(), params)]))
    (out, grads), (want_out, want) = results
    rtol = 8 * 2.0 ** -8
    assert_close_scaled(out, want_out, rtol, "output")
    for i, (g, w) in enumerate(zip(grads, want)):
        assert_close_scaled(g, w, rtol, f"gradient {i}")

"""`--moe-grouped-gemm` (moe/grouped_mlp.py): the local experts evaluated together give the per-expert loop's
outputs and gradients (fp32, GeLU experts with biases and SwiGLU experts without), grouped_mm's
forward on the CPU agrees with the loop (its offsets and transposes are right), the parameters and
checkpoints are those of a run without the flag, and on a GPU grouped_mm in bf16 agrees with the loop.
Under ZeRO 0-2 the experts' weights enter grouped_mm as a view of the flat buffer: a forward copies no
weight, and the view's gradients are torch.stack's, bit for bit. The multi-rank runs with the flag
(EP2, EP2 x TP2) are in tests/test_moe_parity.py."""
import pytest
import torch

from megatron_zero.model.gpt import reference_model
from megatron_zero.model.transformer import ParallelMLP
from megatron_zero.moe import reset_aux_losses
from megatron_zero.moe.grouped_mlp import GroupedMLP, grouped_linear, grouped_mm_fits
from megatron_zero.moe.stacked_weights import expert_stride, stacked
from megatron_zero.testing.copy_counter import CopyCounter
from megatron_zero.testing.moe_train import global_batch, moe_config
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from megatron_zero.testing.tolerances import assert_close_scaled, model_rtol, reduction_atol
from megatron_zero.zero import ZeroOptimizer

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


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("llama", [False, True])
def test_a_forward_under_zero_copies_no_expert_weight(llama, stage, monkeypatch):
    """Forced onto grouped_mm (its CPU forward): without ZeRO the weights are separate tensors and stacked,
    one copy of every expert parameter a forward; once ZeRO has laid them into its flat buffer, grouped_mm
    reads them there (its operand shares the buffer's storage) and the forward copies nothing, with the
    same output bits."""
    cfg = moe_config(llama, moe_grouped_gemm=True)
    model = reference_model(cfg)
    experts = model._modules["2"].mlp.deepspeed_moe.experts
    monkeypatch.setattr(GroupedMLP, "uses_grouped_mm", lambda self, experts, rows: True)
    operands = []
    grouped_mm = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm",
                        lambda x, w, offs: operands.append(w) or grouped_mm(x, w, offs=offs))
    counts = [5, 0, 7, 4]
    rows = torch.randn(sum(counts), cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), CopyCounter() as stacked_copies:
        want = experts(rows, counts)
    assert stacked_copies.total == sum(p.numel() * p.element_size() for p in experts.parameters())
    ZeroOptimizer(list(model.named_parameters()), stage=stage, module=model)
    operands.clear()
    for _ in range(2):  # every forward, not just the first
        with torch.no_grad(), CopyCounter() as copies:
            got = experts(rows, counts)
        assert copies.total == 0, dict(copies.bytes)
        assert torch.equal(got, want)
    fc1 = [e.dense_h_to_4h.weight for e in experts.deepspeed_experts.values()]
    assert len(operands) == 4 and all(w.untyped_storage().data_ptr() == fc1[0].untyped_storage().data_ptr()
                                      for w in operands)


def test_the_stacked_view_has_torch_stacks_values_and_gradients():
    """Weights equally spaced in one storage give a view with torch.stack's values and gradients, bit for
    bit; weights that are not (separate tensors, uneven or misaligned spacing) are stacked by a copy."""
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(4 * 40, generator=g)
    weights = [torch.nn.Parameter(torch.empty(0)) for _ in range(4)]
    for e, w in enumerate(weights):
        w.data = flat[e * 40:e * 40 + 24].view(4, 6)  # 160 bytes apart, 16-byte aligned
    x = torch.randn(4, 3, 6, generator=g)
    view = stacked(weights)
    assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(view, torch.stack([w.detach() for w in weights]))
    want = torch.autograd.grad(torch.bmm(x, torch.stack(weights).transpose(1, 2)).square().sum(), weights)
    got = torch.autograd.grad(torch.bmm(x, view.transpose(1, 2)).square().sum(), weights)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert expert_stride([torch.randn(4, 6) for _ in range(3)]) is None
    assert expert_stride([flat[0:24], flat[40:64], flat[96:120]]) is None  # uneven
    assert expert_stride([flat[1:25], flat[41:65]]) is None  # 4 bytes past an aligned start
    assert expert_stride([flat[1:25], flat[41:65]], aligned=False) == 40


def test_zero_layout_gives_the_loops_gradients_bit_for_bit():
    """The per-expert loop (the CPU's path; its biases come through the stacked view under ZeRO): outputs and
    every gradient the same bits with the experts in ZeRO's flat buffer as with separate tensors."""
    cfg = moe_config(False, moe_grouped_gemm=True)
    results = []
    for zero in (False, True):
        model = reference_model(cfg)
        if zero:
            ZeroOptimizer(list(model.named_parameters()), stage=1, module=model)
        experts = model._modules["2"].mlp.deepspeed_moe.experts
        biases = [e.dense_h_to_4h.bias for e in experts.deepspeed_experts.values()]
        assert (expert_stride(biases, aligned=False) is not None) == zero
        rows = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(2), requires_grad=True)
        out = experts(rows, [5, 0, 7, 4])
        results.append((out, torch.autograd.grad(out.square().sum(), [rows, *experts.parameters()])))
    (out0, grads0), (out1, grads1) = results
    assert torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))


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


def _zero3(model, halves: bool, persistence_threshold: int):
    """ZeRO-3 on one process: through ZeroOptimizer, or the expert-parallel pair of stages (expert_stage3.py) as
    EP builds it, the experts in a stage of their own."""
    if not halves:
        return ZeroOptimizer(list(model.named_parameters()), stage=3, module=model,
                             persistence_threshold=persistence_threshold).impl
    from megatron_zero.distributed.device import HOST
    from megatron_zero.zero.expert_stage import split_expert_groups
    from megatron_zero.zero.expert_stage3 import ExpertParallelStage3
    dense, _, expert, _ = split_expert_groups([list(model.named_parameters())], [{}])
    return ExpertParallelStage3(dense, expert, None, None, torch.float32, 4000, model, HOST,
                                persistence_threshold=persistence_threshold)


ZERO3_CASES = [(llama, threshold, halves) for llama in (False, True) for threshold in (0, 100_000)
               for halves in (False, True)]
DEFAULT_TIER = {(False, 0, False), (True, 100_000, True)}  # the rest in the slow tier


@pytest.mark.parametrize("llama,persistence_threshold,halves", [
    case if case in DEFAULT_TIER else pytest.param(*case, marks=pytest.mark.slow) for case in ZERO3_CASES])
def test_a_forward_under_zero3_stacks_no_expert_weight(llama, persistence_threshold, halves, monkeypatch):
    """ZeRO-3 lays the parameters one gather brings in one storage, each a 16-byte aligned view, in the module's
    order: gathered around their layer (threshold 0) or kept gathered (the default threshold keeps these small
    experts persistent), with or without the experts in a stage of their own, one matmul's expert weights lie
    equally spaced there. A model forward forced onto grouped_mm reads them in place: its operands share the
    experts' storage, no expert parameter is stacked (each forward stacked every one before, as the model without
    ZeRO does), the loss is the same bits."""
    cfg = moe_config(llama, moe_grouped_gemm=True)
    model = reference_model(cfg)
    monkeypatch.setattr(GroupedMLP, "uses_grouped_mm", lambda self, experts, rows: True)
    tokens, labels = global_batch(0)
    experts = [p for n, p in model.named_parameters() if ".deepspeed_experts." in n]
    with torch.no_grad(), CopyCounter() as separate:
        want = model(tokens, labels=labels)
    reset_aux_losses()
    others = separate.bytes["aten.stack"] - sum(p.numel() * p.element_size() for p in experts)  # the loss's
    assert others < separate.bytes["aten.stack"] // 100
    stage = _zero3(model, halves, persistence_threshold)
    operands = []
    grouped_mm = torch.nn.functional.grouped_mm

    def recording_grouped_mm(x, w, offs):
        operands.append((w.untyped_storage().data_ptr(), {p.untyped_storage().data_ptr() for p in experts}))
        return grouped_mm(x, w, offs=offs)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", recording_grouped_mm)
    for _ in range(2):  # every forward, not just the first
        with torch.no_grad(), CopyCounter() as copies:
            got = model(tokens, labels=labels)
        reset_aux_losses()
        assert copies.bytes["aten.stack"] == others, dict(copies.bytes)
        assert torch.equal(got, want)
    moe_layers = sum(1 for m in model.modules() if type(m).__name__ == "Experts")
    assert len(operands) == 2 * 2 * moe_layers and all(ptr in held for ptr, held in operands)
    stage.remove_hooks()

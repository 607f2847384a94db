"""--apply-layernorm-1p: norm weights held zero-centred (w, initialised to 0), the norms applying gamma = 1 + w.

Claims (fp32):
- a 1p model is the model whose norm weights are 1 + w: loss and every gradient bit-identical (the norms form
  1 + w with the same fp32 add and run the same kernel), LayerNorm and RMSNorm, block and final norms; a fresh
  1p model holds zeros there and computes the fresh plain model's loss exactly;
- the fused CPU RMSNorm kernel and the PyTorch fallback agree with zero-centred weights;
- TP2 with sequence parallelism, PP2 and TP2 x PP2 train a 1p model as the single-process reference does
  (loss, gradient norm, final weights within the Adam-aware bounds of tests/test_model_llama_parity.py);
- norm weights stay in Megatron's no-weight-decay group; Megatron-DeepSpeed's RMSNorm (which ignores the
  switch) reads as not zero-centred; torchtitan's layout refuses a 1p model in one sentence.
The command line (save, resume, Hugging Face export) is tests/test_layernorm_1p_cli.py.
"""
from argparse import Namespace

import pytest
import torch
import torch.distributed as dist

from megatron_zero import ops
from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.interop.titan import check_llama
from megatron_zero.checkpoint.interop.to_universal import config_from_common
from megatron_zero.checkpoint.interop.torch_dist_write import megatron_args
from megatron_zero.model import reference_model
from megatron_zero.model.architecture import model_settings
from megatron_zero.model.params import is_norm_weight, param_spec
from megatron_zero.model.sharding import gather_state_dicts, gather_tensor
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config
from megatron_zero.testing.tolerances import (AdamWeightBound, assert_losses_close, assert_within, global_norm_rtol,
                                              gpt_path_length, model_rtol)
from megatron_zero.testing.train_step import train_steps
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.training.trainer import param_groups
from megatron_zero.zero import ZeroOptimizer

CONFIGS = {"LayerNorm": lambda **kw: tiny_gpt_config(num_layers=2, **kw),
           "RMSNorm": lambda **kw: tiny_llama_config(num_layers=2, **kw)}


def batch(step, size=4):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 100, (size, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def loss_and_grads(model):
    tokens, labels = batch(0)
    model.zero_grad()
    loss = model(tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("norm", sorted(CONFIGS))
def test_zero_centred_model_is_the_model_with_gamma_one_plus_w(norm):
    one_p, plain = reference_model(CONFIGS[norm](apply_layernorm_1p=True)), reference_model(CONFIGS[norm]())
    cfg = CONFIGS[norm](apply_layernorm_1p=True)
    norm_names = [n for n, _ in one_p.named_parameters() if is_norm_weight(n, cfg)]
    assert len(norm_names) == 2 * cfg.num_layers + 1  # two per block and the final norm
    for name in norm_names:
        assert torch.equal(dict(one_p.named_parameters())[name], torch.zeros(cfg.hidden_size))
        assert param_spec(name, cfg).init == "zeros"
    assert torch.equal(loss_and_grads(one_p)[0], loss_and_grads(plain)[0])  # fresh: gamma 1 either way

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in norm_names:
            w = 0.1 * torch.randn(cfg.hidden_size, generator=g)
            dict(one_p.named_parameters())[name].copy_(w)
            dict(plain.named_parameters())[name].copy_(w + 1)
    loss_1p, grads_1p = loss_and_grads(one_p)
    loss, grads = loss_and_grads(plain)
    assert torch.equal(loss_1p, loss)
    for name in grads:
        assert torch.equal(grads_1p[name], grads[name]), name


def test_fused_rms_norm_kernel_with_zero_centred_weight():
    if ops.available_kernels().get("cpu_rms_norm") is not True:
        pytest.skip("the CPU RMSNorm kernel is not built")
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = (0.1 * torch.randn(32, generator=torch.Generator().manual_seed(1))).requires_grad_()
    outs = []
    for fused in (True, False):
        y = ops.rms_norm(x, w, 1e-5, fused=fused, zero_centered_gamma=True)
        dx, dw = torch.autograd.grad((y * y).sum(), (x, w))
        outs.append((y, dx, dw))
    for got, want in zip(*outs):  # the kernel and the fallback sum in different orders: a few fp32 eps
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    y_gamma = ops.rms_norm(x, w.detach() + 1, 1e-5, fused=False)
    assert torch.equal(outs[1][0], y_gamma)


def test_norm_weights_keep_no_weight_decay():
    cfg = tiny_llama_config(num_layers=2, apply_layernorm_1p=True)
    decay, no_decay = param_groups(reference_model(cfg), 0.1)
    norms = {n for n, _ in no_decay["params"] if is_norm_weight(n, cfg)}
    assert len(norms) == 2 * cfg.num_layers + 1 and no_decay["weight_decay"] == 0.0
    assert not any(is_norm_weight(n, cfg) for n, _ in decay["params"])


def test_recorded_settings():
    assert model_settings({"normalization": "RMSNorm", "apply_layernorm_1p": True})["apply_layernorm_1p"] is True
    assert model_settings({})["apply_layernorm_1p"] is False  # a checkpoint from before the switch
    # Megatron-DeepSpeed records the switch beside its RMSNorm, which trains gamma itself
    assert model_settings({"normalization": "rmsnorm", "apply_layernorm_1p": True})["apply_layernorm_1p"] is False
    with pytest.raises(CheckpointError, match="zero-centred"):
        check_llama(tiny_llama_config(apply_layernorm_1p=True), "ckpt")
    # Megatron-LM records the switch in common.pt's args and holds w, as ours: read and written as such
    recorded = Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=8, normalization="RMSNorm",
                         apply_layernorm_1p=True, padded_vocab_size=128)
    config, _ = config_from_common({"args": recorded}, None, "iter_0000001")
    assert config.apply_layernorm_1p and megatron_args(config, {}, 1).apply_layernorm_1p is True


# ---- TP / PP / SP against the reference ------------------------------------------------------------------
STEPS, GLOBAL_BATCH, WORLD = 3, 8, 4
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CLIP = 0.5
# (normalization, tp, pp, zero stage, sequence parallel); DP = 4 / (tp * pp)
LAYOUTS = [("RMSNorm", 2, 1, 1, True), ("RMSNorm", 1, 2, 2, False), ("LayerNorm", 2, 2, 1, True)]


def config(norm, sequence_parallel=False):
    return CONFIGS[norm](apply_layernorm_1p=True, sequence_parallel=sequence_parallel)


def rtol(norm):
    """Loss and gradient tolerance from the step's summation path (as tests/test_model_llama_parity.py)."""
    return model_rtol(gpt_path_length(config(norm), GLOBAL_BATCH * 8))


def norm_rtol(norm):
    return global_norm_rtol(rtol(norm), sum(p.numel() for p in reference_model(config(norm)).parameters()))


def reference_run(norm):
    cfg = config(norm)
    model = reference_model(cfg)
    opt = torch.optim.AdamW(param_groups_for_torch(model), **HP)
    bound = AdamWeightBound(rtol(norm), HP["lr"], HP["betas"], HP["eps"])
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        loss = model(tokens, labels=labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        bound.step({n: p.grad for n, p in model.named_parameters()}, dict(model.named_parameters()))
        losses.append(loss.item())
    weights = gather_state_dicts([{n: p.detach() for n, p in model.named_parameters()}], cfg)
    return losses, norms, weights, gather_state_dicts([bound.bounds()], cfg)


def param_groups_for_torch(model):
    return [{"params": [p for _, p in g["params"]], "weight_decay": g["weight_decay"]}
            for g in param_groups(model, HP["weight_decay"])]


def train_layout(norm, tp, pp, stage, sp):
    state = build_parallel_state(tp=tp, pp=pp)
    cfg = config(norm, sp)
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(param_groups(model, HP["weight_decay"]), dp_group=state.dp_group, stage=stage,
                        clip_grad=CLIP, mp_group=state.mp_group, tp_rank=state.tp_rank, module=model,
                        lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"])
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(1, cfg, tp), torch.float32)
    losses, norms = train_steps(model, opt, state, p2p, lambda step: batch(step, GLOBAL_BATCH), STEPS, GLOBAL_BATCH)
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return state.layout.coords(state.rank), losses, norms, weights


def every_layout():
    out = [train_layout(*layout) for layout in LAYOUTS]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(every_layout, WORLD, timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize("index", range(len(LAYOUTS)),
                         ids=[f"{n}-tp{t}-pp{p}-zero{s}{'-sp' if sp else ''}" for n, t, p, s, sp in LAYOUTS])
def test_layout_matches_reference(runs, index):
    norm, tp, pp, stage, sp = LAYOUTS[index]
    ref_losses, ref_norms, ref_weights, ref_bounds = reference_run(norm)
    assert max(ref_norms) > CLIP  # clipping was active
    results = [rank_results[index] for rank_results in runs]
    for _, losses, norms, _ in results:
        assert_losses_close(losses, ref_losses, rtol(norm), "loss")
        assert_losses_close(norms, ref_norms, norm_rtol(norm), "gradient norm")
    cfg = config(norm, sp)
    moved = 0
    for p in range(pp):
        shards = [r[3] for r in sorted(results, key=lambda r: r[0]) if r[0][0] == p and r[0][1] == 0]
        assert len(shards) == tp
        for name in shards[0]:
            full = gather_tensor([s[name] for s in shards], param_spec(name, cfg), cfg)
            assert_within(full, ref_weights[name], ref_bounds[name], name)
            moved += is_norm_weight(name, cfg) and bool(full.abs().max() > 1e-3)
    assert moved > 0  # the zero-centred weights trained away from 0

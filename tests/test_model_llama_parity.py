"""Llama-style models (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head, no bias) under
TP, PP, DP and ZeRO 0-3 against the single-process reference with torch.optim.AdamW, in fp32.

One 8-rank run trains every layout in turn, 3 steps each with clipping active: per step the loss and
the global gradient norm match the reference's, and (ZeRO 0-2) the final weights, gathered over TP,
match within an Adam-aware per-element bound (megatron_zero/testing/tolerances.py derives each). The layouts cover TP2, TP4, PP2, TP2xPP2xDP2, ZeRO
0, 1, 2, 3, num_query_groups < TP and num_query_groups = 1. bf16 and fp16 layouts track fp32 within 3 %.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.model import reference_model
from megatron_zero.model.params import param_spec
from megatron_zero.model.sharding import gather_state_dicts, gather_tensor
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.testing import run_ranks
from megatron_zero.testing.train_step import train_steps
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from megatron_zero.testing.tolerances import (AdamWeightBound, assert_losses_close, assert_within, global_norm_rtol,
                                              gpt_path_length, model_rtol)
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

pytestmark = pytest.mark.isa  # the Adam-aware bound on the layouts a fresh AVX-512 machine once failed

STEPS, GLOBAL_BATCH, WORLD = 3, 8, 8
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CLIP = 0.5
HALF_TOLERANCE = 0.03


def rtol(groups):
    """Loss and per-tensor gradient tolerance: lam * sqrt(n) * u for the ~2.2e3 terms summed along one
    step's forward and backward on the 64-token global batch (about 1.1e-5)."""
    return model_rtol(gpt_path_length(config(groups), GLOBAL_BATCH * 8))


def norm_rtol(groups):
    """The global gradient norm, a sum of ~58k squares (about 5.7e-5)."""
    return global_norm_rtol(rtol(groups), sum(p.numel() for p in reference_model(config(groups)).parameters()))

# (tp, pp, zero stage, num_query_groups, dtype); DP = 8 / (tp * pp)
LAYOUTS = [
    (2, 1, 1, 2, "fp32"),   # TP2, one group per rank
    (4, 1, 2, 2, "fp32"),   # TP4, groups < TP: KV heads replicated
    (4, 1, 3, 1, "fp32"),   # TP4, one group, ZeRO-3
    (1, 2, 0, 2, "fp32"),   # PP2 x DP4, ZeRO-0
    (2, 2, 1, 2, "fp32"),   # TP2 x PP2 x DP2
    (2, 2, 2, 1, "fp32"),   # TP2 x PP2 x DP2, one group
    (2, 1, 3, 2, "fp32"),   # TP2 x DP4, ZeRO-3
    (2, 2, 1, 1, "bf16"),   # bf16 through TP, PP and ZeRO
    (2, 1, 2, 2, "fp16"),   # fp16 (static loss scale 1024) through TP and ZeRO-2
]
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def config(groups):
    return tiny_llama_config(num_layers=2, num_query_groups=groups)


def batch(step):
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, 100, (GLOBAL_BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def reference_run(groups):
    model = reference_model(config(groups))
    opt = torch.optim.AdamW(model.parameters(), **HP)
    bound = AdamWeightBound(rtol(groups), HP["lr"], HP["betas"], HP["eps"])
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels = batch(step)
        opt.zero_grad()
        loss = model(tokens, labels=labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        bound.step({n: p.grad for n, p in model.named_parameters()}, dict(model.named_parameters()))
        losses.append(loss.item())
    weights = gather_state_dicts([{n: p.detach() for n, p in model.named_parameters()}], config(groups))
    return losses, norms, weights, gather_state_dicts([bound.bounds()], config(groups))


def train_layout(tp, pp, stage, groups, dtype):
    state = build_parallel_state(tp=tp, pp=pp)
    cfg = config(groups)
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, bucket_size=3000, dtype=dtype,
                        module=model, persistence_threshold=100, loss_scaler={"dynamic": False, "static_scale": 1024.0},
                        **HP)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(1, cfg),
              HALF.get(dtype, torch.float32))
    losses, norms = train_steps(model, opt, state, p2p, batch, STEPS, GLOBAL_BATCH)
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()} if stage < 3 else {}
    return state.layout.coords(state.rank), losses, norms, weights


def every_layout():
    out = [train_layout(*layout) for layout in LAYOUTS]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(every_layout, WORLD, timeout=600)


@pytest.fixture(scope="module")
def references():
    return {g: reference_run(g) for g in sorted({layout[3] for layout in LAYOUTS})}


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"tp{t}-pp{p}-zero{s}-groups{g}-{d}"
                                                              for t, p, s, g, d in LAYOUTS])
def test_layout_matches_reference(runs, references, index):
    tp, pp, stage, groups, dtype = LAYOUTS[index]
    ref_losses, ref_norms, ref_weights, ref_bounds = references[groups]
    results = [rank_results[index] for rank_results in runs]
    if dtype in HALF:
        for _, losses, _, _ in results:
            for got, want in zip(losses, ref_losses):
                assert abs(got - want) <= HALF_TOLERANCE * want, (got, want)
        return
    assert max(ref_norms) > CLIP  # clipping was active
    for _, losses, norms, _ in results:
        assert_losses_close(losses, ref_losses, rtol(groups), "loss")
        assert_losses_close(norms, ref_norms, norm_rtol(groups), "gradient norm")
    if stage == 3:
        return
    cfg = config(groups)
    for p in range(pp):
        shards = [r[3] for r in sorted(results, key=lambda r: r[0]) if r[0][0] == p and r[0][1] == 0]
        assert len(shards) == tp
        for name in shards[0]:
            full = gather_tensor([s[name] for s in shards], param_spec(name, cfg), cfg)
            assert_within(full, ref_weights[name], ref_bounds[name], name)

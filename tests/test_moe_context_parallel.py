"""MoE layers under context parallelism against the single-process reference, fp32: each CP rank routes its
chunks of every sequence; the switch aux loss counts the tokens routed per expert over the CP group and the
whole sequence's T, the sequence-level aux loss each sequence's counts over the group, and the z-loss
coefficient is divided by the CP size, so the CP ranks' losses sum to the sequence's (Megatron-Core's tp_cp
reduce group), and the aux scale is multiplied by CP as a CP rank's language-model loss is.

One 4-rank run trains each layout for 3 steps with clipping active (4 layers, 4 experts top-2, aux loss 1e-2
and z-loss 1e-3 on, one sample per micro-batch, a loss mask of 12 of 16 tokens): per step the loss and the
global gradient norm match the reference's within megatron_zero/testing/tolerances.py's bounds derived from
the computation. Without the CP reduction of the counts each CP rank balances its own chunks: GPT-2's loss
at CP2 x DP2 then leaves its bound 37 times over by the third step.

Layouts: GPT-2 (GeLU experts, MoE in every layer) at CP2 x DP2 (p2p, ZeRO-1) and CP4 (a2a); the Llama
(SwiGLU experts in every other layer, RoPE, 2 KV groups) at CP2 x DP2 on ZeRO-3 (p2p), CP2 x PP2
(all_gather), CP2 x DP2 with full recomputation, with the sequence-level aux loss, and CP2 x TP2 with
sequence parallelism (each TP rank routing its part of the CP rank's chunks: the counts summed over TP and
CP, Megatron-Core's tp_cp group).

With expert parallelism the expert groups are carved out of the DP x CP ranks (Megatron-Core's expert rank
order, no CP dimension): at EP2 x CP2 (DP 1) the EP group is the CP group, the tokens of both halves of each
sequence exchanged by the all-to-all (GPT-2 on ZeRO-1). Slow, 8 ranks: EP2 x CP2 x DP2 (expert-DP 2: expert
gradients reduced over the ranks with the same experts, averaged as the dense ones over DP x CP; GPT-2 on
ZeRO-1, the Llama on ZeRO-3) and EP4 x CP2 x DP2 (EP spanning CP and DP, expert-DP 1; the Llama on ZeRO-2).
Reducing the expert gradients over the dense DP x CP group instead of expert-DP leaves the loss bound of
GPT-2 at EP2 x CP2 x DP2 77 times over."""
import pytest
import torch

from megatron_zero.context_parallel import slice_batch_for_cp
from megatron_zero.model import reference_model
from megatron_zero.moe import reset_aux_losses, set_aux_loss_scale
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage, stage_p2p
from megatron_zero.testing import run_ranks
from megatron_zero.testing.moe_train import moe_config
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol
from megatron_zero.testing.train_step import pipeline_train_step
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

pytestmark = pytest.mark.multirank

STEPS, GLOBAL_BATCH, SEQ, KEPT, WORLD = 3, 4, 16, 12, 4
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CLIP = 0.5
FULL = dict(recompute_granularity="full", recompute_method="uniform")

# (model, pp, cp, zero stage, cp comm type, other settings); TP 1 (TP2 with sequence parallelism for "sp"),
# EP 1 (EP N for "epN"), DP = world / (tp pp cp)
LAYOUTS = [
    ("gpt", 1, 2, 1, "p2p", ""), ("gpt", 1, 4, 2, "a2a", ""),
    ("llama", 1, 2, 3, "p2p", ""), ("llama", 2, 2, 1, "all_gather", ""),
    ("llama", 1, 2, 1, "p2p", "full"), ("llama", 1, 2, 2, "p2p", "seq_aux_loss"),
    ("llama", 1, 2, 1, "p2p", "sp"), ("gpt", 1, 2, 1, "p2p", "ep2"),
]
WIDE_LAYOUTS = [("gpt", 1, 2, 1, "p2p", "ep2"), ("llama", 1, 2, 3, "p2p", "ep2"),  # 8 ranks, DP 2
                ("llama", 1, 2, 2, "p2p", "ep4")]


def config(model, comm_type="p2p", other=""):
    extra = dict(seq_length=SEQ, max_position_embeddings=SEQ, cp_comm_type=comm_type, sequence_parallel=other == "sp",
                 **(FULL if other == "full" else {}))
    if other == "seq_aux_loss":
        extra["moe_router_load_balancing_type"] = "seq_aux_loss"
    return moe_config(model == "llama", **extra)


def batch(step):
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 100, (GLOBAL_BATCH, SEQ + 1), generator=g)
    mask = torch.zeros(GLOBAL_BATCH, SEQ)
    for row in mask:  # the same count per sample: micro-batch means average to the batch's mean
        row[torch.randperm(SEQ, generator=g)[:KEPT]] = 1.0
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask


def reference_run(cfg):
    """One sample a micro-batch, as every layout splits the batch: loss / 4, aux scale 1 / 4."""
    net = reference_model(cfg)
    opt = torch.optim.AdamW(net.parameters(), **HP)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels, mask = batch(step)
        set_aux_loss_scale(1.0 / GLOBAL_BATCH)
        total = 0.0
        for j in range(GLOBAL_BATCH):
            loss = net(tokens[j:j + 1], labels=labels[j:j + 1], loss_mask=mask[j:j + 1]) / GLOBAL_BATCH
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    reset_aux_losses()
    return losses, norms


def train_layout(states, model, pp, cp, stage, comm_type, other):
    tp = 2 if other == "sp" else 1
    ep = int(other[2:]) if other.startswith("ep") else 1
    if (tp, pp, cp, ep) not in states:  # each layout's groups once (every group holds file descriptors)
        states[(tp, pp, cp, ep)] = build_parallel_state(tp=tp, pp=pp, cp=cp, ep=ep)
    state = states[(tp, pp, cp, ep)]
    cfg = config(model, comm_type, other)
    net = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(list(net.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, bucket_size=3000, module=net,
                        persistence_threshold=100, expert_dp_group=state.expert_dp_group, **HP)
    p2p = stage_p2p(state, activation_shape(1, cfg, tp, cp), torch.float32)
    per_replica = GLOBAL_BATCH // state.data_parallel_size
    first = state.data_parallel_rank * per_replica
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels, mask = batch(step)
        micro = [slice_batch_for_cp({"tokens": tokens[j:j + 1], "labels": labels[j:j + 1],
                                     "loss_mask": mask[j:j + 1]}, cp, state.cp_rank)
                 for j in range(first, first + per_replica)]
        set_aux_loss_scale(opt.loss_scale * cp / len(micro))  # as training/trainer.py sets it
        loss, norm = pipeline_train_step(net, opt, state, p2p, micro)
        losses.append(loss)
        norms.append(norm)
    reset_aux_losses()
    return losses, norms


def every_layout(layouts):
    states = {}
    return {layout: train_layout(states, *layout) for layout in layouts}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(every_layout, WORLD, LAYOUTS, timeout=900)


def case_id(layout):
    model, p, c, z, k, o = layout
    return f"{model}-pp{p}-cp{c}-zero{z}-{k}" + (f"-{o}" if o else "")


@pytest.fixture(scope="module")
def wide_runs():
    return run_ranks(every_layout, 2 * WORLD, WIDE_LAYOUTS, timeout=1800)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[case_id(layout) for layout in LAYOUTS])
def test_moe_layout_matches_reference(runs, layout):
    check_against_reference(runs, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", WIDE_LAYOUTS, ids=[case_id(layout) + "-dp2" for layout in WIDE_LAYOUTS])
def test_moe_expert_parallel_dp2_matches_reference(wide_runs, layout):
    check_against_reference(wide_runs, layout)


def check_against_reference(runs, layout):
    """Every rank's losses and gradient norms of `layout` against the reference's, per step."""
    model, other = layout[0], layout[-1]
    cfg = config(model, other=other)
    ref_losses, ref_norms = reference_run(cfg)
    assert max(ref_norms) > CLIP  # clipping was active
    rtol = model_rtol(gpt_path_length(cfg, GLOBAL_BATCH * SEQ))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for rank_results in runs:
        losses, norms = rank_results[layout]
        assert_losses_close(losses, ref_losses, rtol, "loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), "gradient norm")

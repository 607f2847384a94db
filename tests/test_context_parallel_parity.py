"""Context parallelism against the single-process reference with torch.optim.AdamW, fp32: GPT-2 and a
Llama (RoPE, grouped-query attention with 2 KV groups, SwiGLU, RMSNorm, untied) at CP4, CP2 x TP2 with
sequence parallelism, CP2 x PP2 and CP2 x DP2 on ZeRO-3, each --cp-comm-type (p2p ring, all_gather).

One 4-rank run trains every layout in turn, 3 steps each with clipping active, on a batch with a loss
mask of 12 tokens per 16-token sample (so the CP ranks' token counts differ and the loss must be summed
over CP and divided by the global count): per step the loss and the global gradient norm match the
reference's within megatron_zero/testing/tolerances.py's bounds derived from the computation."""
import pytest
import torch

from megatron_zero.context_parallel import slice_batch_for_cp
from megatron_zero.model import reference_model
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol
from megatron_zero.testing.train_step import pipeline_train_step
from megatron_zero.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

STEPS, GLOBAL_BATCH, SEQ, KEPT, WORLD = 3, 4, 16, 12, 4
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CLIP = 0.5

# (tp, pp, cp, zero stage, cp comm type); DP = 4 / (tp pp cp)
LAYOUTS = [
    (1, 1, 4, 1, "p2p"), (1, 1, 4, 2, "all_gather"),           # CP4
    (2, 1, 2, 1, "p2p"), (2, 1, 2, 2, "all_gather"),           # CP2 x TP2, sequence parallel
    (1, 2, 2, 1, "p2p"), (1, 2, 2, 0, "all_gather"),           # CP2 x PP2
    (1, 1, 2, 3, "p2p"), (1, 1, 2, 3, "all_gather"),           # CP2 x DP2, ZeRO-3
]
MODELS = ("gpt", "llama")


def config(model, comm_type="p2p", sequence_parallel=False):
    extra = dict(seq_length=SEQ, max_position_embeddings=SEQ, cp_comm_type=comm_type,
                 sequence_parallel=sequence_parallel)
    if model == "gpt":
        return tiny_gpt_config(num_layers=2, **extra)
    return tiny_llama_config(num_layers=2, num_query_groups=2, **extra)


def rtol(model):
    """Loss and per-tensor gradient tolerance: lam * sqrt(n) * u, n the terms along one step's path."""
    return model_rtol(gpt_path_length(config(model), GLOBAL_BATCH * SEQ))


def norm_rtol(model):
    return global_norm_rtol(rtol(model), sum(p.numel() for p in reference_model(config(model)).parameters()))


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 100, (GLOBAL_BATCH, SEQ + 1), generator=g)
    mask = torch.zeros(GLOBAL_BATCH, SEQ)
    for row in mask:  # the same count per sample: micro-batch means average to the batch's mean
        row[torch.randperm(SEQ, generator=g)[:KEPT]] = 1.0
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask


def reference_run(model):
    net = reference_model(config(model))
    opt = torch.optim.AdamW(net.parameters(), **HP)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels, mask = batch(step)
        opt.zero_grad()
        loss = net(tokens, labels=labels, loss_mask=mask)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms


def train_layout(model, tp, pp, cp, stage, comm_type):
    state = build_parallel_state(tp=tp, pp=pp, cp=cp)
    cfg = config(model, comm_type, sequence_parallel=tp > 1)
    net = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(list(net.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, bucket_size=3000, module=net,
                        persistence_threshold=100, **HP)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(1, cfg, tp, cp), torch.float32)
    per_replica = GLOBAL_BATCH // state.data_parallel_size
    first = state.data_parallel_rank * per_replica
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels, mask = batch(step)
        micro = [slice_batch_for_cp({"tokens": tokens[j:j + 1], "labels": labels[j:j + 1],
                                     "loss_mask": mask[j:j + 1]}, cp, state.cp_rank)
                 for j in range(first, first + per_replica)]
        loss, norm = pipeline_train_step(net, opt, state, p2p, micro)
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def every_layout():
    return {(model, *layout): train_layout(model, *layout) for model in MODELS for layout in LAYOUTS}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(every_layout, WORLD, timeout=900)


@pytest.fixture(scope="module")
def references():
    return {model: reference_run(model) for model in MODELS}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}-pp{p}-cp{c}-zero{z}-{k}" for t, p, c, z, k in LAYOUTS])
def test_layout_matches_reference(runs, references, model, layout):
    ref_losses, ref_norms = references[model]
    assert max(ref_norms) > CLIP  # clipping was active
    for rank_results in runs:
        losses, norms = rank_results[(model, *layout)]
        assert_losses_close(losses, ref_losses, rtol(model), "loss")
        assert_losses_close(norms, ref_norms, norm_rtol(model), "gradient norm")

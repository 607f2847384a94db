"""Context parallelism against the single-process reference with torch.optim.AdamW, fp32: GPT-2 and a
Llama (RoPE, grouped-query attention with 2 KV groups, SwiGLU, RMSNorm, untied) at CP4, CP2 x TP2 with
sequence parallelism, CP2 x PP2 and CP2 x DP2 on ZeRO-3, each --cp-comm-type (p2p ring, all_gather, a2a:
Ulysses' all-to-all, at CP4, CP2 x TP2 and CP2 x PP2; a2a+p2p at CP4 as two all-to-all groups of 2 and
rings of 2, also with full recomputation on ZeRO-2); and
composed with full and selective recomputation and the interleaved pipeline (4 layers, 2 chunks per
rank). bf16 and fp16 (static loss scale 1024) layouts track the fp32 reference within 3 %, as in
tests/test_model_llama_parity.py.

One 4-rank run trains every layout in turn, 3 steps each with clipping active, on a batch with a loss
mask of 12 tokens per 16-token sample (so the CP ranks' token counts differ and the loss must be summed
over CP and divided by the global count): per step the loss and the global gradient norm match the
reference's within megatron_zero/testing/tolerances.py's bounds derived from the computation.

Tiers: the Llama runs every layout by default; GPT-2 runs the plain CP4 layouts (each comm type) by default
and the rest `slow`. What GPT-2 adds over the Llama in context parallelism is its learned position
embedding taking the chunks' positions and multi-head K/V (the Llama has RoPE and 2 KV groups), and the CP4
layouts cover both for every comm type; the compositions (TP, PP, ZeRO-3, recomputation, the interleaved
pipeline, half precision) run the same context-parallel code for both models."""
import pytest
import torch

from megatron_zero.context_parallel import slice_batch_for_cp
from megatron_zero.model import reference_model
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage, stage_p2p
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol
from megatron_zero.testing.train_step import pipeline_train_step
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

STEPS, GLOBAL_BATCH, SEQ, KEPT, WORLD = 3, 4, 16, 12, 4
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CLIP = 0.5

# (tp, pp, cp, zero stage, cp comm type, other settings); DP = 4 / (tp pp cp)
LAYOUTS = [
    (1, 1, 4, 1, "p2p", ""), (1, 1, 4, 2, "all_gather", ""),           # CP4
    (2, 1, 2, 1, "p2p", ""), (2, 1, 2, 2, "all_gather", ""),           # CP2 x TP2, sequence parallel
    (1, 2, 2, 1, "p2p", ""), (1, 2, 2, 0, "all_gather", ""),           # CP2 x PP2
    (1, 1, 2, 3, "p2p", ""), (1, 1, 2, 3, "all_gather", ""),           # CP2 x DP2, ZeRO-3
    (1, 1, 4, 1, "a2a", ""), (2, 1, 2, 2, "a2a", ""), (1, 2, 2, 1, "a2a", ""),  # Ulysses: CP4, x TP2, x PP2
    (2, 1, 2, 1, "p2p", "full"), (1, 1, 4, 2, "all_gather", "selective"),  # recomputation
    (1, 1, 2, 1, "a2a", "selective"),
    (1, 1, 4, 1, "a2a+p2p", ""), (1, 1, 4, 2, "a2a+p2p", "full"),  # hierarchical: a2a groups of 2, a ring of 2
    (1, 2, 2, 1, "p2p", "interleaved"),                                # 2 model chunks per pipeline rank
    (2, 1, 2, 1, "p2p", "bf16"), (1, 2, 2, 2, "all_gather", "fp16"),   # half precision
]
MODELS = ("gpt", "llama")
HIERARCHICAL_A2A = 2  # --hierarchical-context-parallel-sizes 2 CP/2 (the groups are built at every layout)
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
HALF_TOLERANCE = 0.03
RECOMPUTE = {"full": dict(recompute_granularity="full", recompute_method="uniform"),
             "selective": dict(recompute_granularity="selective")}


def layers(other):
    return 4 if other == "interleaved" else 2


def config(model, num_layers=2, comm_type="p2p", sequence_parallel=False, other=""):
    extra = dict(seq_length=SEQ, max_position_embeddings=SEQ, cp_comm_type=comm_type,
                 sequence_parallel=sequence_parallel, **RECOMPUTE.get(other, {}))
    if model == "gpt":
        return tiny_gpt_config(num_layers=num_layers, **extra)
    return tiny_llama_config(num_layers=num_layers, num_query_groups=2, **extra)


def rtol(model, num_layers):
    """Loss and per-tensor gradient tolerance: lam * sqrt(n) * u, n the terms along one step's path."""
    return model_rtol(gpt_path_length(config(model, num_layers), GLOBAL_BATCH * SEQ))


def norm_rtol(model, num_layers):
    count = sum(p.numel() for p in reference_model(config(model, num_layers)).parameters())
    return global_norm_rtol(rtol(model, num_layers), count)


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 100, (GLOBAL_BATCH, SEQ + 1), generator=g)
    mask = torch.zeros(GLOBAL_BATCH, SEQ)
    for row in mask:  # the same count per sample: micro-batch means average to the batch's mean
        row[torch.randperm(SEQ, generator=g)[:KEPT]] = 1.0
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask


def reference_run(model, num_layers):
    net = reference_model(config(model, num_layers))
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


def train_layout(states, model, tp, pp, cp, stage, comm_type, other):
    if (tp, pp, cp) not in states:  # each layout's groups once (every group holds file descriptors)
        states[(tp, pp, cp)] = build_parallel_state(tp=tp, pp=pp, cp=cp, cp_a2a=HIERARCHICAL_A2A)
    state = states[(tp, pp, cp)]
    cfg = config(model, layers(other), comm_type, tp > 1, other)
    vp = 2 if other == "interleaved" else 1
    net = build_gpt_stage(cfg, state, virtual_stages=vp)
    opt = ZeroOptimizer(list(net.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, bucket_size=3000, module=net,
                        persistence_threshold=100, dtype=other if other in HALF else "fp32",
                        loss_scaler={"dynamic": False, "static_scale": 1024.0}, **HP)
    p2p = stage_p2p(state, activation_shape(1, cfg, tp, cp), HALF.get(other, torch.float32), virtual_stages=vp)
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


def default_tier(model, layout):
    return model == "llama" or (layout[2] == 4 and layout[-1] == "")


CASES = [(model, layout) for model in MODELS for layout in LAYOUTS]
DEFAULT = [case for case in CASES if default_tier(*case)]
SLOW = [case for case in CASES if not default_tier(*case)]


def every_layout(cases):
    states = {}
    return {(model, *layout): train_layout(states, model, *layout) for model, layout in cases}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(every_layout, WORLD, DEFAULT, timeout=900)


@pytest.fixture(scope="module")
def slow_runs():
    return run_ranks(every_layout, WORLD, SLOW, timeout=900)


@pytest.fixture(scope="module")
def references():
    return {(model, n): reference_run(model, n) for model in MODELS for n in (2, 4)}


def case_id(model, layout):
    t, p, c, z, k, o = layout
    return f"{model}-tp{t}-pp{p}-cp{c}-zero{z}-{k}" + (f"-{o}" if o else "")


@pytest.mark.parametrize("model,layout", [pytest.param(*case, id=case_id(*case)) for case in DEFAULT] +
                         [pytest.param(*case, id=case_id(*case), marks=pytest.mark.slow) for case in SLOW])
def test_layout_matches_reference(request, references, model, layout):
    other, n = layout[-1], layers(layout[-1])
    runs = request.getfixturevalue("runs" if default_tier(model, layout) else "slow_runs")
    ref_losses, ref_norms = references[(model, n)]
    assert max(ref_norms) > CLIP  # clipping was active
    for rank_results in runs:
        losses, norms = rank_results[(model, *layout)]
        if other in HALF:
            for got, want in zip(losses, ref_losses):
                assert abs(got - want) <= HALF_TOLERANCE * want, (got, want)
            continue
        assert_losses_close(losses, ref_losses, rtol(model, n), "loss")
        assert_losses_close(norms, ref_norms, norm_rtol(model, n), "gradient norm")

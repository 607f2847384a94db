"""bf16 training sums micro-batch gradients in fp32, the pipeline-tied embedding's included (Megatron's fp32
main_grad): PP2, tied embeddings, 8 micro-batches, ZeRO-1 (blocking and --overlap-grad-reduce) and ZeRO-2.

The embedding's gradient as the optimizer steps on it (its fp32 partition, after the first/last-stage
sum) is compared with the exact (fp64) sum of the 16 bf16 terms: each micro-batch's gradient on each of
the two stages, computed alone (the loss scaled by 1/8 as in the accumulated run: a power of two, so each
term is the bits the accumulated run's backward produces). Summed in fp32, the result is within one bf16
rounding of the exact sum (2^-9 relative) plus the fp32 sums' error (17 additions of at most the sum of
the terms' magnitudes, 2^-24 each). Summed in bf16 (each partial sum rounded), it is not."""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.pipeline.gpt_stage import (activation_shape, build_gpt_stage, make_forward_step,
                                              sync_tied_embedding_grads)
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.pipeline.schedule import forward_backward
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

M, MB = 8, 2
CASES = [(1, False), (1, True), (2, False)]  # (ZeRO stage, overlap_grad_reduce)


def micro_batches():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 100, (M * MB, 9), generator=g)
    return [{"tokens": tokens[j * MB:(j + 1) * MB, :-1], "labels": tokens[j * MB:(j + 1) * MB, 1:].contiguous()}
            for j in range(M)]


def exact_sums(model, state, p2p, micro):
    """Per tied parameter: the fp64 sum of every micro-batch's bf16 gradient on both stages, and of their magnitudes."""
    tied = dict(model.tied_modules.named_parameters())
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in tied.items()}
    magnitude = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in tied.items()}
    step = make_forward_step(model, micro, state)
    for j in range(M):
        model.zero_grad()
        forward_backward(lambda i, x, chunk=0, j=j: step(j, x, chunk), 1, p2p, state.pp_rank, state.pp_size)
        for n, p in tied.items():
            if p.grad is None:  # the last stage's position embedding: unused there
                continue
            total[n] += p.grad.double()
            magnitude[n] += p.grad.double().abs()
    model.zero_grad()
    for t in list(total.values()) + list(magnitude.values()):
        dist.all_reduce(t, group=state.embedding_group)
    return total, magnitude


def tied_grads_fn():
    state = build_parallel_state(pp=2)
    cfg = tiny_gpt_config(params_dtype=torch.bfloat16)
    micro = micro_batches()
    out = []
    for stage, overlap in CASES:
        model = build_gpt_stage(cfg, state)
        p2p = P2P(state.prev_rank, state.next_rank, activation_shape(MB, cfg), torch.bfloat16)
        total, magnitude = exact_sums(model, state, p2p, micro)
        names = list(dict(model.named_parameters()))
        opt = ZeroOptimizer(list(model.named_parameters()), stage=stage, dtype="bf16", overlap_grad_reduce=overlap)
        forward_backward(make_forward_step(model, micro, state), M, p2p, state.pp_rank, state.pp_size,
                         backward_loss=opt.backward, before_last_backward=opt.arm_grad_reduce)
        sync_tied_embedding_grads(model, state)
        partition, where = opt.impl.grad_partitions()[0], opt.param_slice_mappings()[0]
        got = {}
        for name in total:
            full = next(n for n in names if n.endswith("tied_modules." + name))
            frag = where[full]
            got[name] = partition[frag.start:frag.start + frag.numel].double().view(total[name].shape)
        out.append((got, total, magnitude))
    return out


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tied_embedding_gradient_is_summed_in_fp32(case, tied_runs):
    for got, total, magnitude in (rank[case] for rank in tied_runs):
        for name in total:
            bound = 2.0 ** -9 * total[name].abs() + 17 * 2.0 ** -24 * magnitude[name]
            err = (got[name] - total[name]).abs()
            assert (err <= bound).all(), (CASES[case], name, (err - bound).max().item())


@pytest.fixture(scope="module")
def tied_runs():
    return run_ranks(tied_grads_fn, 2, timeout=300)

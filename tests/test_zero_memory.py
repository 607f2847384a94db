"""Bytes held per rank: optimizer state 12Ψ/DP (+ padding) at stage 1/2, no full gradient at stage 2,
parameters ≈ Ψ/DP + a layer or two (current + prefetched) at stage 3."""
import torch
import torch.distributed as dist

from megatron_zero.testing import run_ranks
from test_zero_helpers import HP, ToyGPT, batch, zero_run


def memory_runs():
    out = {}
    for stage in (1, 2, 3):
        run = zero_run(stage, steps=2, layers=4, bucket_size=300)
        out[stage] = run["memory"]
    from megatron_zero.zero import ZeroOptimizer
    model = ToyGPT(layers=4)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=3, module=model,
                        bucket_size=300, **HP)
    tokens, labels = batch(0)
    opt.backward(model(tokens[:4], labels[:4]))
    units = sorted((sum(p.ds_numel for p in u) for u in opt.impl.unit_params), reverse=True)
    out["stage3"] = dict(peak=opt.impl.peak_param_numel, units=units, gathered_after=opt.impl.gathered_numel(),
                         grads_after=[p.grad for p in model.parameters()].count(None))
    model2 = ToyGPT(layers=4)
    opt2 = ZeroOptimizer(list(model2.named_parameters()), dp_group=dist.group.WORLD, stage=2, bucket_size=300, **HP)
    opt2.backward(model2(tokens[:4], labels[:4]))
    out["stage2"] = dict(peak=opt2.impl.peak_grad_numel, largest=max(p.numel() for p in model2.parameters()),
                         held=sum(p.grad is not None for p in model2.parameters()))
    return out


def test_bytes_per_rank():
    psi = sum(p.numel() for p in ToyGPT(layers=4).parameters())
    dp = 2
    for rank_result in run_ranks(memory_runs, dp, timeout=120):
        for stage in (1, 2, 3):
            optim = rank_result[stage]["optimizer_state"]
            assert 12 * psi / dp <= optim <= 12 * (psi + 2 * dp) / dp, (stage, optim)
        s2 = rank_result["stage2"]
        assert s2["held"] == 0 and s2["peak"] <= 300 + s2["largest"] < psi  # never the full gradient
        s3 = rank_result["stage3"]
        assert s3["gathered_after"] == 0 and s3["grads_after"] == len(list(ToyGPT(layers=4).parameters()))
        assert s3["peak"] <= s3["units"][0] + s3["units"][1] < psi  # one layer + the prefetched one
        n_params = len(list(ToyGPT(layers=4).parameters()))
        assert rank_result[3]["params"] <= 4 * (psi / dp + n_params)  # between steps: the fp32 shard only

"""Bytes held per rank: optimizer state 12Ψ/DP (+ padding) at stage 1/2, no full gradient at stage 2,
parameters ≈ Ψ/DP + the persistent (small) parameters + a layer or two (current + prefetched) at
stage 3, gathered with one all-gather per layer."""
import torch.distributed as dist

from megatron_zero.testing import run_ranks
from megatron_zero.testing.toy_zero import HP, ZERO3_PERSIST, ToyGPT, batch, zero_run


def memory_runs():
    out = {}
    for stage in (1, 2, 3):
        run = zero_run(stage, steps=2, layers=4, bucket_size=300)
        out[stage] = run["memory"]
    from megatron_zero.zero import ZeroOptimizer
    model = ToyGPT(layers=4)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=3, module=model,
                        bucket_size=300, **ZERO3_PERSIST, **HP)
    tokens, labels = batch(0)
    opt.backward(model(tokens[:4], labels[:4]))
    impl = opt.impl
    units = sorted((sum(p.ds_numel for p in u) for u in impl.unit_params), reverse=True)
    out["stage3"] = dict(peak=impl.peak_param_numel, units=units, gathered_after=impl.gathered_numel(),
                         persistent=sum(p.ds_numel for p in impl.persistent),
                         grads_after=[p.grad for p in model.parameters()].count(None))
    opt.step()  # the second step prefetches along the first one's order
    before = impl.gather_calls
    opt.backward(model(tokens[4:], labels[4:]))
    out["stage3"].update(gathers=impl.gather_calls - before, gathering_units=sum(map(bool, impl.unit_params)),
                         gathered_params=sum(map(len, impl.unit_params)))
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
        # the persistent parameters (LayerNorms and biases here: at most 100 elements each) stay gathered,
        # as DeepSpeed's stage3_param_persistence_threshold keeps them; everything else is released
        persistent = s3["persistent"]
        assert 0 < persistent < psi / 10
        assert s3["gathered_after"] == persistent and s3["grads_after"] == len(list(ToyGPT(layers=4).parameters()))
        # one layer + the prefetched one, on top of the persistent parameters
        assert s3["peak"] <= s3["units"][0] + s3["units"][1] + persistent < psi
        # one coalesced all-gather per unit in forward and one in backward, not one per parameter
        assert s3["gathers"] == 2 * s3["gathering_units"] < 2 * s3["gathered_params"], s3
        n_params = len(list(ToyGPT(layers=4).parameters()))
        # between steps: the fp32 shard (+ padding) and the persistent parameters, gathered
        assert rank_result[3]["params"] <= 4 * (psi / dp + n_params + persistent)


def bf16_zero1_bytes():
    """bf16 GPT, ZeRO-1 over every rank (in a process without a process group: one rank, no group): bytes
    held after backward and after the step, and the flat size."""
    import torch

    from megatron_zero.model import GPTConfig, GPTModel
    from megatron_zero.zero import ZeroOptimizer

    config = GPTConfig(vocab_size=512, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
                       max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                       params_dtype=torch.bfloat16)
    model = GPTModel(config)
    opt = ZeroOptimizer(list(model.named_parameters()), stage=1, dtype="bf16",
                        dp_group=dist.group.WORLD if dist.is_initialized() else None,
                        bucket_size=2000, lr=1e-3)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    opt.backward(model(tokens[:, :-1], labels=tokens[:, 1:]))
    after_backward = opt.memory_bytes()
    opt.step()
    return dict(after_backward=after_backward, after_step=opt.memory_bytes(),
                padded=opt.impl.parts[0].padded_numel, psi=sum(p.numel() for p in model.parameters()))


def test_bf16_zero1_bytes_per_parameter_are_megatrons():
    """Megatron's distributed optimizer: bf16 weights (2), the fp32 gradient buffer (4), fp32 masters and two
    moments over N ranks (12 / N): 18 bytes a parameter on one rank, 12 on two. The fp32 gradient partition
    this rank's optimizer reads is its stretch of the accumulation buffer, not a second tensor (before:
    4 / N more)."""
    for dp in (1, 2):
        for r in [bf16_zero1_bytes()] if dp == 1 else run_ranks(bf16_zero1_bytes, dp, timeout=120):
            padded = r["padded"]
            assert padded - r["psi"] < 2 * dp  # DeepSpeed's alignment padding only
            assert r["after_backward"]["grads"] == 4 * padded, (dp, r)  # the buffer, nothing beside it
            held = r["after_step"]  # (the moments exist from the first step on)
            assert held == dict(params=2 * padded, grads=4 * padded, optimizer_state=12 * padded // dp), (dp, held)
            assert sum(held.values()) == (18 if dp == 1 else 12) * padded

"""ZeRO-Offload's gradients (zero/host_grads.py): under an offloaded optimizer the reduced fp32 gradient partitions
live in host memory and each bucket is added into them as it lands, in launch order.

2 ranks, 2 micro-batches a step (the host partitions accumulate across them at ZeRO 2/3), stages 1-3 and stage 2
with overlapped (async) reduction: the first step's gradient partitions equal the run without offload bit for bit
(the same sums in the same order); the later steps differ only by the two Adam kernels (the C++ CPU Adam against
the device's multi-tensor AdamW, a few ulps of each update: tests/test_zero_offload.py), so the losses within
relative 1e-6. The command-line runs (tests/test_zero_offload_cli.py, slow) show the same through pretrain_gpt.py.
"""
import torch
import torch.distributed as dist

from megatron_zero.distributed.device import HOST
from megatron_zero.testing import run_ranks
from megatron_zero.testing.toy_zero import GLOBAL_BATCH, HP, ZERO3_PERSIST, ToyGPT, batch
from megatron_zero.zero import ZeroOptimizer
from megatron_zero.zero.host_grads import SLOTS

CASES = {"stage1": dict(stage=1), "stage2": dict(stage=2), "stage2_overlap": dict(stage=2, overlap_grad_reduce=True),
         "stage3": dict(stage=3)}


def _train(offload, case, steps=2, micro=2):
    rank, dp = dist.get_rank(), dist.get_world_size()
    model = ToyGPT()
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, module=model, offload=offload,
                        bucket_size=600, **ZERO3_PERSIST, **HP, **case)
    per = GLOBAL_BATCH // dp // micro
    losses, grads = [], []
    for s in range(steps):
        tokens, labels = batch(s)
        for m in range(micro):
            rows = slice((rank * micro + m) * per, (rank * micro + m + 1) * per)
            if m == micro - 1:
                opt.arm_grad_reduce()  # (the overlapped stages reduce in the last backward)
            loss = model(tokens[rows], labels[rows]) / micro
            opt.backward(loss)
            losses.append(loss.item())
        grads.append([g.detach().clone() for g in opt.impl.grad_partitions()])
        opt.step()
    host = [g.device == HOST for g in opt.impl.grad_partitions()]
    ring = opt.impl.buckets.host if hasattr(opt.impl, "buckets") else opt.impl.host  # stages 1/2, stage 3
    return losses, grads, host, sum(s is not None for s in ring._slots) if ring is not None else 0


def _both():
    return {name: (_train("cpu", case), _train("none", case)) for name, case in CASES.items()}


def test_offloaded_gradients_are_the_device_runs_sums():
    for result in run_ranks(_both, 2):
        for name, ((losses, grads, host, slots), (ref_losses, ref_grads, _, _)) in result.items():
            assert all(host) and 0 < slots <= SLOTS, (name, host, slots)
            assert all(torch.equal(a, b) for a, b in zip(grads[0], ref_grads[0])), name
            assert losses[:2] == ref_losses[:2], name
            assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0), name

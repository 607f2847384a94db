"""ZeRO-Offload's pipelined step (zero/offload.py): chunked CPU Adam, gradients down on a side stream.

On the CPU the gradients are used in place and the stream is None (the same loop); the `gpu` test
runs the copies on a CUDA side stream into pinned buffers and checks the result against the CPU's.
Tolerances: chunking is exact (Adam is elementwise), so chunked == whole bit for bit; against the
on-device MultiTensorAdamW, relative 1e-6 (the fallback math vs the C++ kernel's order of ops).
"""
import pytest
import torch

from megatron_zero.distributed.device import HOST
from megatron_zero.zero.offload import FlatAdamW

HP = [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                                                          weight_decay=0.0)]


def _run(offload, chunk_numel=None, device=HOST, steps=3):
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(10_007, generator=g), torch.randn(333, generator=g)]
    grads = [[torch.randn(m.numel(), generator=g) for m in masters] for _ in range(steps)]
    opt = FlatAdamW([m.to(device) for m in masters], HP, offload, device=device)
    if chunk_numel is not None:
        opt.chunk_numel = chunk_numel
    for step_grads in grads:
        opt.step([x.to(device) for x in step_grads])
    return opt, [p.data.to(HOST) for p in opt.params], [opt.state(i) for i in range(2)]


def test_chunked_offload_step_is_exact_and_matches_the_device_optimizer():
    _, whole, st_whole = _run("cpu")
    _, chunked, st_chunked = _run("cpu", chunk_numel=1000)  # 11 chunks, the last one short
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(st_whole, st_chunked) for k in a)
    _, ref, _ = _run("none")
    for a, b in zip(chunked, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_offload_from_gpu_copies_on_a_side_stream_into_pinned_memory(cuda_device):
    """Gradients on the GPU come down on the offload's copy stream, chunk by chunk, into pinned
    buffers; the result equals the same optimizer on the CPU bit for bit (same CPU math)."""
    dev = cuda_device
    opt, got, _ = _run("cpu", chunk_numel=1000, device=dev)
    assert isinstance(opt.stream, torch.cuda.Stream) and all(s.is_pinned() for s in opt.grad_staging)
    _, want, _ = _run("cpu", chunk_numel=1000)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

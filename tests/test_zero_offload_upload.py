"""ZeRO-Offload's step + copy (zero/offload.py): each stepped chunk's new weights go up at once.

On a GPU, ZeroOptimizer hands an offloaded FlatAdamW the stage's weight buffers (``weight_slices``)
and the step uploads every chunk into them as soon as the CPU has stepped it; ``write_weights``
then publishes from those buffers in place. On the CPU there is nothing to upload, so ZeroOptimizer
does not wire it; the CPU tests below wire it as the GPU does (the same code, the copies synchronous)
to check the chunk ring, the in-step cast and the in-place all-gathers of every stage.
Tolerances: bit-exact against the path that steps first and casts in write_weights (the same cast
of the same fp32 values); fp32 offload against the on-device optimizer, relative 1e-6.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_zero.distributed.device import HOST
from megatron_zero.testing import run_ranks
from megatron_zero.testing.toy_zero import GLOBAL_BATCH, HP, ZERO3_PERSIST, ToyGPT, batch
from megatron_zero.zero import ZeroOptimizer
from megatron_zero.zero.offload import UPLOAD_SLOTS, FlatAdamW

ADAM = [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
        dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)]


def _flat_run(offload, dtype, tmp_path, device=HOST, upload=True, steps=3, chunk_numel=1000):
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(10_007, generator=g), torch.randn(333, generator=g)]
    grads = [[torch.randn(m.numel(), generator=g) for m in masters] for _ in range(steps)]
    slices = [torch.full((m.numel(),), float("nan"), dtype=dtype, device=device) for m in masters] if upload else None
    opt = FlatAdamW([m.to(device) for m in masters], ADAM, offload, nvme_path=str(tmp_path / "nvme"),
                    device=device, weight_slices=slices)
    opt.chunk_numel = chunk_numel
    published = []
    for step_grads in grads:
        with opt.paged():
            opt.step([x.to(device) for x in step_grads])
            published.append([w.to(HOST, dtype, copy=True) for w in opt.weights()])
    with opt.paged() as params:
        return [p.data.clone() for p in params], published


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_each_stepped_chunk_is_written_to_the_weight_slices(offload, dtype, tmp_path):
    """11 chunks per step through UPLOAD_SLOTS slots: every published weight is the master cast,
    bit for bit, and the masters are those of the step without uploads."""
    assert 10_007 // 1000 > UPLOAD_SLOTS  # the slots are reused within a step
    masters, published = _flat_run(offload, dtype, tmp_path)
    want_masters, want_published = _flat_run(offload, dtype, tmp_path, upload=False)
    assert all(torch.equal(a, b) for a, b in zip(masters, want_masters))
    for got, want in zip(published, want_published):  # want: the masters themselves, cast here
        assert all(torch.equal(a.view(-1).float(), b.to(dtype).float()) for a, b in zip(got, want))


def test_weight_slices_of_the_wrong_size_or_without_offload_are_refused():
    masters = [torch.zeros(10)]
    with pytest.raises(ValueError, match="partition's size"):
        FlatAdamW(masters, ADAM[:1], "cpu", weight_slices=[torch.zeros(9)])
    with pytest.raises(ValueError, match="offloaded optimizer"):
        FlatAdamW(masters, ADAM[:1], "none", weight_slices=[torch.zeros(10)])


def _rne_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, NaN -> 0x7fc0 (what CUDA's __float2bfloat16 does)."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def test_host_cast_rounds_to_nearest_even_as_the_device_cast():
    """The offload casts on the host (the C++ step's low_out, torch's CPU cast); both round to nearest
    even, as the CUDA cast does: ties, subnormals, the fp16 overflow edge, infinities."""
    g = torch.Generator().manual_seed(0)
    edge = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 65504.0, 65519.0, 65520.0, 2**-24, 2**-25,
                         3 * 2**-26, 1e-40, float("inf"), -float("inf"), 0.0, -0.0, 3.3895e38])
    x = torch.cat([torch.randn(100_000, generator=g) * torch.logspace(-30, 30, 100_000), edge])
    assert np.array_equal(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), _rne_bf16_bits(x.numpy()))
    with np.errstate(over="ignore"):  # beyond 65520: inf, as torch gives
        assert np.array_equal(x.to(torch.float16).numpy(), x.numpy().astype(np.float16))  # numpy: IEEE RNE
    nan = torch.tensor([float("nan")])
    assert torch.isnan(nan.to(torch.bfloat16)).all() and torch.isnan(nan.to(torch.float16)).all()


CASES = {"stage1_bf16": dict(stage=1, dtype="bf16"), "stage2_fp16": dict(stage=2, dtype="fp16"),
         "stage2_fp32": dict(stage=2, dtype="fp32"), "stage3_bf16": dict(stage=3, dtype="bf16"),
         "stage1_overlap_gather_bf16": dict(stage=1, dtype="bf16", overlap_param_gather=True),
         "stage2_nvme_bf16": dict(stage=2, dtype="bf16", offload="nvme")}


def _train(upload, nvme, stage, dtype, offload="cpu", steps=3, device=HOST, dp_group="world", **kw):
    dp_group = dist.group.WORLD if dp_group == "world" else dp_group
    rank = dist.get_rank() if dp_group is not None else 0
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    model = ToyGPT().to(device)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dp_group, stage=stage, dtype=dtype, module=model,
                        offload=offload, nvme_path=f"{nvme}/{upload}", bucket_size=600, device=device,
                        **ZERO3_PERSIST, **HP, **kw)
    if device == HOST and upload:  # as ZeroOptimizer wires it on a GPU
        opt.optimizer.weight_slices = opt.impl.weight_slices()
    if device != HOST and not upload:  # the path before step + copy: write_weights brings the masters up
        opt.optimizer.weight_slices = None
    opt.optimizer.chunk_numel = 300  # several chunks per group
    per = GLOBAL_BATCH // dp
    losses = []
    for s in range(steps):
        tokens, labels = (t[rank * per:(rank + 1) * per].to(device) for t in batch(s))
        loss = model(tokens, labels)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    opt.wait_params()
    weights = [w.detach().to(HOST, copy=True) for w in opt.impl.weight_slices()]
    full = [f.detach().to(HOST, copy=True) for f in getattr(opt.impl, "flat", [])]  # stage 1/2: every rank's
    with opt.optimizer.paged() as masters:
        return {"losses": losses, "weights": weights, "full": full,
                "masters": [m.detach().to(HOST, copy=True) for m in masters]}


def _upload_vs_cast(nvme):
    return {name: (_train(True, nvme, **case), _train(False, nvme, **case)) for name, case in CASES.items()}


def test_every_stage_publishes_uploaded_slices_in_place_as_it_published_masters(tmp_path):
    """2 ranks, 3 steps: the step that writes the stage's weight buffers and all-gathers them in place
    equals, bit for bit, the step that casts the masters in write_weights (stages 1-3, fp32/bf16/fp16,
    overlapped parameter gathers, NVMe)."""
    for rank_result in run_ranks(_upload_vs_cast, 2, str(tmp_path)):
        for name, (up, cast) in rank_result.items():
            assert up["losses"] == cast["losses"], name
            for key in ("weights", "full", "masters"):
                assert all(torch.equal(a, b) for a, b in zip(up[key], cast[key])), (name, key)


# ---- on a GPU ---------------------------------------------------------------------------------------------
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (torch {torch.__version__}); the GPU tier runs on a GPU machine")
    return torch.device("cuda", 0)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2])
def test_offloaded_zero_step_on_cuda_matches_the_device_step_in_fp32(stage, tmp_path):
    dev = _cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    off = _train(True, tmp_path, stage, "fp32", device=dev, dp_group=None)
    on = _train(True, tmp_path, stage, "fp32", offload="none", device=dev, dp_group=None)
    for a, b in zip(off["masters"] + off["weights"], on["masters"] + on["weights"]):
        assert float((a - b).norm() / b.norm()) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("stage,dtype,offload", [(1, "bf16", "cpu"), (2, "bf16", "cpu"), (2, "fp16", "cpu"),
                                                 (3, "bf16", "cpu"), (2, "bf16", "nvme"), (2, "fp32", "cpu")])
def test_offloaded_step_plus_copy_on_cuda_is_bit_equal_to_the_old_path(stage, dtype, offload, tmp_path):
    dev = _cuda()
    up = _train(True, tmp_path, stage, dtype, offload=offload, device=dev, dp_group=None)
    old = _train(False, tmp_path, stage, dtype, offload=offload, device=dev, dp_group=None)
    assert up["losses"] == old["losses"]
    for key in ("weights", "masters"):
        assert all(torch.equal(a, b) for a, b in zip(up[key], old[key])), key


@pytest.mark.gpu
def test_write_weights_gets_device_tensors_and_copies_nothing_from_the_host():
    dev = _cuda()
    model = ToyGPT().to(dev)
    opt = ZeroOptimizer(list(model.named_parameters()), stage=2, dtype="bf16", offload="cpu", device=dev, **HP)
    opt.optimizer.chunk_numel = 300  # several chunks: both slots in use
    # the gradients come down as their buckets land, into pinned host partitions (zero/host_grads.py): no staging
    assert all(s is None for s in opt.optimizer.grad_staging)
    assert all(g.device == HOST and g.is_pinned() for g in opt.impl.grad_partitions())
    seen, host_copies = [], []

    class HostCopies(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            if any(t.device.type == "cuda" for t in tensors) and any(t.device == HOST for t in tensors):
                host_copies.append(func)
            return func(*args, **kwargs)

    publish = opt.impl.write_weights

    def write_weights(masters):
        seen.extend((m.device, m.dtype, m.data_ptr()) for m in masters)
        with HostCopies():
            return publish(masters)

    opt.impl.write_weights = write_weights
    tokens, labels = (t.to(dev) for t in batch(0))
    opt.backward(model(tokens, labels))
    opt.step()
    torch.cuda.synchronize(dev)
    assert seen == [(s.device, torch.bfloat16, s.data_ptr()) for s in opt.impl.weight_slices()]
    assert all(d.type == "cuda" for d, _, _ in seen) and not host_copies
    assert all(s is not None and s.is_pinned() and s.dtype == torch.bfloat16 for s in opt.optimizer._slots)


@pytest.mark.gpu
def test_host_cast_equals_the_cuda_cast():
    dev = _cuda()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1_000_003, generator=g) * torch.logspace(-30, 30, 1_000_003)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(x.to(dtype).view(torch.int16), x.to(dev).to(dtype).cpu().view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_gradients_come_down_into_pinned_host_partitions(stage):
    """--cpu-optimizer on a GPU: each reduced bucket is copied down on the side stream into pinned host memory
    as it lands (zero/host_grads.py); at ZeRO 2/3 the device then holds no fp32 gradient partition: after
    backward it holds that partition's bytes less than the run without offload."""
    dev = _cuda()
    held, grads = {}, {}
    for offload in ("none", "cpu"):
        torch.manual_seed(0)
        model = ToyGPT().to(dev)
        opt = ZeroOptimizer(list(model.named_parameters()), stage=stage, offload=offload, device=dev,
                            bucket_size=600, module=model, **ZERO3_PERSIST, **HP)
        tokens, labels = (t.to(dev) for t in batch(0))
        opt.backward(model(tokens, labels))
        parts = opt.impl.grad_partitions()
        torch.cuda.synchronize(dev)
        held[offload], grads[offload] = opt.memory_bytes()["grads"], [g.to(HOST, copy=True) for g in parts]
        if offload == "cpu":
            assert all(g.device == HOST and g.is_pinned() for g in parts)
            assert opt.memory_bytes()["host_grads"] >= sum(g.numel() * 4 for g in parts)
        opt.step()
        del model, opt
    # the same sums (but for the order of CUDA's atomic adds in the embedding's backward, run to run)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(grads["cpu"], grads["none"]))
    if stage >= 2:
        assert held["none"] - held["cpu"] == sum(g.numel() * 4 for g in grads["cpu"])

"""The GPU tier: training, fused kernels in the training path, offload and checkpoints on CUDA.

Every test is marked `gpu` and skipped, with the reason, where torch sees no CUDA device.
MEGATRON_ZERO_TEST_DEVICE=cpu runs the tests that do not need the CUDA kernels on the CPU
instead (their logic checked on a machine without a GPU; the kernel tests still skip).
Tolerances: fp32 on the GPU against the same step on the CPU, relative 1e-5 (the GEMMs
sum in another order; TF32 is off); fused kernels against the fallback inside a model,
relative 1e-4 in fp32.
"""
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_zero import ops
from megatron_zero.device import HOST, backend_for
from megatron_zero.distributed import shutdown_distributed
from megatron_zero.testing.multirank import free_port
from megatron_zero.testing.launch import losses_from_log, model_flags, torchrun

pytestmark = pytest.mark.gpu
FORCED = os.environ.get("MEGATRON_ZERO_TEST_DEVICE")


@pytest.fixture(scope="module")
def device():
    if FORCED:
        dev = torch.device(FORCED)
    elif torch.cuda.is_available():
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        pytest.skip(f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
                    "the GPU tier runs on a GPU machine")
    if not dist.is_initialized():  # one rank: a ParallelState needs a default group
        dist.init_process_group(backend_for(dev), init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    yield dev
    shutdown_distributed()


@pytest.fixture
def kernels(device):
    if device.type != "cuda":
        pytest.skip("the fused CUDA kernels need a CUDA device")
    status = ops.available_kernels()
    assert all(v is True for v in status.values()), f"a CUDA device is present but kernels are not: {status}"


def _args(corpus, tmp_path, **extra):
    from megatron_zero.arguments import parse_args
    data, tok = corpus
    flags = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
             "micro-batch-size": 2, "global-batch-size": 8, "train-iters": 4, "eval-iters": 0,
             "log-interval": 100, "data-cache-path": tmp_path / "cache", "zero-stage": 1}
    flags.update(extra)
    return parse_args(model_flags(data, tok, **flags), world_size=1)


def _trainer(args, device):
    from megatron_zero.topology import build_parallel_state
    from megatron_zero.training import Trainer
    return Trainer(args, build_parallel_state(1, 1), device)


def _train(trainer, iters):
    losses = []
    for _ in range(iters):
        micro = trainer._micro_batches(trainer.train_ds, trainer.progress.consumed_train_samples)
        losses.append(trainer.train_step(micro)[0].item())  # the loss stays on the device until read
        trainer.progress.consumed_train_samples += trainer.args.global_batch_size
        trainer.lr_schedule.step()
    return losses


def _params(trainer):
    return {n: p.detach().to(HOST, torch.float32) for n, p in trainer.model.named_parameters()}


def _unfused():
    return dict(masked_softmax_fusion=False, bias_gelu_fusion=False, persist_layer_norm=False)


def test_fp32_step_on_gpu_matches_cpu(builtin_corpus, tmp_path, device):
    """Three fp32 steps (fusions off) on the device and on the CPU: losses and weights to 1e-5."""
    flags = {f"no-{k.replace('_', '-')}": True for k in _unfused()}
    here = _trainer(_args(builtin_corpus, tmp_path, **flags), device)
    ref = _trainer(_args(builtin_corpus, tmp_path, **flags), HOST)
    a, b = _train(here, 3), _train(ref, 3)
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)
    pa, pb = _params(here), _params(ref)
    for n in pb:
        rel = ((pa[n] - pb[n]).norm() / pb[n].norm().clamp_min(1e-12)).item()
        assert rel <= 1e-5, (n, rel)


def _count_kernel_calls(monkeypatch):
    from megatron_zero.ops import bias_gelu, layer_norm, rms_norm, rope, softmax
    calls = {"layer_norm": 0, "softmax": 0, "bias_gelu": 0, "rms_norm": 0, "rope": 0}
    for key, cls in (("layer_norm", layer_norm._FusedLayerNorm), ("softmax", softmax._FusedCausalSoftmax),
                     ("bias_gelu", bias_gelu._FusedBiasGelu), ("rms_norm", rms_norm._FusedRMSNorm),
                     ("rope", rope._FusedRope)):
        def counted(*a, _apply=cls.apply, _key=key):
            calls[_key] += 1
            return _apply(*a)
        monkeypatch.setattr(cls, "apply", counted)
    return calls


def test_fused_kernels_run_in_training_and_match_fallback(builtin_corpus, tmp_path, device, kernels, monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    fused = _train(_trainer(_args(builtin_corpus, tmp_path), device), 3)
    gpt2 = ("layer_norm", "softmax", "bias_gelu")
    assert all(calls[k] > 0 for k in gpt2), calls
    flags = {f"no-{k.replace('_', '-')}": True for k in _unfused()}
    plain = _train(_trainer(_args(builtin_corpus, tmp_path, **flags), device), 3)
    assert all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(fused, plain)), (fused, plain)


LLAMA = {"normalization": "RMSNorm", "position-embedding-type": "rope", "swiglu": True, "disable-bias-linear": True,
         "attention-backend": "unfused"}


def test_llama_kernels_run_in_training_and_match_fallback(builtin_corpus, tmp_path, device, kernels, monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    fused = _train(_trainer(_args(builtin_corpus, tmp_path, **LLAMA), device), 3)
    assert calls["rms_norm"] > 0 and calls["rope"] > 0 and calls["layer_norm"] == 0, calls
    plain = _train(_trainer(_args(builtin_corpus, tmp_path, **LLAMA, **{"no-persist-layer-norm": True,
                                                                        "no-rope-fusion": True}), device), 3)
    assert all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(fused, plain)), (fused, plain)


@pytest.mark.parametrize("flag,kernel", [("no-persist-layer-norm", "rms_norm"), ("no-rope-fusion", "rope")])
def test_llama_fusion_flags_turn_their_kernel_off(builtin_corpus, tmp_path, device, kernels, monkeypatch, flag, kernel):
    calls = _count_kernel_calls(monkeypatch)
    _train(_trainer(_args(builtin_corpus, tmp_path, **LLAMA, **{flag: True}), device), 1)
    other = {"rms_norm": "rope", "rope": "rms_norm"}[kernel]
    assert calls[kernel] == 0 and calls[other] > 0, calls


@pytest.mark.parametrize("flag,kernel", [("no-masked-softmax-fusion", "softmax"),
                                         ("no-bias-gelu-fusion", "bias_gelu"),
                                         ("no-persist-layer-norm", "layer_norm")])
def test_each_fusion_flag_turns_its_kernel_off(builtin_corpus, tmp_path, device, kernels, monkeypatch, flag, kernel):
    calls = _count_kernel_calls(monkeypatch)
    _train(_trainer(_args(builtin_corpus, tmp_path, **{flag: True}), device), 1)
    assert calls[kernel] == 0 and all(calls[k] > 0 for k in ("layer_norm", "softmax", "bias_gelu") if k != kernel), calls


def test_multi_tensor_adam_steps_the_zero_partition(builtin_corpus, tmp_path, device, kernels, monkeypatch):
    from megatron_zero.ops.registry import load
    ext, seen = load("megatron_zero._C_cuda"), []
    monkeypatch.setattr(ext, "multi_tensor_adamw", lambda *a, _f=ext.multi_tensor_adamw: seen.append(1) or _f(*a))
    _train(_trainer(_args(builtin_corpus, tmp_path, **{"zero-stage": 2}), device), 2)
    assert len(seen) == 2 * 2  # two param groups, two steps


def test_gradient_accumulation_fusion_keeps_fp32_main_grads(builtin_corpus, tmp_path, device):
    on = _trainer(_args(builtin_corpus, tmp_path, bf16=True), device)
    off = _trainer(_args(builtin_corpus, tmp_path, bf16=True, **{"no-gradient-accumulation-fusion": True}), device)
    assert [g.dtype for g in on.optimizer.impl.main_grads] == [torch.float32] * 2
    assert off.optimizer.impl.main_grads is None
    assert {g.device for g in on.optimizer.impl.main_grads} == {device}


def test_bf16_training_lowers_the_loss(builtin_corpus, tmp_path, device):
    losses = _train(_trainer(_args(builtin_corpus, tmp_path, bf16=True, lr=3e-3, **{"train-iters": 30}),
                             device), 30)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def test_offload_keeps_masters_in_pinned_host_memory_and_matches(builtin_corpus, tmp_path, device):
    off = _trainer(_args(builtin_corpus, tmp_path, **{"cpu-optimizer": True}), device)
    assert all(p.device == HOST and p.is_pinned() == (device.type == "cuda") for p in off.optimizer.optimizer.params)
    here = _trainer(_args(builtin_corpus, tmp_path), device)
    a, b = _train(off, 3), _train(here, 3)
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)


def _save(trainer, path, async_save=False):
    from megatron_zero import checkpoint as ckpt
    trainer.args.save, trainer.args.async_save = str(path), async_save
    trainer.progress.iteration = 2
    trainer.save()
    ckpt.finalize_async_saves()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_on_gpu_load_on_cpu_and_back_bit_exact(builtin_corpus, tmp_path, device, async_save):
    gpu = _trainer(_args(builtin_corpus, tmp_path), device)
    _train(gpu, 2)
    _save(gpu, tmp_path / "a", async_save)
    cpu = _trainer(_args(builtin_corpus, tmp_path, load=tmp_path / "a"), HOST)
    assert all(torch.equal(x, y) for x, y in zip(_params(gpu).values(), _params(cpu).values()))
    _save(cpu, tmp_path / "b")
    back = _trainer(_args(builtin_corpus, tmp_path, load=tmp_path / "b"), device)
    assert all(torch.equal(x, y) for x, y in zip(_params(gpu).values(), _params(back).values()))
    assert _train(back, 2) == _train(gpu, 2)  # moments and masters came back too


def _rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_save_from_gpu_keeps_host_memory_bounded(tmp_path, device):
    """Save 8 x 64 MiB device tensors (some as views of one flat buffer): host RSS may grow by the
    256 MiB staging buffer the bytes pass through chunk by chunk (checkpoint/storage/staging.py) plus 32 MiB,
    never by the state (512 MiB)."""
    from megatron_zero.checkpoint.storage.tensor_io import load_file, save_file
    if device.type != "cuda":
        pytest.skip("on the CPU the tensors already are host memory; the bound is about device tensors")
    n = 16 << 20  # 64 MiB of fp32
    flat = torch.randn(4 * n, device=device)
    state = {f"view{i}": flat[i * n:(i + 1) * n] for i in range(4)}
    state.update({f"t{i}": torch.randn(n, device=device) for i in range(4)})
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    save_file(state, str(tmp_path / "state.pt"))
    done.set()
    sampler.join()
    grown = peak[0] - before
    assert grown <= (256 << 20) + (32 << 20), f"host RSS grew by {grown >> 20} MiB"
    loaded = load_file(str(tmp_path / "state.pt"))
    assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
    assert os.path.getsize(tmp_path / "state.pt") < 8 * n * 4 + (1 << 20)  # views saved as their own bytes


@pytest.mark.parametrize("layout", [
    {"tensor-model-parallel-size": 2}, {"pipeline-model-parallel-size": 2},
    {"zero-stage": 1}, {"zero-stage": 2}, {"zero-stage": 3}])
def test_two_gpus_nccl_layouts_match_one_gpu(builtin_corpus, tmp_path, layout):
    """TP2 / PP2 / DP2 ZeRO-1..3 over NCCL: the loss curve of 6 fp32 iterations equals one GPU's (rel 1e-5)."""
    if not FORCED and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, torch sees {torch.cuda.device_count()}")
    data, tok = builtin_corpus
    base = {"train-iters": 6, "eval-iters": 0, "data-cache-path": tmp_path / "cache",
            "device": FORCED or "cuda", "no-masked-softmax-fusion": True, "no-bias-gelu-fusion": True,
            "no-persist-layer-norm": True}

    def run(nproc, **extra):
        out = torchrun(nproc, model_flags(data, tok, **base, **extra), timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return losses_from_log(out.stdout)

    one = run(1)
    two = run(2, **layout)
    assert len(one) == len(two) == 6
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(two, one)), (two, one)

"""The GPU tier: training, fused kernels in the training path, offload and checkpoints on CUDA.

Every test is marked `gpu` and skipped, with the reason, where torch sees no CUDA device.
MEGATRON_ZERO_TEST_DEVICE=cpu runs them on the CPU instead (their logic checked on a machine without a
GPU): the kernel-counting tests count the CPU kernels' calls there (the same autograd functions and
extension plumbing; the CPU has no LayerNorm or RoPE kernel, so the checks that only those can answer
skip), and the two-GPU layouts run on gloo. Tolerances come from the computation
(megatron_zero/testing/tolerances.py): the device's step against the CPU's, or the fused kernels
against the fallback, is the same fp32 computation summed in another order, so each step's loss and
gradient norm agree to `model_rtol` of one step's dependency path, and the fp32 masters to the
reference's `AdamWeightBound` (Adam turns a roundoff-size gradient near zero into a full-size update).
"""
import importlib
import os
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_zero import ops
from megatron_zero.config import flat, from_args
from megatron_zero.distributed.device import HOST, backend_for
from megatron_zero.distributed.initialize import shutdown_distributed
from megatron_zero.testing.multirank import free_port
from megatron_zero.testing.launch import losses_from_log, model_flags, torchrun
from megatron_zero.testing.tolerances import (AdamWeightBound, assert_losses_close, assert_within, global_norm_rtol,
                                              gpt_path_length, model_rtol)

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


# the kernels whose calls _count_kernel_calls counts, by the device they run on (ops/registry.py's EXTENSIONS)
DEVICE_KERNELS = {"cuda": ("layer_norm", "softmax", "bias_gelu", "rms_norm", "rope"),
                  "cpu": ("softmax", "bias_gelu", "rms_norm")}


@pytest.fixture
def kernels(device):
    """The fused kernels this device runs (asserting they are built): CUDA's, or the CPU's fp32 ones."""
    status = ops.available_kernels()
    needed = ["layer_norm", "rms_norm", "rope", "scaled_upper_triang_masked_softmax", "bias_gelu",
              "multi_tensor_adam"] if device.type == "cuda" else \
        ["cpu_bias_gelu", "cpu_scaled_upper_triang_masked_softmax", "cpu_rms_norm", "cpu_adam"]
    missing = {k: status[k] for k in needed if status[k] is not True}
    assert not missing, f"the {device.type} kernels the fused path uses are not available: {missing}"
    return DEVICE_KERNELS[device.type]


def _args(corpus, tmp_path, **extra):
    from megatron_zero.arguments import parse_args
    data, tok = corpus
    flags = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
             "micro-batch-size": 2, "global-batch-size": 8, "train-iters": 4, "eval-iters": 0,
             "log-interval": 100, "data-cache-path": tmp_path / "cache", "zero-stage": 1}
    flags.update(extra)
    return parse_args(model_flags(data, tok, **flags), world_size=1)


def _trainer(args, device):
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.training import Trainer
    return Trainer(from_args(args), build_parallel_state(1, 1), device)


def _train(trainer, iters):
    losses = []
    for _ in range(iters):
        micro = trainer._micro_batches(trainer.train_ds, trainer.progress.consumed_train_samples)
        losses.append(trainer.train_step(micro)[0].item())  # the loss stays on the device until read
        trainer.progress.consumed_train_samples += trainer.sections.parallel.global_batch_size
        trainer.lr_schedule.step()
    return losses


def _params(trainer):
    return {n: p.detach().to(HOST, torch.float32) for n, p in trainer.model.named_parameters()}


def _unfused():
    return dict(masked_softmax_fusion=False, bias_gelu_fusion=False, persist_layer_norm=False)


def _step_rtol(cfg):
    """Each step's loss (and gradients, normwise): model_rtol of one training step's dependency path."""
    from megatron_zero.data.tokenizers import build_tokenizer
    args = SimpleNamespace(**flat(cfg))
    shape = SimpleNamespace(hidden_size=args.hidden_size, seq_length=args.seq_length, num_layers=args.num_layers,
                            ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                            vocab_size=build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size)
    return model_rtol(gpt_path_length(shape, args.global_batch_size * args.seq_length))


def _record_bound(trainer, rtol):
    """Build the AdamWeightBound of `trainer`'s fp32 masters as it trains: each step of its FlatAdamW is
    recorded with the gradient partitions it used (after clipping) and the masters it produced."""
    flat = trainer.optimizer.optimizer
    group = flat.param_groups[0]
    bound, step = AdamWeightBound(rtol, group["lr"], group["betas"], group["eps"]), flat.step

    def recorded(grads):
        step(grads)
        bound.step({i: g for i, g in enumerate(grads)}, dict(enumerate(flat.params)), lr=flat.param_groups[0]["lr"])
    flat.step = recorded
    return bound


def _train_with_norms(trainer, iters):
    losses, norms = [], []
    for _ in range(iters):
        micro = trainer._micro_batches(trainer.train_ds, trainer.progress.consumed_train_samples)
        loss, _, _, norm = trainer.train_step(micro)
        losses.append(loss.item())
        norms.append(float(norm))
        trainer.progress.consumed_train_samples += trainer.sections.parallel.global_batch_size
        trainer.lr_schedule.step()
    return losses, norms


def _assert_parity(here, ref, iters):
    """`iters` fp32 steps of two trainers of the same model: losses, gradient norms, masters within the bounds."""
    rtol = _step_rtol(ref.sections)
    bound = _record_bound(ref, rtol)
    (a, na), (b, nb) = _train_with_norms(here, iters), _train_with_norms(ref, iters)
    assert_losses_close(a, b, rtol, "loss")
    count = sum(p.numel() for p in ref.optimizer.optimizer.params)
    assert_losses_close(na, nb, global_norm_rtol(rtol, count), "gradient norm")
    bounds = bound.bounds()
    for i, (x, y) in enumerate(zip(here.optimizer.optimizer.params, ref.optimizer.optimizer.params)):
        assert_within(x.detach().to(HOST), y.detach().to(HOST), bounds[i].to(HOST), f"fp32 masters of group {i}")


def test_fp32_step_on_gpu_matches_cpu(builtin_corpus, tmp_path, device):
    """Three fp32 steps (fusions off) on the device and on the CPU: losses and gradient norms to one step's
    model_rtol, the fp32 masters within the CPU run's AdamWeightBound (a key bias's gradient is zero up to
    rounding: softmax ignores it, and Adam turns that rounding into full-size steps)."""
    flags = {f"no-{k.replace('_', '-')}": True for k in _unfused()}
    here = _trainer(_args(builtin_corpus, tmp_path, **flags), device)
    ref = _trainer(_args(builtin_corpus, tmp_path, **flags), HOST)
    _assert_parity(here, ref, 3)


def _count_kernel_calls(monkeypatch):
    """Count each fused kernel's autograd-function applications. The ops package re-exports functions under
    their modules' names (`ops.layer_norm` is the function), so the modules are taken from sys.modules."""
    calls = {key: 0 for key in DEVICE_KERNELS["cuda"]}
    for key, cls in (("layer_norm", "_FusedLayerNorm"), ("softmax", "_FusedCausalSoftmax"),
                     ("bias_gelu", "_FusedBiasGelu"), ("rms_norm", "_FusedRMSNorm"), ("rope", "_FusedRope")):
        fn = getattr(importlib.import_module(f"megatron_zero.ops.{key}"), cls)

        def counted(*a, _apply=fn.apply, _key=key):
            calls[_key] += 1
            return _apply(*a)
        monkeypatch.setattr(fn, "apply", counted)
    return calls


def _losses_match(fused, plain, trainer):
    """Fused kernels against the fallback: the same fp32 step summed in another order."""
    assert_losses_close(fused, plain, _step_rtol(trainer.sections), "loss, fused kernels against the fallback")


# the causal softmax kernel runs where the attention backend is `unfused` (the flags decide; `auto` is torch's
# SDPA on a GPU and the CPU's query-block attention, `fused` forces the kernel whatever the flag says)
GPT = {"attention-backend": "unfused"}


def test_fused_kernels_run_in_training_and_match_fallback(builtin_corpus, tmp_path, device, kernels, monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    trainer = _trainer(_args(builtin_corpus, tmp_path, **GPT), device)
    fused = _train(trainer, 3)
    gpt2 = [k for k in ("layer_norm", "softmax", "bias_gelu") if k in kernels]
    assert all(calls[k] > 0 for k in gpt2), calls
    flags = {f"no-{k.replace('_', '-')}": True for k in _unfused()}
    plain = _train(_trainer(_args(builtin_corpus, tmp_path, **GPT, **flags), device), 3)
    _losses_match(fused, plain, trainer)


LLAMA = {"normalization": "RMSNorm", "position-embedding-type": "rope", "swiglu": True, "disable-bias-linear": True,
         "attention-backend": "unfused"}


def test_llama_kernels_run_in_training_and_match_fallback(builtin_corpus, tmp_path, device, kernels, monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    trainer = _trainer(_args(builtin_corpus, tmp_path, **LLAMA), device)
    fused = _train(trainer, 3)
    assert all(calls[k] > 0 for k in ("rms_norm", "rope") if k in kernels) and calls["layer_norm"] == 0, calls
    plain = _train(_trainer(_args(builtin_corpus, tmp_path, **LLAMA, **{"no-persist-layer-norm": True,
                                                                        "no-rope-fusion": True}), device), 3)
    _losses_match(fused, plain, trainer)


def _needs_kernel(kernel, kernels, device):
    if kernel not in kernels:
        pytest.skip(f"{device.type} has no {kernel} kernel to switch off (CUDA has: the GPU run checks it)")


@pytest.mark.parametrize("flag,kernel", [("no-persist-layer-norm", "rms_norm"), ("no-rope-fusion", "rope")])
def test_llama_fusion_flags_turn_their_kernel_off(builtin_corpus, tmp_path, device, kernels, monkeypatch, flag, kernel):
    _needs_kernel(kernel, kernels, device)
    calls = _count_kernel_calls(monkeypatch)
    _train(_trainer(_args(builtin_corpus, tmp_path, **LLAMA, **{flag: True}), device), 1)
    other = {"rms_norm": "rope", "rope": "rms_norm"}[kernel]
    assert calls[kernel] == 0 and (calls[other] > 0 or other not in kernels), calls


@pytest.mark.parametrize("flag,kernel", [("no-masked-softmax-fusion", "softmax"),
                                         ("no-bias-gelu-fusion", "bias_gelu"),
                                         ("no-persist-layer-norm", "layer_norm")])
def test_each_fusion_flag_turns_its_kernel_off(builtin_corpus, tmp_path, device, kernels, monkeypatch, flag, kernel):
    _needs_kernel(kernel, kernels, device)
    calls = _count_kernel_calls(monkeypatch)
    _train(_trainer(_args(builtin_corpus, tmp_path, **GPT, **{flag: True}), device), 1)
    others = [k for k in ("layer_norm", "softmax", "bias_gelu") if k != kernel and k in kernels]
    assert calls[kernel] == 0 and all(calls[k] > 0 for k in others), calls


def test_multi_tensor_adam_steps_the_zero_partition(builtin_corpus, tmp_path, device, kernels, monkeypatch):
    """One kernel call per param group and step: CUDA's multi-tensor AdamW, or on the CPU the C++ Adam
    that MultiTensorAdamW steps each (here: the one flat partition's) tensor with."""
    from megatron_zero.ops.registry import load
    module, name = ("megatron_zero._C_cuda", "multi_tensor_adamw") if device.type == "cuda" else \
        ("megatron_zero._C_cpu_adam", "adam_step")
    ext, seen = load(module), []
    monkeypatch.setattr(ext, name, lambda *a, _f=getattr(ext, name): seen.append(1) or _f(*a))
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
    _assert_parity(off, here, 3)  # the host's C++ Adam against the device's: the same update, other roundings


def _save(trainer, path, async_save=False):
    from megatron_zero import checkpoint as ckpt
    sections = trainer.sections  # the trainer reads the typed checkpoint section, built once from the flags
    trainer.sections = replace(sections, checkpoint=replace(sections.checkpoint, save=str(path), async_save=async_save))
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
    """TP2 / PP2 / DP2 ZeRO-1..3 over NCCL: the loss curve of 6 fp32 iterations equals one GPU's (each loss to
    one step's model_rtol, as the CPU layouts' parity tests)."""
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
    rtol = _step_rtol(from_args(_args(builtin_corpus, tmp_path)))  # model_flags' model, as `base` trains it
    assert_losses_close(two, one, rtol, f"loss, 2 GPUs {layout} against 1")

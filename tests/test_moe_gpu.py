"""The GPU tier of MoE, through pretrain_gpt.py as users run it (4 experts top-2, the switch aux loss and
the z-loss on, MoE in every layer):

- one GPU, fp32 (TF32 off, fusions off): the loss curve of 6 iterations equals the same run's on the CPU
  within relative 1e-5 (tests/test_gpu_training.py's bound: the GEMMs sum in another order), the routing,
  permutation, expert loop and aux losses all on CUDA tensors;
- one GPU, bf16 with --moe-grouped-gemm: the experts run as F.grouped_mm (moe/grouped_mlp.py), and 30
  iterations lower the loss (tests/test_moe_grouped_gemm.py compares the grouped GEMM with the loop on the GPU);
- two GPUs over NCCL: EP2 (variable-size all_to_all_single), the loss curve equals one GPU's within 1e-5.

Every test is marked `gpu` and skipped with its reason without CUDA (two GPUs: without a second one).
MEGATRON_ZERO_TEST_DEVICE=cpu runs them on the CPU (gloo in place of NCCL) to check their logic.
"""
import os

import pytest
import torch

from megatron_zero.testing.launch import losses_from_log, model_flags, torchrun

pytestmark = pytest.mark.gpu
FORCED = os.environ.get("MEGATRON_ZERO_TEST_DEVICE")
MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2, "moe-z-loss-coeff": 1e-3}
UNFUSED = {"no-masked-softmax-fusion": True, "no-bias-gelu-fusion": True, "no-persist-layer-norm": True}
REL = 1e-5


def _gpus(n: int):
    if FORCED:
        return FORCED
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s), torch sees {torch.cuda.device_count()} "
                    f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    return "cuda"


def _run(corpus, tmp_path, nproc, **flags):
    data, tok = corpus
    base = {"eval-iters": 0, "data-cache-path": tmp_path / "cache", **MOE}
    out = torchrun(nproc, model_flags(data, tok, **{**base, **flags}), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return losses_from_log(out.stdout)


def _assert_close(got, want, iters):
    assert len(got) == len(want) == iters, (got, want)
    assert all(abs(a - b) <= REL * abs(b) for a, b in zip(got, want)), (got, want)


def test_moe_fp32_on_one_gpu_matches_cpu(builtin_corpus, tmp_path):
    device = _gpus(1)
    gpu = _run(builtin_corpus, tmp_path, 1, **UNFUSED, **{"train-iters": 6, "device": device})
    cpu = _run(builtin_corpus, tmp_path, 1, **UNFUSED, **{"train-iters": 6, "device": "cpu"})
    _assert_close(gpu, cpu, 6)


def test_moe_grouped_gemm_bf16_lowers_the_loss_on_one_gpu(builtin_corpus, tmp_path):
    device = _gpus(1)
    losses = _run(builtin_corpus, tmp_path, 1, **{"train-iters": 30, "device": device, "bf16": True,
                                                  "moe-grouped-gemm": True, "eval-interval": 100})
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def test_moe_ep2_over_nccl_matches_one_gpu(builtin_corpus, tmp_path):
    device = _gpus(2)
    flags = {**UNFUSED, "train-iters": 6, "device": device}
    one = _run(builtin_corpus, tmp_path, 1, **flags)
    two = _run(builtin_corpus, tmp_path, 2, **flags, **{"expert-model-parallel-size": 2})
    _assert_close(two, one, 6)

"""The GPU tier of context parallelism: the ring (p2p) and all-gather attention on one device, and CP2 over
NCCL on two GPUs.

One device: CP 2 and 4 ranks run as threads of one process, each calling the comm type's autograd Function's
forward and backward directly (the autograd engine runs CUDA backward on one thread per device, where ranks
that wait on each other would block it); their exchanges go through in-process mailboxes in place of
torch.distributed. So everything those two comm types compute on the device (the blocks, the online-softmax
merge, the fp32 accumulators, bf16 casts, tensors made on q's device) runs on CUDA tensors and is compared,
forward and backward (dQ, dK, dV), against the whole-sequence attention on the same device. `a2a` computes
nothing of its own (the model's attention core runs on gathered heads: tests/test_gpu_training.py) and
only moves tensors, which the two-GPU test drives over NCCL.

Tolerances: fp32 as tests/test_context_parallel_attention.py (normwise model_rtol(4 (d + s))). bf16: both
sides get the same bf16 inputs, the reference computes in fp32 and the comm types accumulate in fp32 and
round once to bf16 at the end (2^-8 relative, normwise), so the bound is 2^-8 plus the fp32 one. The ring
on torch's flash kernel (`p2p-flash`, context_parallel/flash_blocks.py) rounds more in bf16: the kernel
casts its probabilities (backward: also dS) to bf16 before the second matmul and returns each block in bf16,
and the merged output is rounded to bf16 for the kernel's backward: 4 x 2^-8 plus the fp32 one. With
attention dropout (fp32) the reference applies the same hashed masks (identical-mask construction) and the
bound is the one without dropout.

Two GPUs: pretrain_gpt.py at --context-parallel-size 2 over NCCL, each --cp-comm-type, logs the loss curve
of one GPU within relative 1e-5 (fp32, TF32 off; the same bound as tests/test_gpu_training.py's layouts).

MEGATRON_ZERO_TEST_DEVICE=cpu runs all of it on the CPU (gloo in place of NCCL) to check the tests' logic.
"""
import os
import queue
import threading

import pytest
import torch

from megatron_zero.context_parallel import all_gather_attention, block_attention, ring_attention, slice_sequence_for_cp
from megatron_zero.context_parallel.flash_blocks import flash_unavailable
from megatron_zero.model.attention_core import attention_core
from megatron_zero.model.transformer import expand_kv_heads
from megatron_zero.testing.launch import losses_from_log, model_flags, torchrun
from megatron_zero.testing.tolerances import assert_close_normwise, model_rtol

pytestmark = pytest.mark.gpu
FORCED = os.environ.get("MEGATRON_ZERO_TEST_DEVICE")
B, HEADS, GROUPS, SEQ, D = 2, 4, 2, 32, 16
BF16_ROUNDING = 2.0 ** -8


@pytest.fixture(scope="module")
def device():
    if FORCED:
        return torch.device(FORCED)
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (torch {torch.__version__}); the GPU tier runs on a GPU machine")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0)


class Ctx:
    """What an autograd Function's forward and backward use of their ctx."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class Mailboxes:
    """The ring's exchange between threads: what rank r sends lands in rank r + 1's box (per tag, in order)."""

    def __init__(self, cp: int):
        self.boxes = {(r, tag): queue.Queue() for r in range(cp) for tag in (ring_attention.KV_TAG,
                                                                           ring_attention.GRAD_TAG)}

    def exchange(self, send, recv, ranks, cp_rank, group, tag):
        self.boxes[(ranks[(cp_rank + 1) % len(ranks)], tag)].put(send.clone())
        box = self.boxes[(ranks[cp_rank], tag)]

        class Arrival:
            def wait(self):
                recv.copy_(box.get(timeout=120))
        return [Arrival()]


class Collectives:
    """all_gather_into_tensor and reduce_scatter_tensor (SUM, rank order) between threads."""

    def __init__(self, cp: int):
        self.cp, self.barrier, self.slots, self.local = cp, threading.Barrier(cp, timeout=120), [None] * cp, \
            threading.local()

    def _share(self, t):
        self.slots[self.local.rank] = t.clone()
        self.barrier.wait()
        shared = list(self.slots)
        self.barrier.wait()
        return shared

    def all_gather_into_tensor(self, out, mine, group):
        out.view(self.cp, -1).copy_(torch.stack([s.reshape(-1) for s in self._share(mine)]))

    def reduce_scatter_tensor(self, out, x, group):
        parts = [s.reshape(self.cp, -1)[self.local.rank] for s in self._share(x)]
        out.copy_(torch.stack(parts).sum(dim=0).view_as(out))


def inputs(device, dtype):
    g = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(B, HEADS, SEQ, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, GROUPS, SEQ, D, generator=g) for _ in range(2))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def reference(q, k, v, dout, dropout=None):
    """The whole-sequence causal attention in fp32 on the same (possibly bf16-valued) inputs; with `dropout`,
    its masks (block_attention.keep_mask) on the probabilities."""
    q, k, v = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    ke, ve = expand_kv_heads(k, HEADS), expand_kv_heads(v, HEADS)
    if dropout is None:
        out = attention_core(q, ke, ve, "unfused", 0.0, True)
    else:
        pos = torch.arange(SEQ, device=q.device)
        scores = (q @ ke.transpose(-2, -1) / D ** 0.5).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        keep = block_attention.keep_mask(dropout, B, HEADS, pos, pos)
        out = (torch.softmax(scores, dim=-1) * keep / (1 - dropout.p)) @ ve
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


def run_threads(cp, comm_type, q, k, v, dout, monkeypatch, dropout=None):
    mail, coll = Mailboxes(cp), Collectives(cp)
    monkeypatch.setattr(ring_attention, "_ring_exchange", mail.exchange)
    monkeypatch.setattr(all_gather_attention, "shm_comm", coll)
    results, errors = [None] * cp, []

    def rank(r):
        try:
            coll.local.rank = r
            mine = [slice_sequence_for_cp(t, cp, r, dim=2) for t in (q, k, v, dout)]
            ctx = Ctx()
            if comm_type in ("p2p", "p2p-flash"):
                out = ring_attention.RingAttention.forward(ctx, *mine[:3], SEQ, None, list(range(cp)), r, dropout,
                                                           comm_type == "p2p-flash")
                grads = ring_attention.RingAttention.backward(ctx, mine[3])
            else:
                out = all_gather_attention.AllGatherAttention.forward(ctx, *mine[:3], SEQ, None, cp, r, dropout)
                grads = all_gather_attention.AllGatherAttention.backward(ctx, mine[3])
            results[r] = (out, *grads[:3])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            coll.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("dtype,dropout", [(torch.float32, None), (torch.bfloat16, None),
                                           (torch.float32, block_attention.Dropout(0.3, 99))],
                         ids=["fp32", "bf16", "fp32-dropout"])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "p2p-flash"])
@pytest.mark.parametrize("cp", [2, 4])
def test_comm_type_attention_on_the_device(device, cp, comm_type, dtype, dropout, monkeypatch):
    q, k, v, dout = inputs(device, dtype)
    if comm_type == "p2p-flash" and (dropout is not None or flash_unavailable(q) is not None):
        pytest.skip(f"the ring's flash kernel does not serve this case: {flash_unavailable(q) or 'dropout'}")
    want = reference(q, k, v, dout, dropout)
    per_rank = run_threads(cp, comm_type, q, k, v, dout, monkeypatch, dropout)
    roundings = 4 if comm_type == "p2p-flash" else 1
    rtol = model_rtol(4 * (D + SEQ)) + (roundings * BF16_ROUNDING if dtype == torch.bfloat16 else 0.0)
    for name, index in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        got = torch.cat([per_rank[r][index] for r in range(cp)], dim=2)
        assert got.device == device and got.dtype == dtype, (name, got.device, got.dtype)
        mine = torch.cat([slice_sequence_for_cp(want[index], cp, r, dim=2) for r in range(cp)], dim=2)
        assert_close_normwise(got.float(), mine, rtol, f"{comm_type} CP{cp} {dtype} {name}")


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_two_gpus_nccl_cp2_matches_one_gpu(builtin_corpus, tmp_path, comm_type):
    """pretrain_gpt.py at CP2 over NCCL: the loss curve of 6 fp32 iterations equals one GPU's (rel 1e-5)."""
    if not FORCED and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, torch sees {torch.cuda.device_count()}")
    data, tok = builtin_corpus
    base = {"train-iters": 6, "eval-iters": 0, "data-cache-path": tmp_path / "cache", "device": FORCED or "cuda",
            "no-masked-softmax-fusion": True, "no-bias-gelu-fusion": True, "no-persist-layer-norm": True}

    def run(nproc, **extra):
        out = torchrun(nproc, model_flags(data, tok, **base, **extra), timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return losses_from_log(out.stdout)

    one = run(1)
    two = run(2, **{"context-parallel-size": 2, "cp-comm-type": comm_type})
    assert len(one) == len(two) == 6
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(two, one)), (two, one)

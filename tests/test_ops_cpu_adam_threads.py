"""The offloaded AdamW step's own thread count: --cpu-optimizer-threads reaches the C++ kernel, the
kernel runs on exactly that many threads whatever torch's intra-op count is (torchrun sets it to 1),
and the result is bit-identical for every thread count (each element's update is independent of
the split)."""
import pytest
import torch

from megatron_zero.arguments import parse_args
from megatron_zero.config import from_args
from megatron_zero.ops import available_kernels
from megatron_zero.ops.cpu_adam import adamw_step_, default_offload_threads
from megatron_zero.ops.registry import load
from megatron_zero.testing.flag_checks import BASE, refused, with_flags

EXT = "megatron_zero._C_cpu_adam"
pytestmark = pytest.mark.skipif(available_kernels()["cpu_adam"] is not True, reason="the C++ CPU Adam is not built")


@pytest.fixture
def one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # as under torchrun
    yield
    torch.set_num_threads(old)


def _state(numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen), torch.randn(numel, generator=gen),
            torch.randn(numel, generator=gen) * 0.1, torch.rand(numel, generator=gen)]


def test_kernel_runs_on_the_given_threads_and_is_bit_identical_across_counts(one_torch_thread):
    numel = (1 << 20) + 13  # 16 chunks of 64K and an odd tail: enough work for every thread asked
    ext, results = load(EXT), {}
    for threads in (1, 2, 3, 4):
        p, g, m, v = _state(numel)
        low = torch.empty(numel, dtype=torch.bfloat16)
        ran = ext.adam_step(p, g, m, v, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, low, threads)
        assert ran == threads, f"asked for {threads} threads, the kernel ran on {ran}"
        results[threads] = (p, m, v, low)
    for threads, tensors in results.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, results[1])), f"{threads} threads differ from 1"


def test_kernel_refuses_a_thread_count_below_one():
    p, g, m, v = _state(16)
    with pytest.raises(RuntimeError, match="num_threads must be >= 1"):
        load(EXT).adam_step(p, g, m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, None, 0)
    with pytest.raises(ValueError, match="threads must be at least 1"):
        adamw_step_(p, g, m, v, step=1, lr=1e-3, threads=0)


def _spy(monkeypatch):
    """Record (threads asked, threads the kernel ran on) of every fused CPU Adam call."""
    ext, calls = load(EXT), []

    def adam_step(*a, _real=ext.adam_step):
        ran = _real(*a)
        calls.append((a[-1], ran))
        return ran
    monkeypatch.setattr(ext, "adam_step", adam_step)
    return calls


def _offload_trainer(corpus, tmp_path, threads):
    from megatron_zero.distributed.device import HOST
    from megatron_zero.testing.launch import model_flags
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.training import Trainer
    data, tok = corpus
    args = parse_args(model_flags(data, tok, **{"cpu-optimizer": True, "cpu-optimizer-threads": threads,
                                                "zero-stage": 1, "eval-iters": 0, "train-iters": 2,
                                                "data-cache-path": tmp_path / "cache"}), world_size=1)
    return Trainer(from_args(args), build_parallel_state(1, 1), HOST)


def _step(trainer):
    micro = trainer._micro_batches(trainer.train_ds, trainer.progress.consumed_train_samples)
    trainer.train_step(micro)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_cpu_optimizer_threads_flag_reaches_the_kernel(builtin_corpus, tmp_path, monkeypatch, one_torch_thread):
    """pretrain's flags -> ZeroOptimizer -> FlatAdamW -> the kernel: every offloaded chunk is stepped on 2
    threads though torch has 1; the weights equal those of the same step on 1 thread, bit for bit."""
    import torch.distributed as dist

    from megatron_zero.distributed.initialize import shutdown_distributed
    from megatron_zero.testing.multirank import free_port
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        calls = _spy(monkeypatch)
        two = _step(_offload_trainer(builtin_corpus, tmp_path, 2))
        assert calls and {asked for asked, _ in calls} == {2}, calls
        assert max(ran for _, ran in calls) == 2, calls  # the largest partition has chunks for both threads
        calls.clear()
        one = _step(_offload_trainer(builtin_corpus, tmp_path, 1))
        assert calls and {asked for asked, _ in calls} == {1} and {ran for _, ran in calls} == {1}, calls
        assert all(torch.equal(two[n], one[n]) for n in one)
    finally:
        shutdown_distributed()


def test_default_is_this_ranks_share_of_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert default_offload_threads({"LOCAL_WORLD_SIZE": "8"}) == 2
    assert default_offload_threads({"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert default_offload_threads({"LOCAL_WORLD_SIZE": "32"}) == 1
    assert default_offload_threads({}) == 16
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 5, 6})  # a launcher bound this rank already
    assert default_offload_threads({"LOCAL_WORLD_SIZE": "8"}) == 3
    args = parse_args(with_flags(BASE, cpu_optimizer=True), world_size=1)
    assert args.cpu_optimizer_threads == 3
    assert parse_args(BASE, world_size=1).cpu_optimizer_threads is None


@pytest.mark.parametrize("changes,words", [
    (dict(cpu_optimizer=True, cpu_optimizer_threads=0), ["--cpu-optimizer-threads 0", "between 1 and"]),
    (dict(cpu_optimizer=True, cpu_optimizer_threads=100000), ["--cpu-optimizer-threads 100000", "cores"]),
    (dict(cpu_optimizer_threads=2), ["--cpu-optimizer-threads 2", "--cpu-optimizer"]),
    (dict(cpu_optimizer=True, cpu_optimizer_threads="two"), ["--cpu-optimizer-threads", "'two'"]),
])
def test_bad_thread_counts_are_refused_in_one_sentence(changes, words, capsys):
    line = refused(with_flags(BASE, **changes), 1, capsys)
    assert all(w in line for w in words), line

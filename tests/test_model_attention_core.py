"""The attention backends against `unfused` (fp32; forward and backward), and their dropout rules."""
import pytest
import torch

from megatron_zero.arguments import ArgumentError, build_parser, validate_args
from megatron_zero.model import GPTModel
from megatron_zero.model.attention_core import attention_core, resolve_backend
from megatron_zero.tensor_parallel import get_rng_tracker, model_parallel_seed
from megatron_zero.testing.tiny_gpt import tiny_gpt_config

CPU = torch.device("cpu")


def qkv(seed=0, shape=(2, 4, 16, 8)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).requires_grad_() for _ in range(3)]


def core_and_grads(backend, dropout_p=0.0):
    q, k, v = qkv()
    out = attention_core(q, k, v, backend, dropout_p, training=True)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("backend", ["auto", "flash", "fused"])
def test_backend_matches_unfused_forward_and_backward(backend):
    ref_out, ref_grads = core_and_grads("unfused")
    out, grads = core_and_grads(backend)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_causal_mask_holds():
    q, k, v = qkv()
    out = attention_core(q, k, v, "auto", 0.0, training=False)
    v2 = v.detach().clone()
    v2[:, :, -1] += 100.0  # the last key/value must not change any earlier query's output
    out2 = attention_core(q, k, v2, "auto", 0.0, training=False)
    assert torch.equal(out[:, :, :-1], out2[:, :, :-1]) and not torch.equal(out[:, :, -1], out2[:, :, -1])


def test_gpt_with_sdpa_matches_unfused():
    results = []
    for backend in ("unfused", "auto"):
        model = GPTModel(tiny_gpt_config(attention_backend=backend))
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 100, (2, 9), generator=g)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_auto_resolution():
    assert resolve_backend("auto", False, CPU) == "sdpa"
    assert resolve_backend("auto", True, CPU) == "unfused"  # no fused SDPA kernel with dropout on a CPU
    assert resolve_backend("auto", True, torch.device("cuda", 0)) == "sdpa"
    for backend in ("flash", "fused", "unfused"):
        assert resolve_backend(backend, True, CPU) == backend


def test_dropout_draws_from_the_tracker_and_replays():
    model_parallel_seed(7, tp_rank=0)
    saved = get_rng_tracker().get_states(), torch.get_rng_state()
    first, _ = core_and_grads("auto", 0.3)
    second, _ = core_and_grads("auto", 0.3)
    get_rng_tracker().set_states(saved[0])
    torch.manual_seed(99)  # the default generator does not decide attention dropout
    replay, _ = core_and_grads("auto", 0.3)
    assert not torch.equal(first, second) and torch.equal(first, replay)
    model_parallel_seed(7, tp_rank=1)  # another TP rank draws other masks
    other, _ = core_and_grads("auto", 0.3)
    assert not torch.equal(first, other)


def test_sdpa_dropout_under_the_tracker_replays():
    """What `auto` runs on CUDA with dropout: SDPA drawing from the tracker's state (here SDPA's CPU math)."""
    from megatron_zero.model.attention_core import _sdpa
    model_parallel_seed(7)
    saved = get_rng_tracker().get_states()
    q, k, v = qkv()
    first = _sdpa(q, k, v, 0.3)
    get_rng_tracker().set_states(saved)
    torch.manual_seed(99)
    assert torch.equal(_sdpa(q, k, v, 0.3), first)


def _args(*extra):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", *extra]
    return validate_args(build_parser().parse_args(argv), world_size=2)


def test_flags():
    a = _args("--checkpoint-activations", "--checkpoint-num-layers", "2")
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "uniform", 2)
    assert _args().attention_backend == "auto"
    refused = [("--recompute-granularity", "full"),
               ("--recompute-granularity", "selective", "--recompute-method", "block"),
               ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"),
               ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "7",
                "--max-position-embeddings", "8")]
    if not torch.cuda.is_available():
        refused.append(("--attention-backend", "flash"))  # attention dropout defaults to 0.1
    for extra in refused:
        with pytest.raises(ArgumentError):
            _args(*extra)
    _args("--attention-backend", "flash", "--attention-dropout", "0")

"""--compile-layers (megatron_zero/compile/layers.py): each transformer layer's forward compiled by inductor
gives the eager layer's loss and gradients, fp32 on the CPU.

Compiled and eager evaluate the same fp32 expressions; inductor fuses and reorders the reductions, so they
differ by the roundoff of sums taken in another order: normwise within model_rtol of the step's dependency
path (megatron_zero/testing/tolerances.py); dropout's masks are eager's (inductor's fallback_random). The
fused CPU kernels (bias-GeLU, causal softmax) stay on and
run eagerly between the compiled pieces. Default tier: one rank, one layer. `slow`: the real Trainer with
and without the flag at TP2 + SP, PP2, ZeRO-3 (DP2), full recompute, MoE and CP2, each iteration's loss.
"""
import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from megatron_zero.compile.layers import CompileLayersConverter
from megatron_zero.model import reference_model
from megatron_zero.tensor_parallel.random import model_parallel_seed
from megatron_zero.testing.multirank import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.testing.tolerances import (assert_close_normwise, assert_losses_close, gpt_path_length,
                                              model_rtol)
from megatron_zero.testing.trainer_losses import recorded_training, resume_flags

CPU = torch.device("cpu")


def test_one_layer_compiled_matches_eager():
    cfg = tiny_gpt_config(num_layers=1, hidden_dropout=0.1, attention_dropout=0.1)  # the same masks as eager
    torch.manual_seed(0)
    eager, compiled = reference_model(cfg), reference_model(cfg)
    compiled.load_state_dict(eager.state_dict())
    dynamo_utils.counters.clear()
    line = CompileLayersConverter(CPU)(compiled)
    assert "1 transformer layers compiled" in line and "fused kernels bias_gelu" in line, line
    assert list(compiled.state_dict()) == list(eager.state_dict())  # names unchanged: checkpoints as before
    tokens = torch.randint(0, 100, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (eager, compiled):
        model_parallel_seed(5)  # the default generator and the RNG tracker's stream
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert dynamo_utils.counters["stats"]["unique_graphs"] > 0  # inductor did compile the layer
    rtol = model_rtol(gpt_path_length(cfg, tokens[:, 1:].numel()))
    (want_loss, want_grads), (loss, grads) = results
    assert_close_normwise(loss, want_loss, rtol, "loss")
    for name, g, w in zip([n for n, _ in eager.named_parameters()], grads, want_grads):
        assert_close_normwise(g, w, rtol, name)


def _trainer_losses(argv):
    """The real Trainer with Megatron flags `argv`: each iteration's loss, the transforms' log lines, and the
    step's dependency path length (for the tolerance)."""
    trainer, losses = recorded_training(argv)
    return losses, trainer.transforms, gpt_path_length(trainer.config, GLOBAL_BATCH * SEQ)


# (ranks, flags) of each layout; dropout off (the eager run's masks are the compiled run's anyway)
LAYOUTS = {"tp2_sp": (2, {"tensor-model-parallel-size": 2, "sequence-parallel": True}),
           "pp2": (2, {"pipeline-model-parallel-size": 2}),
           "zero3_dp2": (2, {"zero-stage": 3, "zero-param-persistence-threshold": 0}),
           "recompute": (1, {"recompute-granularity": "full", "recompute-method": "uniform",
                             "recompute-num-layers": 1}),
           "moe": (1, {"num-experts": 2, "moe-router-topk": 1}),
           "cp2": (2, {"context-parallel-size": 2})}
ITERS, GLOBAL_BATCH, SEQ = 3, 4, 32


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_compiled_matches_eager(layout, builtin_corpus, tmp_path):
    world, extra = LAYOUTS[layout]
    flags = dict(extra, **{"train-iters": ITERS, "global-batch-size": GLOBAL_BATCH, "hidden-dropout": 0.0,
                           "attention-dropout": 0.0, "seq-length": SEQ})
    eager = resume_flags(builtin_corpus, tmp_path, 1, 1, 1, **flags)
    compiled = resume_flags(builtin_corpus, tmp_path, 1, 1, 1, **flags, **{"compile-layers": True})
    want, none, _ = run_ranks(_trainer_losses, world, eager, timeout=900)[-1]  # the last rank logs the loss
    got, lines, path = run_ranks(_trainer_losses, world, compiled, timeout=900)[-1]
    assert not none and any("transformer layers compiled" in line for line in lines), lines
    assert len(want) == ITERS
    assert_losses_close(got, want, model_rtol(path), "loss")


def test_flags_refused_in_one_sentence():
    from megatron_zero.arguments import ArgumentError, validate_args, parse_command_line

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert validate_args(parse_command_line(base + ["--compile-layers"]), 1).compile_layers
    for extra, words in ((["--compile-mode", "max-autotune"], "give --compile-layers"),
                         (["--compile-layers", "--compile-mode", "reduce-overhead", "--zero-stage", "3"],
                          "fixed weight addresses")):
        with pytest.raises(ArgumentError, match=words):
            validate_args(parse_command_line(base + extra), 1)


@pytest.mark.slow
def test_pretrain_gpt_py_with_compile_layers(tmp_path):
    """pretrain_gpt.py --compile-layers on two ranks (TP2 + SP, a Llama with the fused kernels on) logs the
    compiled layers once and trains to the eager run's losses."""
    from megatron_zero.data.tokenizers import ByteTokenizer
    from megatron_zero.testing.cli import TINY, cli_flags, logged_losses, pretrain_cli, text_data

    data = text_data(str(tmp_path / "text"))
    layout = {"tensor-model-parallel-size": 2, "sequence-parallel": True, "train-iters": 3}
    eager = pretrain_cli(2, cli_flags(data, tmp_path / "cache", "llama", layout), timeout=900)
    compiled = pretrain_cli(2, cli_flags(data, tmp_path / "cache", "llama", layout, {"compile-layers": True}),
                            timeout=900)
    assert compiled.stdout.count("compiled layers: 2 transformer layers compiled") == 1, compiled.stdout[-3000:]
    want, got = logged_losses(eager), logged_losses(compiled)
    assert sorted(want) == sorted(got) == [1, 2, 3]
    cfg = tiny_gpt_config(num_layers=TINY["num-layers"], hidden_size=TINY["hidden-size"],
                          seq_length=TINY["seq-length"], max_position_embeddings=TINY["seq-length"],
                          vocab_size=ByteTokenizer.vocab_size)
    rtol = model_rtol(gpt_path_length(cfg, TINY["global-batch-size"] * TINY["seq-length"]))
    assert_losses_close([got[i] for i in sorted(got)], [want[i] for i in sorted(want)], rtol, "loss")


def _inductor_build_directory(base):
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = base
    CompileLayersConverter(CPU)(reference_model(tiny_gpt_config(num_layers=1)))
    return cache_dir()


def test_each_rank_compiles_into_its_own_directory(tmp_path):
    """Inductor's C++ builder writes a layer's .so in place under a name made from its code: two ranks of one host
    compiling the same layer must not share the directory."""
    dirs = run_ranks(_inductor_build_directory, 2, str(tmp_path))
    assert dirs == [str(tmp_path / "rank0"), str(tmp_path / "rank1")]

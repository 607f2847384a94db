"""A Qwen3-shaped toy through pretrain_gpt.py (QK-norm, 2 query groups, --kv-channels 16 with hidden 32 and 4
heads, on the tiny Llama of testing/cli.py) at the layouts and speed-ups Qwen3 is trained with, fp32:

- CP2 (the ring exchange, p2p) logs the one-process run's losses, each within model_rtol of the step's
  dependency path: the q and k norms act per head on each rank's chunks, RoPE takes the chunks' positions;
- FP8 (torchao, emulated): the blocks' QKV, projection and MLP become FP8 matmuls, the q/k norms stay (they
  are norms, not linear layers), and a step trains; through pretrain_gpt.py (slow) at TP2 with sequence
  parallelism the loss falls;
- --compile-layers (slow): the compiled run logs the eager run's losses within model_rtol (inductor reorders
  the sums: tests/test_compile_layers.py's bound).
"""
import pytest
import torch

from megatron_zero.testing.cli import TINY, cli_flags, logged_losses, pretrain_cli, text_data
from megatron_zero.testing.tolerances import assert_losses_close, gpt_path_length, model_rtol

QWEN3 = {"qk-layernorm": True, "kv-channels": 16}
ITERS = 3


def _flags(root, *changes):
    data = str(root / "text")
    if not (root / "text.idx").exists():
        text_data(data)
    return cli_flags(data, str(root / "cache"), "llama", QWEN3, {"train-iters": ITERS}, *changes)


def _rtol(argv):
    """The losses' tolerance: the step's summation path of the model these flags build."""
    from megatron_zero.arguments import parse_args
    from megatron_zero.model.architecture import gpt_config

    cfg = gpt_config(parse_args(argv, world_size=1), 257)
    assert (cfg.qk_layernorm, cfg.head_dim, cfg.num_query_groups) == (True, 16, 2)
    return model_rtol(gpt_path_length(cfg, TINY["global-batch-size"] * TINY["seq-length"]))


def _in_order(losses):
    assert sorted(losses) == list(range(1, ITERS + 1)), losses
    return [losses[i] for i in sorted(losses)]


@pytest.mark.multirank
def test_cp2_matches_one_process(tmp_path):
    one = _flags(tmp_path)
    want = _in_order(logged_losses(pretrain_cli(1, one)))
    got = _in_order(logged_losses(pretrain_cli(2, _flags(tmp_path, {"context-parallel-size": 2}))))
    assert_losses_close(got, want, _rtol(one), "Qwen3 toy at CP2")


def test_fp8_converts_the_linear_layers_not_the_qk_norms_and_trains():
    pytest.importorskip("torchao")
    from megatron_zero.fp8.convert import Float8Converter
    from megatron_zero.fp8.settings import Float8Settings
    from megatron_zero.model import reference_model
    from megatron_zero.testing.tiny_gpt import tiny_llama_config

    cfg = tiny_llama_config(num_layers=2, num_attention_heads=4, kv_channels=32, qk_layernorm=True,
                            hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = reference_model(cfg)
    line = Float8Converter(Float8Settings("hybrid", "tensorwise", emulate=True), torch.device("cpu"))(model)
    assert "8 linear layers" in line, line  # 2 blocks x (QKV, projection, 2 MLP)
    attention = model.get_submodule("2.self_attention")
    assert all(type(getattr(attention, n)).__name__.startswith("Float8") for n in ("query_key_value", "dense"))
    assert not type(attention.q_layernorm).__name__.startswith("Float8")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


@pytest.mark.slow  # default tier: test_fp8_converts_the_linear_layers_not_the_qk_norms_and_trains
@pytest.mark.multirank
def test_cli_fp8_trains_at_tp2_with_sequence_parallelism(tmp_path):
    pytest.importorskip("torchao")
    run = pretrain_cli(2, _flags(tmp_path, {"tensor-model-parallel-size": 2, "sequence-parallel": True,
                                            "fp8-format": "hybrid", "fp8-emulate": True}))
    assert "8 linear layers of this stage's blocks" in run.stdout + run.stderr  # 2 blocks x (QKV, dense, 2 MLP)
    losses = _in_order(logged_losses(run))
    assert losses[-1] < losses[0], losses


@pytest.mark.slow  # default tier: tests/test_compile_layers.py::test_one_layer_compiled_matches_eager
def test_cli_compile_layers_matches_eager(tmp_path):
    eager = _flags(tmp_path)
    compiled = pretrain_cli(1, _flags(tmp_path, {"compile-layers": True}), timeout=900)
    assert compiled.stdout.count("compiled layers: 2 transformer layers compiled") == 1, compiled.stdout[-3000:]
    want = _in_order(logged_losses(pretrain_cli(1, eager)))
    assert_losses_close(_in_order(logged_losses(compiled)), want, _rtol(eager), "Qwen3 toy compiled")

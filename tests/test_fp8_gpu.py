"""FP8 on the GPU: torchao's FP8 GEMMs (torch._scaled_mm on FP8 tensor cores) against the emulated ones.

Marked `gpu`, skipped with the reason where torch sees no CUDA device; MEGATRON_ZERO_TEST_DEVICE=cpu runs it
on the CPU, where both sides are emulated. The same bf16 model, converted twice (real FP8 GEMMs where the
device has FP8 tensor cores, emulated), takes the same batch: both cast with the same scales to the same
FP8 values, and differ only in how each GEMM accumulates and rounds its output to bf16 (one bf16 rounding,
2^-8 relative, per GEMM on the forward path; fp8_gemm_output_rtol). A few steps on one batch make the loss fall.
The same for an MoE model (each expert's GEMMs on its own rows, --moe-grouped-gemm's path).
"""
import copy
import os

import pytest
import torch

from megatron_zero.fp8.convert import Float8Converter
from megatron_zero.fp8.settings import Float8Settings, has_fp8_tensor_cores
from megatron_zero.model import reference_model
from megatron_zero.testing.tiny_gpt import tiny_llama_config

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao.float8")
FORCED = os.environ.get("MEGATRON_ZERO_TEST_DEVICE")


@pytest.fixture(scope="module")
def device():
    if FORCED:
        return torch.device(FORCED)
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
                    "the GPU tier runs on a GPU machine")
    return torch.device("cuda", 0)


def fp8_gemm_output_rtol(gemms: int) -> float:
    """Two FP8 GEMM chains on the same FP8 operands whose outputs are each rounded to bf16 once: per GEMM the
    outputs differ by at most two bf16 roundings (2 x 2^-8 relative), to first order additive along the path."""
    return gemms * 2 * 2.0 ** -8


# the MoE model: 4 experts top-2 on the grouped-GEMM path, each expert's FP8 GEMMs on its rows, whose counts
# routing does not keep multiples of 16 (the weight gradient's inner dimension, padded); a token's path through
# its experts is two GEMMs deep, as the dense MLP's
MOE = dict(num_experts=4, moe_router_topk=2, moe_grouped_gemm=True)


@pytest.mark.parametrize("moe", [{}, MOE], ids=["dense", "moe"])
def test_fp8_step_matches_emulated_and_loss_falls(device, moe):
    # hidden and FFN multiples of 16: torch._scaled_mm's shape rule
    cfg = tiny_llama_config(num_layers=2, hidden_size=64, ffn_hidden_size=128, seq_length=32,
                            max_position_embeddings=32, params_dtype=torch.bfloat16, **moe)
    torch.manual_seed(0)
    with device:
        real = reference_model(cfg)
    emulated = copy.deepcopy(real)
    Float8Converter(Float8Settings("hybrid", "tensorwise", emulate=not has_fp8_tensor_cores(device)), device)(real)
    Float8Converter(Float8Settings("hybrid", "tensorwise", emulate=True), device)(emulated)
    tokens = torch.randint(0, 100, (4, 33), generator=torch.Generator().manual_seed(1)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:].contiguous()
    got, want = real(x, labels=y).float().item(), emulated(x, labels=y).float().item()
    gemms = cfg.num_layers * 4 + 1  # QKV, projection, the MLP's two per block; the output layer
    assert abs(got - want) <= fp8_gemm_output_rtol(gemms) * abs(want), (got, want)
    opt = torch.optim.AdamW(real.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = real(x, labels=y)
        loss.backward()
        opt.step()
        losses.append(loss.float().item())
    assert losses[-1] < losses[0], losses

"""An FP8-converted model saves what a bf16 model saves: the converter keeps every parameter object and
name, and registers no buffer (FP8 scales are recomputed at each use), so the checkpoint code, its reshape
and its exports see the same state either way, and either loads the other's."""
import pytest
import torch

from megatron_zero.fp8.convert import Float8Converter
from megatron_zero.fp8.settings import Float8Settings
from megatron_zero.model import reference_model
from megatron_zero.testing.tiny_gpt import tiny_llama_config

pytest.importorskip("torchao.float8")


def test_fp8_model_state_is_the_bf16_models():
    cfg = tiny_llama_config(num_layers=2, params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    plain = reference_model(cfg)
    params = dict(plain.named_parameters())
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    converted = reference_model(cfg)
    converted.load_state_dict(before)  # a bf16 checkpoint into the model about to train in FP8
    Float8Converter(Float8Settings("hybrid", emulate=True), torch.device("cpu"))(converted)
    Float8Converter(Float8Settings("hybrid", emulate=True), torch.device("cpu"))(plain)
    assert dict(plain.named_parameters()) == params  # the same objects: the optimizer's, ZeRO's
    after = converted.state_dict()
    assert list(after) == list(before)
    assert [n for n, _ in converted.named_buffers()] == [n for n, _ in reference_model(cfg).named_buffers()]
    for name, value in after.items():
        assert value.dtype == before[name].dtype and torch.equal(value, before[name]), name
    back = reference_model(cfg)
    back.load_state_dict(after)  # an FP8 run's weights resume in bf16

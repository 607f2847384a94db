"""Every ZeRO stage implementation offers the declared interface (zero/stage_interface.py)."""
import pytest

from megatron_zero.model.gpt import GPTModel
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.zero import ZeroOptimizer
from megatron_zero.zero.stage_interface import ZeroStage


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stages_implement_the_protocol(stage):
    model = GPTModel(tiny_gpt_config(num_layers=1))
    opt = ZeroOptimizer(list(model.named_parameters()), stage=stage, module=model, lr=1e-3)
    assert isinstance(opt.impl, ZeroStage)
    declared = set(ZeroStage.__annotations__) | {n for n in vars(ZeroStage) if not n.startswith("_")}
    assert len(declared) == 13 and all(callable(getattr(opt.impl, n)) for n in declared
                                       if n not in ZeroStage.__annotations__)

"""torchao's own FP8 model, the one-rank reference of tests/test_fp8_parity.py and tests/test_fp8_moe.py: every
TP-1 parallel linear layer of the blocks (an MoE expert's too) as an nn.Linear with the same parameters,
converted by torchao's convert_to_float8_training."""
from torch import nn

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class AsLinear(nn.Module):
    """A TP-1 parallel linear layer as an nn.Linear with the same parameters (what torchao converts)."""

    def __init__(self, layer):
        super().__init__()
        self.linear = nn.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=False)
        self.linear.weight = layer.weight
        self.bias, self.skip_bias_add = layer.bias, layer.skip_bias_add

    def forward(self, x):
        y = self.linear(x)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


def torchao_reference(model, settings):
    """`model` (one process) with its blocks' linear layers converted by torchao itself, in place."""
    import torchao.float8 as torchao_float8

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) in (ColumnParallelLinear, RowParallelLinear) and name != "lm_head":
                setattr(module, name, AsLinear(child))
    torchao_float8.convert_to_float8_training(model, config=settings.linear_config(),
                                              module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    return model

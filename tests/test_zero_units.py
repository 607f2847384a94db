"""zero/units.py: the units per-layer gathers work on (stage 3, stage 1/2's overlapped parameter gathers)."""
import torch.nn as nn

from megatron_zero.testing.toy_zero import ToyGPT
from megatron_zero.zero.units import model_units


def test_children_in_order_with_containers_expanded_recursively():
    model = ToyGPT(layers=2)
    assert model_units(model) == [model.embed, *model.blocks, model.final_ln, model.head]
    a, b, c, d = nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1), nn.Linear(1, 1)
    nested = nn.Sequential(a, nn.ModuleList([b, nn.ModuleDict({"x": c})]), d)
    assert model_units(nested) == [a, b, c, d]
    assert model_units(nn.Linear(1, 1)) == []  # a leaf is no container of units

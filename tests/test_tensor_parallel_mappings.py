"""The TP-region mappings' forward/backward semantics, and the parallel layers vs their dense equivalents.

The layers' outputs and gradients match the dense ones within the worst-case bound for fp32 sums in
another order (megatron_zero/testing/tolerances.py: reduction_atol): n * eps32 * sum|terms| per element,
sum|terms| from the same forward and backward run on absolute values, n = PATH terms."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_zero.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           copy_to_tensor_model_parallel_region,
                                           gather_from_tensor_model_parallel_region,
                                           reduce_from_tensor_model_parallel_region,
                                           scatter_to_tensor_model_parallel_region)
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tolerances import assert_within, reduction_atol
from megatron_zero.distributed.topology import build_parallel_state


def per_rank(rank, shape=(2, 8)):
    return torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape) * (rank + 1)


def mappings_fn(tp):
    group = build_parallel_state(tp=tp).tp_group
    r, out = dist.get_rank(), {}
    for name, fn in [("copy", copy_to_tensor_model_parallel_region), ("reduce", reduce_from_tensor_model_parallel_region),
                     ("scatter", scatter_to_tensor_model_parallel_region),
                     ("gather", gather_from_tensor_model_parallel_region)]:
        x = per_rank(r).requires_grad_()
        y = fn(x, group)
        y.backward(per_rank(r, y.shape) + 100 * r)
        out[name] = (y.detach(), x.grad)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_mapping_semantics(tp):
    results = run_ranks(mappings_fn, tp, tp, timeout=60)
    xs = [per_rank(r) for r in range(tp)]
    for r, res in enumerate(results):
        def g(shape):  # the upstream gradient every rank fed
            return [per_rank(q, shape) + 100 * q for q in range(tp)]
        y, grad = res["copy"]
        assert torch.equal(y, xs[r]) and torch.equal(grad, sum(g((2, 8))))
        y, grad = res["reduce"]
        assert torch.equal(y, sum(xs)) and torch.equal(grad, g((2, 8))[r])
        y, grad = res["scatter"]
        w = 8 // tp
        assert torch.equal(y, xs[r][:, r * w:(r + 1) * w])
        assert torch.equal(grad, torch.cat(g((2, w)), dim=-1))
        y, grad = res["gather"]
        assert torch.equal(y, torch.cat(xs, dim=-1))
        assert torch.equal(grad, g((2, 8 * tp))[r][:, r * 8:(r + 1) * 8])


def test_group_none_is_identity():
    x = torch.randn(3, 4)
    for fn in (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
               scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region):
        assert fn(x, None) is x


def full_weights():
    gen = torch.Generator().manual_seed(3)
    return {k: torch.randn(*shape, generator=gen) for k, shape in
            dict(col_w=(12, 6), col_b=(12,), row_w=(6, 12), row_b=(6,), emb=(16, 6), x=(2, 3, 6)).items()}


def layers_fn(tp):
    group = build_parallel_state(tp=tp).tp_group
    r, f = dist.get_rank(), full_weights()
    col = ColumnParallelLinear(6, 12, group, gather_output=False)
    row = RowParallelLinear(12, 6, group, input_is_parallel=True)
    emb = VocabParallelEmbedding(16, 6, group)
    with torch.no_grad():
        col.weight.copy_(f["col_w"].chunk(tp)[r]), col.bias.copy_(f["col_b"].chunk(tp)[r])
        row.weight.copy_(f["row_w"].chunk(tp, dim=1)[r]), row.bias.copy_(f["row_b"])
        emb.weight.copy_(f["emb"].chunk(tp)[r])
    x = f["x"].clone().requires_grad_()
    tokens = torch.tensor([[0, 5, 15], [8, 3, 12]])
    y = row(col(x)) + emb(tokens)
    y.square().sum().backward()
    attrs = [(p.tensor_model_parallel, getattr(p, "partition_dim", None))
             for p in (col.weight, col.bias, row.weight, row.bias, emb.weight)]
    return y.detach(), x.grad, col.weight.grad, row.weight.grad, row.bias.grad, emb.weight.grad, attrs


# The longest chain of fp32 sums a result goes through: forward 6 (column layer) + 1 (its bias) + 12 (row
# layer, its TP all-reduce included) + 1 (its bias) + 1 (the embedding); backward 6 (through the row
# layer) + 12 (the column layer's input gradient) + 6 (the weight gradients' sum over the tokens).
PATH = 21 + 24


def dense(params):
    tokens = torch.tensor([[0, 5, 15], [8, 3, 12]])
    y = F.linear(F.linear(params["x"], params["col_w"], params["col_b"]), params["row_w"], params["row_b"])
    y = y + F.embedding(tokens, params["emb"])
    y.backward(2 * y.detach())  # d(sum y^2) / dy
    return y.detach(), {k: p.grad for k, p in params.items()}


@pytest.mark.isa
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_layers_match_dense(tp):
    f = full_weights()
    y, grads = dense({k: v.clone().requires_grad_() for k, v in f.items()})
    # every product and sum again on |values| in fp64: each result's sum |terms|
    y_mag, grad_mag = dense({k: v.abs().double().requires_grad_() for k, v in f.items()})
    bound = {k: reduction_atol(PATH, m) for k, m in grad_mag.items()}
    results = run_ranks(layers_fn, tp, tp, timeout=60)
    for r, (out, gx, gcol, grow, grow_b, gemb, attrs) in enumerate(results):
        assert_within(out, y, reduction_atol(PATH, y_mag), "output")
        assert_within(gx, grads["x"], bound["x"], "input gradient")
        assert_within(gcol, grads["col_w"].chunk(tp)[r], bound["col_w"].chunk(tp)[r], "column weight gradient")
        assert_within(grow, grads["row_w"].chunk(tp, dim=1)[r], bound["row_w"].chunk(tp, dim=1)[r],
                      "row weight gradient")
        assert_within(grow_b, grads["row_b"], bound["row_b"], "row bias gradient")
        assert_within(gemb, grads["emb"].chunk(tp)[r], bound["emb"].chunk(tp)[r], "embedding gradient")
        assert attrs == [(True, 0), (True, 0), (True, 1), (False, None), (True, 0)]

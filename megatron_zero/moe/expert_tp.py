"""Expert tensor parallelism over ranks that route different tokens (Megatron-Core's alltoall dispatcher
with `--expert-tensor-parallel-size` ETP and sequence parallelism).

With sequence parallelism (or TP = 1) every rank routes its own tokens. After the expert-parallel
exchange a rank holds the rows its EP group sent to its local experts; the ETP ranks of its
expert-tensor-parallel group hold slices of the same experts and different rows, so:

    gather:   every ETP rank's rows, all-gathered (variable counts: each rank's padded to the largest,
              `all_gather_into_tensor`), regrouped by local expert; backward reduce-scatters the gradient
    experts:  fc1 column slice, activation, fc2 row slice on every gathered row, with no collective: each
              rank's output is its partial sum over its slice of the expert's width (with FP8 each
              expert's own FP8 matmuls, its scales' amaxes reduced over ETP: fp8/experts.py)
    scatter:  the partial outputs reduce-scattered back to the ranks whose rows they are
              (`reduce_scatter_tensor` over the padded blocks); backward all-gathers the gradient
    bias:     fc2's bias (replicated over ETP) added to this rank's own rows after the reduce-scatter; its
              gradient, this rank's rows' part, is summed over the ETP group in backward

The row counts are host integers (one all-gather of the local experts' counts per layer, read once), as
the EP exchange's are.
"""
from __future__ import annotations

from itertools import accumulate
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.device import has_grouped_mm, ints_to_device
from .. import ops
from ..distributed.reduce_scatter import all_gather_into_tensor, reduce_scatter_tensor
from ..tensor_parallel import copy_to_tensor_model_parallel_region
from ..tensor_parallel.conjugate import conjugate_pair
from .dispatch import sort_by_expert
from .grouped_mlp import experts_linear, grouped_mm_fits, is_float8, rows_bias


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def gather_rows(x: torch.Tensor, sizes: List[int], group) -> torch.Tensor:
    """Every rank's rows (sizes[r] from rank r) concatenated in rank order."""
    most = max(sizes)
    out = x.new_empty((len(sizes) * most,) + tuple(x.shape[1:]))
    all_gather_into_tensor(out, _padded(x.contiguous(), most), group=group)
    return torch.cat([out[r * most:r * most + n] for r, n in enumerate(sizes)])


def reduce_scatter_rows(x: torch.Tensor, sizes: List[int], group) -> torch.Tensor:
    """sum over ranks of x (every rank's rows, sizes[r] of rank r, in rank order), this rank's rows kept."""
    most = max(sizes)
    blocks = torch.cat([_padded(part, most) for part in torch.split(x, sizes)])
    out = x.new_empty((most,) + tuple(x.shape[1:]))
    reduce_scatter_tensor(out, blocks.contiguous(), group=group)
    return out[:sizes[dist.get_rank(group)]]


_GatherRows, _ReduceScatterRows = conjugate_pair(gather_rows, reduce_scatter_rows)  # each the other's backward


class ExpertTensorParallelRows:
    """One MoE layer's rows over the expert-tensor-parallel group: `gather` (rows grouped by local expert
    in, every ETP rank's rows grouped by local expert out) and `scatter` (back, summed over ETP)."""

    def __init__(self, local_counts: torch.Tensor, group):
        etp, local = dist.get_world_size(group), local_counts.numel()
        table = local_counts.new_empty(etp * local)
        all_gather_into_tensor(table, local_counts.contiguous(), group=group)
        rows = table.view(etp, local).tolist()  # the exchange's one host read
        self.group = group
        self.sizes = [sum(r) for r in rows]
        self.mine = rows[dist.get_rank(group)]
        self.rows_per_local_expert = [sum(col) for col in zip(*rows)]
        local_ids = torch.arange(local, device=local_counts.device).repeat(etp)
        self.regroup = sort_by_expert(torch.repeat_interleave(local_ids, table, output_size=sum(self.sizes)))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return _GatherRows.apply(rows, self.sizes, self.group).index_select(0, self.regroup)

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        back = torch.empty_like(rows).index_copy(0, self.regroup, rows)
        return _ReduceScatterRows.apply(back, self.sizes, self.group)


def _expert_of_row(counts: List[int], device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(counts), device=device),
                                   ints_to_device(counts, torch.int64, device), output_size=sum(counts))


def experts_over_etp(experts, rows: torch.Tensor, exchange: ExpertTensorParallelRows, swiglu: bool,
                     grouped_gemm: bool) -> torch.Tensor:
    """The local experts (each ETP-sliced: fc1 by output, fc2 by input) on this rank's rows, grouped by local
    expert (`exchange.mine` rows each), with the other ETP ranks' rows: gather, partial MLP, reduce-scatter,
    fc2's bias."""
    x = exchange.gather(rows)
    counts = exchange.rows_per_local_expert
    fc1 = [e.dense_h_to_4h for e in experts]
    fc2 = [e.dense_4h_to_h for e in experts]
    grouped = (grouped_gemm and x.shape[0] > 0 and not is_float8(fc1) and has_grouped_mm(x.device, x.dtype)
               and grouped_mm_fits(x.dtype, *fc1[0].weight.shape, fc2[0].weight.shape[1]))
    offs = ints_to_device(list(accumulate(counts)), torch.int32, x.device) if grouped else None
    y = experts_linear(x, fc1, counts, offs, grouped)
    if fc1[0].bias is not None:  # column-parallel: this rank's slice of the bias
        y = y + rows_bias([m.bias for m in fc1], _expert_of_row(counts, x.device))
    y = ops.swiglu(y) if swiglu else F.gelu(y, approximate="tanh")
    out = exchange.scatter(experts_linear(y, fc2, counts, offs, grouped))
    if fc2[0].bias is not None:  # replicated over ETP: added once, to this rank's own rows
        biases = [copy_to_tensor_model_parallel_region(m.bias, exchange.group) for m in fc2]
        out = out + rows_bias(biases, _expert_of_row(exchange.mine, x.device))
    return out

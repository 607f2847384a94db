"""`reduce_scatter(out, parts, group)`: torch.distributed's list-form reduce-scatter on every torch the
package supports (setup.py: torch>=2.4,<2.14).

Gloo has the list form (`dist.reduce_scatter`) only from torch 2.7 (pytorch/pytorch#149869); on 2.4 to
2.6 it raises "ProcessGroupGloo does not support reduce_scatter". There the parts are concatenated (one
copy of the input) and reduced with `dist.reduce_scatter_tensor`, which gloo has had since 2.3 (an
all-reduce keeping this rank's chunk, async included). NCCL, and gloo from torch 2.7 on, take the list
form exactly as before.

    work = reduce_scatter(out, [part_0, ..., part_{world-1}], group, async_op=True)   # out = sum_r part_rank

The single-tensor forms, which need no copy where the parts are the chunks of one tensor, under the name
each torch prefers (2.13 renamed them `reduce_scatter_single` / `all_gather_single` and deprecates the old):

    reduce_scatter_tensor(out, flat_in, group=group, async_op=False)    # out = chunk `rank` of sum_r flat_in
    all_gather_into_tensor(flat_out, mine, group=group, async_op=False)  # flat_out = cat_r mine_r
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gloo_lacks_list_form(group) -> bool:
    """True where `dist.reduce_scatter` would refuse: a gloo group under torch older than 2.7."""
    return torch.__version__ < (2, 7) and dist.get_backend(group) == "gloo"


def reduce_scatter(out: torch.Tensor, parts: Sequence[torch.Tensor], group=None, async_op: bool = False):
    """dist.reduce_scatter(out, parts, group), or its tensor form over the concatenated parts where gloo
    lacks the list form; returns the Work when `async_op`."""
    if gloo_lacks_list_form(group):
        flat_in = torch.cat([p.reshape(-1) for p in parts])
        return reduce_scatter_tensor(out.view(-1), flat_in, group=group, async_op=async_op)
    return dist.reduce_scatter(out, list(parts), group=group, async_op=async_op)

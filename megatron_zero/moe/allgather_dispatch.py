"""`--moe-token-dispatcher-type allgather`: Megatron-Core's MoEAllGatherTokenDispatcher over the expert-parallel
group, the alternative to the all-to-all of dispatch.py with the same result.

    gather:    every EP rank's tokens [T, h], router weights [T, k] and expert ids [T, k], all-gathered
               (all_gather_into_tensor: [EP T, ...] in EP rank order; backward reduce-scatters the gradients,
               so a token's and a weight's gradient reach their own rank summed over the experts' ranks)
    local:     the gathered pairs routed to this rank's experts [first, first + local), as local ids; every
               other pair (another rank's expert, or dropped by capacity: id E) gets id `local`, sorts past
               the local runs and is cut off (permute), so no expert sees it
    experts:   this rank's experts on their runs of rows (the caller's function)
    combine:   each row times its router weight, added into its token of the gathered [EP T, h] (unpermute;
               zero where no local expert had the token), then reduce-scattered over the EP group: each rank
               receives its own T tokens summed over the ranks that hold their k experts (backward:
               all-gather), never an all-reduce followed by a slice

Every rank of an EP group routes the same number of tokens (the same micro-batch size and sequence length on
every data-parallel rank). Tensor-parallel ranks see the same tokens (no sequence parallelism with MoE), so the
gather spans the EP group alone. Host read: the local experts' row counts, once per layer and micro-batch, as
for the all-to-all. A token's k contributions are summed in another order than dispatch.py's (within a rank,
then across ranks), so the two dispatchers agree to fp32 reordering.
"""
from __future__ import annotations

import torch

from ..tensor_parallel.mappings import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from .dispatch import permute, unpermute


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """[T, ...] on each rank -> [EP T, ...] in rank order; backward: each rank's rows summed over ranks (the
    sequence-parallel mapping on x seen as one sequence of T tokens)."""
    return gather_from_sequence_parallel_region(x.unsqueeze(0), group).squeeze(0)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """[EP T, ...] on each rank -> this rank's T rows summed over ranks; backward: all-gather."""
    return reduce_scatter_to_sequence_parallel_region(x.unsqueeze(0), group).squeeze(0)


def allgather_dispatch(tokens: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts, group,
                       first: int, local: int) -> torch.Tensor:
    """tokens [T, h], weights and expert_ids [T, k] (dropped pairs: id E) -> [T, h], the weighted sum of each
    token's experts' outputs. `experts(rows, rows_per_local_expert)`: this rank's experts [first, first + local)."""
    all_tokens = _gather(tokens, group)
    all_weights = _gather(weights, group)
    all_ids = _gather(expert_ids, group) - first
    local_ids = torch.where((all_ids >= 0) & (all_ids < local), all_ids, local)
    rows_per_expert = torch.bincount(local_ids.reshape(-1), minlength=local + 1)[:local].tolist()  # host read
    rows, order, token_of_row = permute(all_tokens, local_ids, sum(rows_per_expert))
    out = experts(rows, rows_per_expert)
    return _reduce_scatter(unpermute(out, all_weights, order, token_of_row, all_tokens.shape[0]), group)

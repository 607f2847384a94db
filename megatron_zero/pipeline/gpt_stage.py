"""One pipeline stage of the GPT: building it, feeding it micro-batches, keeping the tied embedding tied.

The first and the last stage both hold `tied_modules.embed` (the last uses the
word embedding as its output layer). After each global batch's backward their
gradients are summed over the embedding group, so both copies take the same
update and never drift. The position embedding is summed too: the last stage's
copy gets a zero gradient of its own, so it stays equal to the first stage's.
An untied model (--untie-embeddings-and-output-weights) has no shared tensor: the embedding
lives on the first stage, the output head on the last, and none of this applies; but with multi-token
prediction the last stage embeds tokens too, and holds a copy of the untied embedding (`1.*`) kept equal so.
The last stage's copies are marked `shared` so the gradient norm counts them once, and
both copies `zero_defer_reduce` so ZeRO reduces them only after that sum (their micro-batches are
summed in the optimizer's fp32 `main_grad`, and that is what the sum adds).

Interleaved (virtual_stages v > 1): the rank's one GPTModel holds its v model chunks
(partition.virtual_stage_layer_ranges), so parameter names, checkpoints and the ZeRO optimizer
see all of them as one stage; `forward_step(i, x, chunk)` runs one chunk, and the stages pass
activations around a ring (stage_p2p), the last rank's chunk k feeding the first rank's chunk k + 1.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..distributed import shm_comm
from ..distributed.device import HOST
from ..model.gpt import GPTModel
from ..model.layer_indices import EMBEDDING_INDEX, block_layer_index, final_norm_index, lm_head_index
from ..model.params import layer_param_names, param_spec
from ..distributed.topology import ParallelState
from .p2p import P2P
from .partition import PartitionError, stage_layer_ranges, virtual_stage_layer_ranges


def build_gpt_stage(config, state: ParallelState, partition_method: str = "uniform",
                    explicit_partition: Optional[Sequence[int]] = None, device: torch.device = HOST,
                    virtual_stages: int = 1) -> GPTModel:
    """This rank's stage (its `virtual_stages` model chunks), its parameters created on `device` (the
    initial values are drawn on the host)."""
    if virtual_stages > 1:
        if explicit_partition is not None or partition_method != "uniform":
            raise PartitionError("an interleaved pipeline splits the layers uniformly into virtual stages; it "
                                 "takes no explicit or parameter-balanced partition")
        chunks = virtual_stage_layer_ranges(config.num_layers, state.pp_size, virtual_stages)[state.pp_rank]
    else:
        chunks = [stage_layer_ranges(config.num_layers, state.pp_size, method=partition_method,
                                     explicit=explicit_partition, **_param_weights(config))[state.pp_rank]]
    tp_group = state.tp_group if state.tp_size > 1 else None
    with device:  # the default device for the modules' own tensors
        model = GPTModel(config, tp_group, layer_indices=[i for start, end in chunks for i in range(start, end)],
                         cp_group=state.cp_group, ep_group=state.ep_group, etp_group=state.expert_tp_group,
                         cp_hierarchy=state.cp_hierarchy)
    shared = model.pipeline_shared_embedding()
    if state.pp_size > 1 and shared is not None:
        for param in shared.parameters():
            param.zero_defer_reduce = True  # ZeRO reduces it after sync_tied_embedding_grads
            if state.is_last_stage:
                param.shared = True
    return model


def _param_weights(config) -> Dict[str, int]:
    """Parameter counts from the catalogue: a block, the embedding, and the final norm plus an untied head."""
    def count(*indices):
        return sum(math.prod(param_spec(n, config).full_shape) for i in indices for n in layer_param_names(i, config))
    L = config.num_layers
    return {"block_params": count(block_layer_index(0)), "embedding_params": count(EMBEDDING_INDEX),
            "final_params": count(final_norm_index(L), lm_head_index(L))}


def sync_tied_embedding_grads(model: GPTModel, state: ParallelState, reduce_dtype: Optional[torch.dtype] = None):
    """Sum the embedding's gradients over the first and last stage (no-op without pipelining).

    The sum is of each parameter's fp32 `main_grad` where the ZeRO optimizer keeps one (it does for
    these parameters unless --no-gradient-accumulation-fusion at stage 0/1), else of `.grad`; it is
    reduced in `reduce_dtype` (bfloat16 under --grad-reduce-in-bf16; default: the gradient's dtype)."""
    shared = model.pipeline_shared_embedding()
    if state.pp_size == 1 or shared is None:
        return
    grads = []
    for param in shared.parameters():
        grad = getattr(param, "main_grad", None)
        if grad is None:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
        grads.append(grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    if reduce_dtype is not None and reduce_dtype != flat.dtype:
        flat = flat.to(reduce_dtype)
    shm_comm.all_reduce(flat, state.embedding_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def make_forward_step(model: GPTModel, micro_batches: List[dict], state: ParallelState) -> Callable:
    """forward_step(i, x, chunk=0) for the schedules: tokens in on the first stage's first chunk, loss / M
    out of the last stage's last chunk."""
    m, last_chunk = len(micro_batches), len(model.chunks) - 1

    def forward_step(i, x, chunk=0):
        batch = micro_batches[i]
        inputs = batch["tokens"] if state.is_first_stage and chunk == 0 else x
        if state.is_last_stage and chunk == last_chunk:  # (the tokens: multi-token prediction's)
            return model(inputs, labels=batch["labels"], loss_mask=batch.get("loss_mask"), chunk=chunk,
                         tokens=batch.get("tokens")) / m
        return model(inputs, chunk=chunk)

    return forward_step


def grad_reduce_arming(model: GPTModel, optimizer) -> Callable:
    """The schedules' `before_last_backward`: plain 1F1B calls it with no chunk (every gradient is ready
    after that backward), the interleaved schedule with the chunk whose last backward comes next (that
    chunk's parameters are; the tied embedding's are reduced at the step anyway)."""
    def arm(chunk=None):
        if chunk is None:
            return optimizer.arm_grad_reduce()
        modules = [model._modules[str(i)] for i in model.chunks[chunk] if str(i) in model._modules]
        optimizer.arm_grad_reduce([p for module in modules for p in module.parameters()])
    return arm


def stage_p2p(state: ParallelState, shape, dtype, device: torch.device = HOST, virtual_stages: int = 1) -> P2P:
    """This stage's transfers: to its neighbours, or, interleaved, around the ring of pipeline ranks (a
    collective over the pipeline group: it sets up shared memory where that applies)."""
    if virtual_stages == 1:
        return P2P(state.prev_rank, state.next_rank, shape, dtype, device, state.pp_group)
    ring, r = state.layout.pp_group(state.rank), state.pp_rank
    return P2P(ring[r - 1], ring[(r + 1) % len(ring)], shape, dtype, device, state.pp_group)


def activation_shape(micro_batch_size: int, config, tp: int = 1, cp: int = 1) -> tuple:
    """What one stage sends the next: [b, s / cp, h] (this CP rank's chunks), or [b, s / (cp tp), h] with
    sequence parallelism."""
    seq = config.seq_length // cp
    return (micro_batch_size, seq // tp if config.sequence_parallel else seq, config.hidden_size)

"""GPT (GPT-2 as Megatron builds it, or the Llama family), tensor-parallel, buildable one pipeline stage at a time.

    model = GPTModel(config)                                  # whole model, TP=1: the reference
    model = GPTModel(config, tp_group)                        # whole model, TP-sharded
    stage = GPTModel(config, tp_group, layer_indices=range(a, b))   # one pipeline stage
    stage = GPTModel(config, tp_group, layer_indices=[*range(a, b), *range(c, d)])  # interleaved: two
                                                              # model chunks, run by forward(x, chunk=k)
    stage = GPTModel(config, tp_group, layer_indices, cp_group=cp_group)  # context-parallel: inputs are
                                                              # this CP rank's chunks (context_parallel/)
    model = GPTModel(moe_config, tp_group, ep_group=ep_group)   # MoE layers' experts over EP ranks

Layers carry Megatron-DeepSpeed's global indices (see layer_indices.py), so parameter
names are the same whatever the layout. `tp_group=None` is TP=1 with no
communication: that is the single-process reference path for parity tests.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ..distributed import shm_comm
from ..tensor_parallel import vocab_parallel_cross_entropy
from ..tensor_parallel.utils import tp_rank_in, tp_world_size
from .config import GPTConfig
from .init import initialize_parameters
from .layer_indices import (EMBEDDING_INDEX, block_number, holds_embedding, is_block_index, layer_kind, lm_head_index,
                            mtp_index, num_pipeline_layers)
from .multi_token_prediction import MultiTokenPrediction
from .recompute import run_layers
from .transformer import Embedding, LMHead, ParallelTransformerLayer, build_norm, local_positions


class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig, tp_group=None, layer_indices: Optional[Iterable[int]] = None,
                 cp_group=None, ep_group=None, etp_group=None, cp_hierarchy=None):
        super().__init__()
        L = config.num_layers
        self.config, self.tp_group, self.cp_group = config, tp_group, cp_group
        self.tp, self.tp_rank = tp_world_size(tp_group), tp_rank_in(tp_group)
        config.check_tp(self.tp, tp_world_size(etp_group) if etp_group is not None else None)
        all_layers = range(num_pipeline_layers(L))
        self.layer_indices = list(all_layers if layer_indices is None else layer_indices)
        if not self.layer_indices or self.layer_indices != sorted(set(self.layer_indices)) \
                or self.layer_indices[0] < 0 or self.layer_indices[-1] >= len(all_layers):
            raise ValueError(f"layer_indices must be non-empty, increasing and within 0..{len(all_layers) - 1}, "
                             f"got {self.layer_indices}")
        self.tied = not config.untie_embeddings_and_output_weights
        # the output layer and the loss fused by vocabulary chunks (model/output_loss_converter.py sets it per run)
        self.fused_output_loss = True
        mirror = False  # an untied embedding's copy on the last stage, which multi-token prediction embeds with
        if config.mtp_num_layers and lm_head_index(L) in self.layer_indices:
            mirror = not self.tied and EMBEDDING_INDEX not in self.layer_indices
            self.layer_indices.append(mtp_index(L))
        self.chunks = _contiguous_runs(self.layer_indices)  # the model chunks of an interleaved stage
        if self.tied and holds_embedding(self.layer_indices, L):
            self.tied_modules = nn.ModuleDict({"embed": Embedding(config, tp_group, cp_group)})
        if mirror:  # under the first stage's names (`1.`), kept equal to it as a tied embedding is (gpt_stage.py)
            self.add_module(str(EMBEDDING_INDEX), Embedding(config, tp_group, cp_group))
        for i in self.layer_indices:
            kind = layer_kind(i, L)
            if kind == "embedding" and not self.tied:
                self.add_module(str(i), Embedding(config, tp_group, cp_group))
            elif kind == "block":
                self.add_module(str(i), ParallelTransformerLayer(config, tp_group, cp_group, block_number(i),
                                                                 ep_group, etp_group, cp_hierarchy))
            elif kind == "final_norm":
                self.add_module(str(i), build_norm(config, tp_group))
            elif kind == "lm_head" and not self.tied:
                self.add_module(str(i), LMHead(config, tp_group))
            elif kind == "mtp":
                self.add_module(str(i), MultiTokenPrediction(config, tp_group, ep_group, etp_group))
        initialize_parameters(self, config, self.tp, self.tp_rank)

    @property
    def mtp(self) -> Optional[MultiTokenPrediction]:
        """The multi-token prediction depths this stage holds (with the output head), or None."""
        return self._modules.get(str(mtp_index(self.config.num_layers)))

    def pipeline_shared_embedding(self) -> Optional[nn.Module]:
        """The embedding the first and the last pipeline stage both hold (each its own copy, kept equal): the
        tied one, or with multi-token prediction the untied one; None where this stage holds no such copy."""
        if self.tied:
            return self.tied_modules["embed"] if hasattr(self, "tied_modules") else None
        return self._modules.get(str(EMBEDDING_INDEX)) if self.config.mtp_num_layers else None

    @property
    def embedding(self) -> Embedding:
        return self.tied_modules["embed"] if self.tied else self._modules[str(EMBEDDING_INDEX)]

    def output_logits(self, hidden):
        """This TP rank's slice of the vocabulary logits: the tied word embedding or the untied head."""
        if self.tied:
            return self.embedding.lm_logits(hidden)
        return self._modules[str(lm_head_index(self.config.num_layers))](hidden)

    def output_losses(self, hidden, labels):
        """Per-token cross-entropy [b, s] of the output layer; padded vocabulary never counts. Fused by
        vocabulary chunks (`fused_output_loss`, --cross-entropy-loss-fusion, the default: no [tokens, vocab]
        logits), else the vocab-parallel cross-entropy of the whole logits."""
        if self.fused_output_loss:
            if self.tied:
                return self.embedding.lm_losses(hidden, labels)
            return self._modules[str(lm_head_index(self.config.num_layers))](hidden, labels)
        return vocab_parallel_cross_entropy(self.output_logits(hidden), labels, self.tp_group, self.config.vocab_size)

    def chunk_blocks(self, chunk: int):
        """The transformer layers of model chunk `chunk`, in order (run together: model/recompute.py)."""
        L = self.config.num_layers
        return [self._modules[str(i)] for i in self.chunks[chunk] if is_block_index(i, L)]

    @property
    def blocks(self):
        """This stage's transformer layers, in order."""
        return [b for c in range(len(self.chunks)) for b in self.chunk_blocks(c)]

    def forward(self, inputs, labels=None, loss_mask=None, chunk: int = 0, tokens=None):
        """Tokens [b, s] (first stage) or hidden [b, s, h] in; hidden, logits, or the mean loss out.
        `chunk`: which model chunk of an interleaved stage runs (0 for a plain stage). `tokens`: the input
        tokens on the stage of the output head, for multi-token prediction while training (first stage: the
        inputs)."""
        x = inputs
        L = self.config.num_layers
        blocks_done = False
        for i in self.chunks[chunk]:
            if i == EMBEDDING_INDEX:
                x = self.embedding(x)
            elif i == lm_head_index(L):
                if labels is None:
                    return self.output_logits(x)
                loss = self.loss(self.output_losses(x, labels), loss_mask)
                if self.mtp is not None and self.training and torch.is_grad_enabled():
                    tokens = inputs if tokens is None else tokens
                    if tokens.is_floating_point():
                        raise ValueError("multi-token prediction embeds the input tokens on the stage of the "
                                         "output head: pass them as forward's `tokens`")
                    positions = local_positions(tokens.shape[1], self.cp_group, tokens.device)
                    loss = loss + self.mtp.gradient_term(self, x, tokens, positions, labels, loss_mask)
                return loss
            elif layer_kind(i, L) == "final_norm":
                x = self._modules[str(i)](x)
            elif is_block_index(i, L) and not blocks_done:  # the chunk's first block runs them all
                x = run_layers(self.chunk_blocks(chunk), x, self.config)
                blocks_done = True
        return x  # (layer 0, the input cast, has nothing to do in this layout)

    def loss(self, losses, loss_mask=None):
        """The mean of per-token losses (weighted by loss_mask).

        Context-parallel (Megatron's rule): CP x this rank's loss sum / the CP group's token count, so
        that the gradient reduction's average over DP x CP ranks is the mean over every token (each
        rank holds s / CP tokens, so without a mask that is this rank's own mean)."""
        if loss_mask is None:
            return losses.mean()
        loss_mask = loss_mask.to(losses.dtype)
        if self.cp_group is None:
            return (losses * loss_mask).sum() / loss_mask.sum()
        count = loss_mask.sum().reshape(1)
        shm_comm.all_reduce(count, self.cp_group)
        return (losses * loss_mask).sum() * tp_world_size(self.cp_group) / count[0]


def _contiguous_runs(indices):
    runs = [[indices[0]]]
    for i in indices[1:]:
        if i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def reference_model(config: GPTConfig) -> GPTModel:
    """The single-process, full-weight model every parity test compares against."""
    return GPTModel(config, tp_group=None)

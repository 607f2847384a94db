"""Multi-token prediction (DeepSeek-V3's MTP) as Megatron-Core 0.16.1 computes it (its
transformer/multi_token_prediction.py and GPTModel's post-processing), on the stage holding the output head.

For depth k = 1..N, with tokens, positions, labels and the loss mask each shifted left by k (the last k
positions zero: Megatron-Core's roll_tensor), and h_0 the main model's output after its final norm:

    h_k    = final_layernorm_k(block_k(eh_proj_k([enorm_k(embed(tokens_k)), hnorm_k(h_{k-1})])))
    loss_k = the masked mean cross-entropy of the shared output layer on h_k against labels_k

The embedding and output layer are the model's own (a pipeline's last stage holds its copy of the tied
embedding for that, or of an untied one: GPTModel, pipeline/gpt_stage.py); block_k has the last block's
structure (Megatron-Core builds it from the decoder's last layer spec): where that block is an MoE layer, so is
block_k, with the same router, experts over the same expert-parallel groups, shared expert and expert bias (its
tokens per expert join the bias update as every router's do, moe/expert_bias.py; its aux losses reach the
gradient through the router as a block's do, and the log averages them over the blocks' and the depths' MoE
layers, as Megatron-Core's track_moe_metrics counts mtp_num_layers). The step's objective adds
mtp_loss_scaling_factor x mean_k loss_k to the language-model loss
(Megatron-Core's MTPLossAutoScaler: the value returned, and logged as the LM loss, is the main loss alone).
Tensor parallel as the model's other layers: eh_proj column-parallel, its output gathered, and with sequence
parallelism scattered back to this rank's tokens before the block. Each depth is one unit of ZeRO-3's
gathers, and is recomputed in backward under --recompute-granularity full.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..tensor_parallel import ColumnParallelLinear, scatter_to_sequence_parallel_region
from ..tensor_parallel.random import checkpoint
from .config import GPTConfig
from .transformer import ParallelTransformerLayer, build_norm, sequence_parallel_active


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """`t` shifted one place left along its last dimension, the last place zero (Megatron-Core's roll_tensor)."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


class MultiTokenPredictionLayer(nn.Module):
    """One depth: the two norms, the projection of their concatenation, a block and its own final norm."""

    def __init__(self, config: GPTConfig, tp_group=None, ep_group=None, etp_group=None):
        super().__init__()
        h = config.hidden_size
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel_active(config, tp_group)
        self.enorm, self.hnorm = build_norm(config, tp_group), build_norm(config, tp_group)
        self.eh_proj = ColumnParallelLinear(2 * h, h, tp_group, bias=False, gather_output=True,
                                            params_dtype=config.params_dtype, sequence_parallel=self.sequence_parallel)
        self.transformer_layer = ParallelTransformerLayer(config, tp_group, block=config.num_layers - 1,
                                                          ep_group=ep_group, etp_group=etp_group)
        self.final_layernorm = build_norm(config, tp_group)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return self.final_layernorm(self.transformer_layer(x))


class MultiTokenPrediction(nn.ModuleList):
    """The N depths (a container: ZeRO-3 gathers each depth around its own forward). `loss_sums` holds the
    depths' losses of the micro-batches run since the log last took them (detached, on the device)."""

    def __init__(self, config: GPTConfig, tp_group=None, ep_group=None, etp_group=None):
        super().__init__([MultiTokenPredictionLayer(config, tp_group, ep_group, etp_group)
                          for _ in range(config.mtp_num_layers)])
        self.scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        self.recompute = config.recompute_granularity == "full"
        self.loss_sums: Optional[torch.Tensor] = None

    def gradient_term(self, model, hidden, tokens, positions, labels, loss_mask) -> torch.Tensor:
        """0 in value, with the gradient of scale x sum_k loss_k: added to the main loss, the step trains on
        both while the loss it returns stays the language model's."""
        mask = torch.ones_like(labels, dtype=hidden.dtype) if loss_mask is None else loss_mask.to(hidden.dtype)
        losses = []
        for layer in self:
            tokens, positions, labels, mask = roll_left(tokens), roll_left(positions), roll_left(labels), roll_left(mask)
            embedded = model.embedding(tokens, positions)
            hidden = checkpoint(layer, hidden, embedded) if self.recompute else layer(hidden, embedded)
            losses.append(model.loss(model.output_losses(hidden, labels), mask))
        losses = torch.stack(losses)
        detached = losses.detach()
        self.loss_sums = detached if self.loss_sums is None else self.loss_sums + detached
        total = self.scale * losses.sum()
        return total - total.detach()

    def take_loss_sums(self) -> Optional[torch.Tensor]:
        """The depths' loss sums recorded since the last call (None: no training forward ran), reset."""
        sums, self.loss_sums = self.loss_sums, None
        return sums

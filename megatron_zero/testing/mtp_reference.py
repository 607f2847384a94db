"""Megatron-Core 0.16.1's multi-token prediction on the CPU, with our model's weights: its GPTModel with a
MultiTokenPredictionBlock (the local layer spec) against our reference model, one training forward and backward.

    run_ranks(mtp_against_mcore, 1, "llama", 2)  -> (our loss, their loss, {our name: (our grad, their grad)},
                                                   our per-depth MTP losses, theirs from its logging tracker)

Megatron-Core's side runs with mcore_peer.py's CUDA shims in the rank's own process. Its loss is the mean of
the per-token LM loss GPTModel returns, whose backward also carries the MTP losses' (MTPLossAutoScaler at
scale 1: one micro-batch); ours is the model's mean loss. Names: ours -> the local spec's (its norms are
modules of their own, unlike the Transformer-Engine names of checkpoint/interop/mcore_names.py).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..model.gpt import reference_model
from ..model.layer_indices import block_number, final_norm_index, is_block_index, mtp_index
from ..model.params import MTP_LAYER_PREFIX, parse_mtp_suffix, position_embeddings_name, word_embeddings_name
from . import mcore_parity, mcore_peer

LOCAL_BLOCK = {"input_layernorm.": "input_layernorm.", "self_attention.query_key_value.": "self_attention.linear_qkv.",
               "self_attention.dense.": "self_attention.linear_proj.", "post_attention_layernorm.": "pre_mlp_layernorm.",
               "mlp.dense_h_to_4h.": "mlp.linear_fc1.", "mlp.dense_4h_to_h.": "mlp.linear_fc2."}


def _block_key(suffix: str) -> str:
    for ours, theirs in LOCAL_BLOCK.items():
        if suffix.startswith(ours):
            return theirs + suffix[len(ours):]
    raise KeyError(suffix)


def local_spec_key(name: str, config) -> str:
    """Megatron-Core's state-dict key (GPTModel, local spec, with MTP) of our parameter `name`."""
    L = config.num_layers
    if name == word_embeddings_name(config):
        return "embedding.word_embeddings.weight"
    if name == position_embeddings_name(config):
        return "embedding.position_embeddings.weight"
    if name.endswith("lm_head.weight"):
        return "output_layer.weight"
    index, _, suffix = name.partition(".")
    i = int(index)
    if is_block_index(i, L):
        return f"decoder.layers.{block_number(i)}.{_block_key(suffix)}"
    if i == final_norm_index(L):
        return f"decoder.final_layernorm.{suffix}"
    if i == mtp_index(L):
        depth, local = parse_mtp_suffix(suffix)
        if local.startswith(MTP_LAYER_PREFIX):
            local = "transformer_layer." + _block_key(local[len(MTP_LAYER_PREFIX):])
        return f"mtp.layers.{depth}.{local}"
    raise KeyError(name)


def _mcore_model(arch: str, mtp_num_layers: int):
    """mcore_peer.build's GPTModel, with `mtp_num_layers` depths of the local spec."""
    from megatron.core.models.gpt import gpt_model as mc_gpt
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    built = {}
    real = mc_gpt.GPTModel.__init__

    def with_mtp(self, config, spec, *args, **kwargs):
        config.mtp_num_layers = mtp_num_layers
        kwargs["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        built["spec"] = spec
        real(self, config, spec, *args, **kwargs)

    mc_gpt.GPTModel.__init__ = with_mtp
    try:
        model = mcore_peer.build(arch)
    finally:
        mc_gpt.GPTModel.__init__ = real
    assert isinstance(built["spec"], type(get_gpt_layer_local_spec()))
    return model


def mtp_against_mcore(arch: str, mtp_num_layers: int, factor: float = 0.1):
    """On one gloo rank (run_ranks): both models' loss, the MTP losses and every parameter's gradient."""
    mcore_peer._shim_cuda()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(1234)
    mc_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = replace(mcore_parity.config(arch), mtp_num_layers=mtp_num_layers, mtp_loss_scaling_factor=factor)
    ours = reference_model(config).train()
    theirs = _mcore_model(arch, mtp_num_layers).train()
    theirs.config.mtp_loss_scaling_factor = factor
    their_params = dict(theirs.named_parameters())
    keys = {name: local_spec_key(name, config) for name, _ in ours.named_parameters()}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            their_params[keys[name]].copy_(p)
    tokens, labels = mcore_peer.batch(0)
    loss = ours(tokens, labels=labels)
    loss.backward()
    their_loss = theirs(*mcore_peer._inputs(tokens), labels=labels).float().mean()
    their_loss.backward()
    grads = {name: (p.grad.clone(), their_params[keys[name]].grad.clone()) for name, p in ours.named_parameters()}
    their_mtp = MTPLossLoggingHelper.tracker["values"].clone()
    return float(loss), float(their_loss), grads, ours.mtp.take_loss_sums(), their_mtp

"""Mixture of experts (Megatron-Core's MoE, DeepSpeed-MoE's parameter names): the top-k router and its
load-balancing losses (router.py), token permutation and the expert-parallel all-to-all (dispatch.py),
the MoE layer that replaces a block's MLP (layer.py)."""
from .layer import MoELayer
from .router import aux_losses, reset_aux_losses, set_aux_loss_scale

__all__ = ["MoELayer", "aux_losses", "reset_aux_losses", "set_aux_loss_scale"]

"""Mixture of experts (Megatron-Core's MoE, DeepSpeed-MoE's parameter names): the top-k router and its
load-balancing losses (router.py), token permutation and the expert-parallel all-to-all (dispatch.py),
the MoE layer that replaces a block's MLP (layer.py). The names below load on first use (the flags' checks
import moe/expert_counts.py before torch is loaded)."""
from ..lazy_exports import lazy_exports

_EXPORTS = {"MoELayer": ".layer", "aux_losses": ".router", "reset_aux_losses": ".router",
            "set_aux_loss_scale": ".router"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

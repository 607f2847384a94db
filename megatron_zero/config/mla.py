"""Multi-latent attention's flags as Megatron-LM spells them (docs/models.md), with YaRN's: MLAConfig's fields
reach GPTConfig by name (model/architecture.gpt_config), the model is model/mla.py."""
from __future__ import annotations

import argparse
from typing import Optional

from .errors import require
from .fields import add_section_flags, flag, flag_fields, flag_spelling, section

MLA = "multi-latent attention and YaRN (docs/models.md)"


@section(MLA)
class MLAConfig:
    """DeepSeek-V2/V3's attention (Megatron-Core's MLATransformerConfig names and defaults)."""
    multi_latent_attention: bool = flag("multi-latent attention: q and kv projected through low-rank latents, a "
                                        "rotary part of q and k apart (one k part shared by the heads)", False,
                                        action="store_true")
    q_lora_rank: Optional[int] = flag("the rank of q's latent (unset: q projected directly from the hidden state)",
                                      None)
    kv_lora_rank: int = flag("the rank of the kv latent", 32)
    qk_head_dim: int = flag("each head's q and k width without the rotary part", 128)
    qk_pos_emb_head_dim: int = flag("the rotary part of each head's q and k", 64)
    v_head_dim: int = flag("each head's v width", 128)
    rope_type: Optional[str] = flag("MLA's rotary embedding: yarn (the default with MLA) or rope", None,
                                    choices=["rope", "yarn"])
    rotary_scaling_factor: float = flag("YaRN's context extension factor (and, through --mscale-all-dim, the "
                                        "softmax scale's)", 1.0)
    original_max_position_embeddings: int = flag("YaRN: the context length the rotary frequencies were made for",
                                                 4096)
    beta_fast: float = flag("YaRN: rotary dimensions turning more than this often over the original context keep "
                            "their frequency", 32.0)
    beta_slow: float = flag("YaRN: those turning fewer times are interpolated by --rotary-scaling-factor", 1.0)
    mscale: float = flag("YaRN's concentration: cos and sin times (0.1 mscale ln(factor) + 1) / (the same of "
                         "--mscale-all-dim)", 1.0)
    mscale_all_dim: float = flag("YaRN: the softmax scale times (0.1 mscale_all_dim ln(factor) + 1)^2", 0.0)


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, MLAConfig)


def check(args, given: set) -> None:
    """MLA's flags with MLA only, their sizes, and what MLA does not run with; --rope-type's default."""
    stray = [flag_spelling(MLAConfig, n) for n in flag_fields(MLAConfig)
             if n != "multi_latent_attention" and n in given and n != "rope_type"]
    if not args.multi_latent_attention:
        require(not stray and args.rope_type in (None, "rope"),
                f"{', '.join(stray) or '--rope-type yarn'} set multi-latent attention, which this model does "
                "not use; add --multi-latent-attention or drop them")
        args.rope_type = args.rope_type or "rope"
        return
    args.rope_type = args.rope_type or "yarn"
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        require(getattr(args, name) >= 1, f"{flag_spelling(MLAConfig, name)} {getattr(args, name)} must be at least 1")
    require(args.q_lora_rank is None or args.q_lora_rank >= 1,
            f"--q-lora-rank {args.q_lora_rank} must be at least 1 (or unset: no q latent)")
    require(args.qk_pos_emb_head_dim % 2 == 0, f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even: "
            "RoPE rotates pairs")
    require(args.rotary_scaling_factor > 0, f"--rotary-scaling-factor {args.rotary_scaling_factor} must be positive")
    q_head_dim = args.qk_head_dim + args.qk_pos_emb_head_dim
    require(args.context_parallel_size == 1 or args.cp_comm_type == "a2a" or args.v_head_dim <= q_head_dim,
            f"--v-head-dim {args.v_head_dim} above --qk-head-dim + --qk-pos-emb-head-dim {q_head_dim} with "
            f"--cp-comm-type {args.cp_comm_type}: the exchange moves v padded to k's width; use --cp-comm-type a2a")
    require(args.attention_backend != "flash" or args.v_head_dim <= q_head_dim,
            f"--v-head-dim {args.v_head_dim} above --qk-head-dim + --qk-pos-emb-head-dim {q_head_dim} with "
            "--attention-backend flash: torch's flash kernels take v padded to q's width; use another backend")
    require(not (getattr(args, "qk_clip", False) or getattr(args, "log_max_attention_logit", False)),
            "--qk-clip and --log-max-attention-logit scale the fused QKV projection's heads, which "
            "--multi-latent-attention replaces; drop them")

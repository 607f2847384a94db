"""The checkpoint format's names and versions, in one place: the DeepSpeed / Megatron-DeepSpeed release
whose layout we write, the pointer files of a save directory, each file's name (and the patterns that
recognise them in a directory DeepSpeed or we wrote), and the readers of what a model-states header records
(its args, TP / PP sizes, and each DP rank's RNG state), which every loader (same layout, reshaped, universal) shares.

    <save>/latest, latest_checkpointed_iteration.txt   the committed tag (global_step<N>) and iteration
    <save>/latest_universal                            the universal checkpoint's directory name
    <tag>/mp_rank_{mp:02d}_model_states.pt, zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt, ...

The standalone zero_to_fp32.py copied into each checkpoint keeps its own copy of these few facts: it must
run where megatron_zero is not installed.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

from ..zero.checkpoint_state import DS_VERSION  # noqa: F401  (`ds_version`, written by the ZeRO optimizer state too)

CHECKPOINT_VERSION = 3.0           # Megatron's `checkpoint_version`
UNIVERSAL_CHECKPOINT_VERSION = 0.2  # `universal_checkpoint_info.universal_checkpoint_version`
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
# its pattern lists (regexes over parameter names), Megatron-DeepSpeed's keys
VOCAB_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PATTERNS = "pipeline_replicated_parameter_patterns"
TP_REPLICATED_PATTERNS = "tp_replicated_parameter_patterns"
ROW_PARALLEL_PATTERNS = "parameter_with_row_parallelism_patterns"
TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
SUB_PARAMS_PATTERNS = "parameter_with_2_sub_params_cat_dim_0"
# a universal checkpoint's zero/<name>/<key>.pt files, and the sub-parameter count DeepSpeed records in them
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
SUB_PARAMS_KEY = "param_n_sub_params"

LATEST = "latest"
LATEST_ITERATION = "latest_checkpointed_iteration.txt"
LATEST_UNIVERSAL = "latest_universal"

ZERO_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def model_states_name(mp_rank: int, zero_stage: int, dp_rank: int = 0) -> str:
    if zero_stage == 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(dp_rank: int, mp_rank: int, bf16: bool = False) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def layer_file_name(layer_index: int, tp_rank: int) -> str:
    return f"layer_{layer_index:02d}-model_{tp_rank:02d}-model_states.pt"


def expert_file_name(moe_layer: int, expert: int, mp_rank: int) -> str:
    """DeepSpeed-MoE's per-expert file: `moe_layer` counts the model's MoE layers from 0, `expert` is global."""
    return f"layer_{moe_layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def header_args(head: dict) -> dict:
    """The Megatron args a model-states header records (a Namespace or a dict), as a dict; {} if none."""
    args = head.get("args")
    if args is None:
        return {}
    return dict(args) if isinstance(args, dict) else dict(vars(args))


def header_tp_pp(head: dict) -> Tuple[Optional[int], Optional[int]]:
    """(TP, PP) a header records: DeepSpeed's `checkpoint_parallel_dimensions` where present, else the
    saved args; None for a size it does not record."""
    dims = head.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict) and (dims.get("tp_degree") or dims.get("pp_degree")):
        tp, pp = dims.get("tp_degree"), dims.get("pp_degree")
    else:
        args = header_args(head)
        tp, pp = args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size")
    return (int(tp) if tp else None), (int(pp) if pp else None)


def rank_rng_state(saved, dp_rank: int) -> Optional[dict]:
    """This DP rank's RNG state from a model-states file's `rng_state`: Megatron's per-DP-rank list
    (DP rank 0's where the saving run had fewer DP ranks: every replica was seeded alike), or one dict."""
    if isinstance(saved, (list, tuple)):
        return (saved[dp_rank] if dp_rank < len(saved) else saved[0]) if saved else None
    return saved if isinstance(saved, dict) else None

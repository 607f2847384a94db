"""Reading a DeepSpeed-style JSON config into Megatron's flags.

The JSON may carry the batch sizes, the ZeRO stage and offload, precision,
gradient clipping and the AdamW hyper-parameters. A value the JSON sets wins
over a flag's default; a flag given on the command line with a different
value is refused, naming both, because silently preferring one would train a
different model from what one of them says.
"""
from __future__ import annotations

import json


class DeepSpeedConfigError(ValueError):
    """The JSON config is unreadable or disagrees with a flag (one sentence)."""


# (JSON path, args destination, flag name)
_MAPPING = [
    (("train_micro_batch_size_per_gpu",), "micro_batch_size", "--micro-batch-size"),
    (("train_batch_size",), "global_batch_size", "--global-batch-size"),
    (("gradient_clipping",), "clip_grad", "--clip-grad"),
    (("zero_optimization", "stage"), "zero_stage", "--zero-stage"),
    (("zero_optimization", "stage3_param_persistence_threshold"), "zero_param_persistence_threshold",
     "--zero-param-persistence-threshold"),
    (("optimizer", "params", "lr"), "lr", "--lr"),
    (("optimizer", "params", "eps"), "adam_eps", "--adam-eps"),
    (("optimizer", "params", "weight_decay"), "weight_decay", "--weight-decay"),
    (("fp16", "enabled"), "fp16", "--fp16"),
    (("bf16", "enabled"), "bf16", "--bf16"),
    (("fp16", "loss_scale_window"), "loss_scale_window", "--loss-scale-window"),
]

# ZeRO++ (zero/stage3_zeropp.py)
_MAPPING += [
    (("zero_optimization", "zero_quantized_weights"), "zero_quantized_weights", "--zero-quantized-weights"),
    (("zero_optimization", "zero_quantized_gradients"), "zero_quantized_gradients", "--zero-quantized-gradients"),
    (("zero_optimization", "zero_hpz_partition_size"), "zero_hpz_partition_size", "--zero-hpz-partition-size"),
]


def _lookup(config: dict, path):
    node = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _set(args, dest, flag, value, explicit, path, source):
    current = getattr(args, dest)
    if dest in explicit and current != value:
        raise DeepSpeedConfigError(
            f"{flag} {current} disagrees with {'.'.join(path)}={value} in {source}; give one or make them equal")
    setattr(args, dest, value)


def apply_deepspeed_config(args, path: str, explicit: set = frozenset()):
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as err:
        raise DeepSpeedConfigError(f"--deepspeed-config {path} cannot be read: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(
            f"--deepspeed-config {path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        ) from None
    if not isinstance(config, dict):
        raise DeepSpeedConfigError(f"--deepspeed-config {path} must hold a JSON object")
    for json_path, dest, flag in _MAPPING:
        value = _lookup(config, json_path)
        if value is not None:
            _set(args, dest, flag, value, explicit, json_path, path)
    betas = _lookup(config, ("optimizer", "params", "betas"))
    if betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2):
            raise DeepSpeedConfigError(f"optimizer.params.betas in {path} must be a list of two numbers")
        _set(args, "adam_beta1", "--adam-beta1", betas[0], explicit, ("optimizer", "params", "betas[0]"), path)
        _set(args, "adam_beta2", "--adam-beta2", betas[1], explicit, ("optimizer", "params", "betas[1]"), path)
    power = _lookup(config, ("fp16", "initial_scale_power"))
    if power is not None:
        args.initial_loss_scale = 2.0 ** power
    static = _lookup(config, ("fp16", "loss_scale"))
    if static:  # DeepSpeed: 0 means dynamic
        args.loss_scale = float(static)
    offload = _lookup(config, ("zero_optimization", "offload_optimizer", "device"))
    if offload not in (None, "none"):
        if offload not in ("cpu", "nvme"):
            raise DeepSpeedConfigError(
                f"zero_optimization.offload_optimizer.device={offload!r} in {path} must be cpu, nvme or none")
        args.offload = offload
        if offload == "nvme":
            nvme = _lookup(config, ("zero_optimization", "offload_optimizer", "nvme_path"))
            if not nvme:
                raise DeepSpeedConfigError(
                    f"zero_optimization.offload_optimizer.device is nvme in {path} but nvme_path is missing")
            args.zero_nvme_offload_path = nvme
    grad_accum = _lookup(config, ("gradient_accumulation_steps",))
    if grad_accum is not None and args.micro_batch_size and args.global_batch_size:
        dp = args.data_parallel_size
        if args.micro_batch_size * grad_accum * dp != args.global_batch_size:
            raise DeepSpeedConfigError(
                f"train_batch_size {args.global_batch_size} != train_micro_batch_size_per_gpu "
                f"{args.micro_batch_size} x gradient_accumulation_steps {grad_accum} x data-parallel size {dp} "
                f"in {path}")
    return config

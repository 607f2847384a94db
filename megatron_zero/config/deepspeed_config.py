"""Reading a DeepSpeed-style JSON config into Megatron's flags.

Every key DeepSpeed documents that has a meaning here is honoured; every other key
is refused, all of them listed in one sentence (a typo such as `zero_optimisation`,
`optimizer.type: SGD`, `zero_optimization.offload_param`, a tuning knob of
DeepSpeed's own communication such as `overlap_comm`).

    key (DeepSpeed's name)                        here
    train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
                                                  DeepSpeed's rule: train = micro x GA x DP, any
                                                  two give the third -> --global-batch-size,
                                                  --micro-batch-size
    gradient_clipping, steps_per_print            --clip-grad, --log-interval
    fp16.{enabled, loss_scale (0 = dynamic), initial_scale_power, loss_scale_window,
          hysteresis, min_loss_scale}            --fp16 and the loss-scaler flags
    bf16.enabled (alias bfloat16.enabled)         --bf16
    zero_optimization.{stage, stage3_param_persistence_threshold, reduce_bucket_size,
          offload_optimizer.{device, nvme_path}}  --zero-stage, ..., --ddp-bucket-size, optimizer offload
    optimizer.type Adam | AdamW (any case), params.{lr, betas, eps, weight_decay, torch_adam,
          adam_w_mode (true), bias_correction (true), amsgrad (false)}
                                                  AdamW (DeepSpeed's Adam is AdamW unless
                                                  adam_w_mode is false); torch_adam only picks
                                                  DeepSpeed's implementation
    scheduler.type WarmupLR | WarmupDecayLR | WarmupCosineLR and its params
                                                  lr_schedule.DeepSpeedWarmupSchedule
    wall_clock_breakdown, fp16.auto_cast, fp16.consecutive_hysteresis
                                                  accepted when false (what happens here)
    data_types.grad_accum_dtype                   accepted when "fp32" (accumulation is fp32 here always)
    prescale_gradients                            true or false: gradients are summed in fp32 (or bf16,
                                                  whose range is fp32's) and divided once after the
                                                  reduction; dividing first, DeepSpeed's guard against fp16
                                                  overflow, would change only the rounding
    curriculum_learning                           accepted when enabled is false (its other keys then mean
                                                  nothing); enabled: refused (no seqlen curriculum here)

`"auto"` (as Accelerate and the HF Trainer write it) on a key read here means "from
the flags": the key is as if absent and the flag's value stands (scheduler params:
warmup_min_lr 0, warmup_max_lr --lr, warmup_num_steps --lr-warmup-iters,
total_num_steps --train-iters, as the HF integration fills them). On any other key
"auto" is refused like any other value. A value the JSON sets wins over a
flag's default; a flag given on the command line with a different value is
refused, naming both, because silently preferring one would train a different
model from what one of them says.
"""
from __future__ import annotations

import json

AUTO = "auto"
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class DeepSpeedConfigError(ValueError):
    """The JSON config is unreadable or disagrees with a flag (one sentence)."""


# Keys copied onto a flag: JSON path -> (args destination, flag name).
_FLAGS = {
    ("gradient_clipping",): ("clip_grad", "--clip-grad"),
    ("steps_per_print",): ("log_interval", "--log-interval"),
    ("zero_optimization", "stage"): ("zero_stage", "--zero-stage"),
    ("zero_optimization", "reduce_bucket_size"): ("ddp_bucket_size", "--ddp-bucket-size"),
    ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): ("save_16bit_model", "--save-16bit-model"),
    ("zero_optimization", "stage3_param_persistence_threshold"): ("zero_param_persistence_threshold",
                                                                  "--zero-param-persistence-threshold"),
    ("optimizer", "params", "lr"): ("lr", "--lr"),
    ("optimizer", "params", "eps"): ("adam_eps", "--adam-eps"),
    ("optimizer", "params", "weight_decay"): ("weight_decay", "--weight-decay"),
    ("fp16", "loss_scale_window"): ("loss_scale_window", "--loss-scale-window"),
    ("fp16", "hysteresis"): ("hysteresis", "--hysteresis"),
    ("fp16", "min_loss_scale"): ("min_loss_scale", "--min-loss-scale"),
}
# Keys read by the code below (not a plain copy onto one flag).
_READ = {("train_batch_size",), ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",),
         ("fp16", "enabled"), ("fp16", "loss_scale"), ("fp16", "initial_scale_power"), ("bf16", "enabled"),
         ("bfloat16", "enabled"), ("zero_optimization", "offload_optimizer", "device"),
         ("zero_optimization", "offload_optimizer", "nvme_path"), ("optimizer", "type"),
         ("optimizer", "params", "betas"), ("optimizer", "params", "torch_adam"), ("scheduler", "type")}
# Keys accepted only with the value that describes what happens here anyway.
_ONLY = {("wall_clock_breakdown",): False, ("fp16", "auto_cast"): False, ("data_types", "grad_accum_dtype"): "fp32",
         ("fp16", "consecutive_hysteresis"): False, ("optimizer", "params", "adam_w_mode"): True,
         ("optimizer", "params", "bias_correction"): True, ("optimizer", "params", "amsgrad"): False}
_SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}
# Megatron's schedule flags, which a JSON scheduler replaces.
_SCHEDULE_FLAGS = (("lr_decay_style", "--lr-decay-style"), ("lr_decay_iters", "--lr-decay-iters"),
                   ("min_lr", "--min-lr"))


def _leaves(node, path=()):
    """(path, value) of every leaf; a dict is a branch, anything else a leaf."""
    if isinstance(node, dict) and (not path or node):
        for key, value in node.items():
            yield from _leaves(value, path + (key,))
    else:
        yield path, node


# ZeRO++ (zero/stage3_zeropp.py)
_FLAGS.update({
    ("zero_optimization", "zero_quantized_weights"): ("zero_quantized_weights", "--zero-quantized-weights"),
    ("zero_optimization", "zero_quantized_gradients"): ("zero_quantized_gradients", "--zero-quantized-gradients"),
    ("zero_optimization", "zero_hpz_partition_size"): ("zero_hpz_partition_size", "--zero-hpz-partition-size"),
})


def _lookup(config: dict, path):
    """The value at `path`, None when absent or "auto"."""
    node = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return None if node == AUTO else node


def _dotted(path) -> str:
    return ".".join(path)


def _unsupported(config: dict) -> list:
    """Each key (with the reason) that has no meaning here, in the order of the file."""
    scheduler_type = config.get("scheduler", {}).get("type") if isinstance(config.get("scheduler"), dict) else None
    known_params = {("scheduler", "params", p) for p in _SCHEDULER_PARAMS.get(scheduler_type, ())}
    out = []
    curriculum = config.get("curriculum_learning")
    for path, value in _leaves(config):
        if path == ("prescale_gradients",) and isinstance(value, bool):
            continue
        if path[:1] == ("curriculum_learning",) and isinstance(curriculum, dict):
            if curriculum.get("enabled") is False:
                continue
            if path == ("curriculum_learning", "enabled"):
                out.append(f"curriculum_learning.enabled {json.dumps(value)} (a sequence-length curriculum is not "
                           "available in this build)")
            continue
        if path in _FLAGS or path in _READ or path in known_params:
            if path == ("optimizer", "type") and str(value).lower() not in ("adam", "adamw"):
                out.append(f"optimizer.type {value} (only Adam and AdamW)")
            if path == ("scheduler", "type") and value not in SCHEDULERS:
                out.append(f"scheduler.type {value} (only {', '.join(SCHEDULERS)})")
            continue
        if path in _ONLY:
            if value not in (_ONLY[path], AUTO):
                out.append(f"{_dotted(path)} {json.dumps(value)} (only {json.dumps(_ONLY[path])})")
            continue
        out.append(_dotted(path))
    return out


def _set(args, dest, flag, value, explicit, what, source):
    current = vars(args)[dest]
    if dest in explicit and current != value:
        raise DeepSpeedConfigError(
            f"{flag} {current} disagrees with {what}={value} in {source}; give one or make them equal")
    setattr(args, dest, value)


def _batch_sizes(args, config: dict, explicit: set, source: str):
    """DeepSpeed's batch arithmetic (runtime/config.py _set_batch_related_parameters) over DP ranks."""
    dp = args.data_parallel_size
    train = _lookup(config, ("train_batch_size",))
    micro = _lookup(config, ("train_micro_batch_size_per_gpu",))
    accum = _lookup(config, ("gradient_accumulation_steps",))
    if train is None and args.global_batch_size is not None and accum is None:
        train = args.global_batch_size
    if micro is None:
        micro = args.micro_batch_size
    for name, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", accum)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DeepSpeedConfigError(f"{name}={value!r} in {source} must be a positive integer")
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * dp:
            raise DeepSpeedConfigError(
                f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                f"{accum} x data-parallel size {dp} in {source}")
    elif train is not None and micro is not None:
        pass  # accumulation follows: train / (micro x DP)
    elif train is not None and accum is not None:
        micro = train // dp // accum
    elif micro is not None and accum is not None:
        train = micro * accum * dp
    elif train is not None:
        micro = train // dp
    elif micro is not None:
        train = micro * dp
    else:
        return
    _set(args, "micro_batch_size", "--micro-batch-size", micro, explicit, "train_micro_batch_size_per_gpu", source)
    _set(args, "global_batch_size", "--global-batch-size", train, explicit, "train_batch_size", source)


def _precision(args, config: dict, explicit: set, source: str):
    if "bf16" in config and "bfloat16" in config:
        raise DeepSpeedConfigError(f"{source} has both bf16 and its old name bfloat16; keep one")
    for key, dest, flag in (("fp16", "fp16", "--fp16"), ("bf16", "bf16", "--bf16"), ("bfloat16", "bf16", "--bf16")):
        enabled = _lookup(config, (key, "enabled"))
        if enabled is not None:
            _set(args, dest, flag, bool(enabled), explicit, f"{key}.enabled", source)
    power = _lookup(config, ("fp16", "initial_scale_power"))
    if power is not None:
        _set(args, "initial_loss_scale", "--initial-loss-scale", 2.0 ** power, explicit, "2**fp16.initial_scale_power",
             source)
    static = _lookup(config, ("fp16", "loss_scale"))
    if static:  # DeepSpeed: 0 means dynamic
        _set(args, "loss_scale", "--loss-scale", float(static), explicit, "fp16.loss_scale", source)


def _optimizer(args, config: dict, explicit: set, source: str):
    betas = _lookup(config, ("optimizer", "params", "betas"))
    if betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2):
            raise DeepSpeedConfigError(f"optimizer.params.betas in {source} must be a list of two numbers")
        _set(args, "adam_beta1", "--adam-beta1", betas[0], explicit, "optimizer.params.betas[0]", source)
        _set(args, "adam_beta2", "--adam-beta2", betas[1], explicit, "optimizer.params.betas[1]", source)
    offload = _lookup(config, ("zero_optimization", "offload_optimizer", "device"))
    if offload not in (None, "none"):
        if offload not in ("cpu", "nvme"):
            raise DeepSpeedConfigError(
                f"zero_optimization.offload_optimizer.device={offload!r} in {source} must be cpu, nvme or none")
        args.offload = offload
        if offload == "nvme":
            nvme = _lookup(config, ("zero_optimization", "offload_optimizer", "nvme_path"))
            if not nvme:
                raise DeepSpeedConfigError(
                    f"zero_optimization.offload_optimizer.device is nvme in {source} but nvme_path is missing")
            args.zero_nvme_offload_path = nvme


def _scheduler(args, config: dict, explicit: set, source: str):
    """scheduler -> args.deepspeed_scheduler {type, params}, "auto" params filled as Accelerate fills them."""
    kind = _lookup(config, ("scheduler", "type"))
    if kind is None:
        return
    raw = config["scheduler"].get("params", {}) or {}
    given = [flag for dest, flag in _SCHEDULE_FLAGS if dest in explicit]
    if "lr_warmup_iters" in explicit and raw.get("warmup_num_steps") != AUTO:
        given.append("--lr-warmup-iters")
    if given:
        raise DeepSpeedConfigError(f"{' and '.join(given)} and scheduler {kind} in {source} both describe the "
                                   "learning-rate schedule; give one")
    auto = {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr, "warmup_num_steps": args.lr_warmup_iters,
            "total_num_steps": AUTO}  # AUTO: --train-iters, known once --train-samples is converted
    params = {k: (auto.get(k) if v == AUTO else v) for k, v in raw.items()}
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in params:
        raise DeepSpeedConfigError(f"scheduler {kind} in {source} needs params.total_num_steps (or \"auto\": "
                                   "--train-iters)")
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise DeepSpeedConfigError(f"scheduler.params.warmup_type {params['warmup_type']!r} in {source} must be "
                                   "log or linear")
    steps = params.get("warmup_num_steps", 1000)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise DeepSpeedConfigError(f"scheduler.params.warmup_num_steps {steps!r} in {source} must be a positive "
                                   "integer")
    peak = params.get("warmup_max_lr", 0.001 if kind == "WarmupDecayLR" else None)
    if peak is not None:  # WarmupLR/WarmupDecayLR set the optimizer's lr to their peak
        _set(args, "lr", "--lr", float(peak), explicit, "scheduler.params.warmup_max_lr", source)
    args.deepspeed_scheduler = {"type": kind, "params": params}


def read_deepspeed_config(path: str) -> dict:
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
    return config


def apply_deepspeed_config(args, path: str, explicit: set = frozenset()):
    config = read_deepspeed_config(path)
    unsupported = _unsupported(config)
    if unsupported:
        raise DeepSpeedConfigError(f"--deepspeed-config {path} has keys megatron_zero does not honour: "
                                   f"{'; '.join(unsupported)}; remove them (see megatron_zero/config/deepspeed_config.py "
                                   "for the keys it reads)")
    for json_path, (dest, flag) in _FLAGS.items():
        value = _lookup(config, json_path)
        if value is not None:
            _set(args, dest, flag, value, explicit, _dotted(json_path), path)
    _batch_sizes(args, config, explicit, path)
    _precision(args, config, explicit, path)
    _optimizer(args, config, explicit, path)
    _scheduler(args, config, explicit, path)
    return config

"""Configuration: every flag of pretrain_gpt.py, its checks and the values derived from it, by area.

    flags (argparse: Megatron-LM's and Megatron-DeepSpeed's spellings and aliases)
      + the DeepSpeed JSON (deepspeed_config.py: fills the flags not given)
      -> validate(): each area's checks, once, in dependency order; derived values filled in
      -> the checked namespace -> from_args(): Config, the typed sections (frozen; derived values as fields)
           topology      ParallelConfig: build_parallel_state(**degrees()), layout() (topology.Layout: the
                         data-parallel size and every cross-degree rule; check_layout builds it first)
           model         GPTConfig, by model/architecture.gpt_config (the one args -> model mapping,
                         also for a checkpoint's saved args)
           optimizer     OptimizerConfig -> ZeroOptimizer (zero/build.py); the schedule
                         (lr_schedule.build_lr_schedule(Config))
           checkpoint    CheckpointConfig: save/resume (training.py); the resume check compares the saved args'
                         and the run's model/architecture.ModelSettings (checkpoint/compat.py)

Each area is a module whose typed section's fields declare its flags (`add_flags(parser)` generates them,
fields.py) and which owns their checks: model.py, recompute.py, mla.py, moe.py (with moe_deepspeed.py,
moe_router.py, moe_router_bias.py), mtp.py, parallel.py, optimizer.py, muon.py, training.py, data.py,
checkpointing.py, log.py, runtime.py. A feature's flags (compat.py, compat_noops.py, elastic.py, loss.py, fp8.py,
compile.py, rerun.py) plug in through arguments/__init__.py's FEATURES: the module's `add_flags(parser)` and a
`check(args)` that runs once the layout, model and run length are checked.

A refusal is one sentence (errors.ArgumentError) naming the flags, their values and what would be right.
Downstream code takes the checked values and does not check them again: the trainer gets the tree
(training.Trainer(cfg, state)) and hands each part the section it reads. The namespace ends at from_args; the
flat `args` Megatron-LM's checkpoints record are made back from the tree in one place (flat, saved_args).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable

from .batch_schedule import BatchScheduleError
from .deepspeed_config import DeepSpeedConfigError, apply_deepspeed_config
from ..model.shape_rules import ModelShapeError
from ..moe.expert_counts import ExpertCountError
from ..distributed.topology import TopologyError
from . import checkpointing, data, log, mla, model, moe, mtp, muon, optimizer, parallel, recompute, runtime, training
from .checkpointing import CheckpointConfig
from .compat import CompatConfig
from .compat_noops import CompatNoopsConfig
from .compile import CompileConfig
from .data import DataConfig
from .elastic import ElasticConfig
from .errors import ArgumentError
from .fields import computed_fields
from .fp8 import Fp8Config
from .log import LogConfig
from .loss import LossConfig
from .mla import MLAConfig
from .model import ModelConfig
from .moe import MoeConfig
from .moe_router_bias import MoERouterBiasConfig
from .mtp import MTPConfig
from .muon import MuonConfig
from .optimizer import OptimizerConfig
from .parallel import ParallelConfig
from .recompute import RecomputeConfig
from .rerun import RerunConfig
from .runtime import RuntimeConfig
from .training import TrainingConfig

# the areas in --help's order
AREAS = (model, recompute, mla, moe, mtp, parallel, optimizer, muon, training, data, checkpointing, log, runtime)


def add_flags(parser: argparse.ArgumentParser) -> None:
    for area in AREAS:
        area.add_flags(parser)


@dataclass(frozen=True)
class Config:
    """The typed sections of a checked run (fields.py: each section's fields declare its flags); the features'
    (FEATURES in arguments/__init__.py) after the core areas'."""
    model: ModelConfig
    moe: MoeConfig
    router_bias: MoERouterBiasConfig
    mla: MLAConfig
    mtp: MTPConfig
    recompute: RecomputeConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    muon: MuonConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    log: LogConfig
    runtime: RuntimeConfig
    compat: CompatConfig
    elastic: ElasticConfig
    loss: LossConfig
    fp8: Fp8Config
    compile: CompileConfig
    rerun: RerunConfig
    compat_noops: CompatNoopsConfig


SECTIONS = {"model": ModelConfig, "moe": MoeConfig, "router_bias": MoERouterBiasConfig, "mla": MLAConfig,
            "mtp": MTPConfig, "recompute": RecomputeConfig, "parallel": ParallelConfig, "optimizer": OptimizerConfig,
            "muon": MuonConfig, "training": TrainingConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
            "log": LogConfig, "runtime": RuntimeConfig, "compat": CompatConfig, "elastic": ElasticConfig,
            "loss": LossConfig, "fp8": Fp8Config, "compile": CompileConfig, "rerun": RerunConfig,
            "compat_noops": CompatNoopsConfig}


def from_args(args) -> Config:
    """The typed sections of a namespace `validate` has checked."""
    return Config(**{name: cls.from_args(args) for name, cls in SECTIONS.items()})


def flat(cfg: Config) -> dict:
    """Every field of the tree under its own name, in one flat mapping: Megatron-LM's `args`, made from the tree
    here alone (what a checkpoint records, `saved_args`; what the model mapping model/architecture.gpt_config and
    the resume check read, as they read a checkpoint's)."""
    return {f.name: getattr(part, f.name) for part in (getattr(cfg, name) for name in SECTIONS)
            for f in dataclasses.fields(part)}


def saved_args(cfg: Config) -> dict:
    """The `args` a checkpoint records (and wandb's run config): `flat(cfg)`'s plain values, but those computed
    from the others (a derived field's `value`: the checks never held them)."""
    computed = {name for section in SECTIONS.values() for name in computed_fields(section)}
    return plain_values({name: value for name, value in flat(cfg).items() if name not in computed})


def plain_values(values: dict) -> dict:
    """The entries of `values` a checkpoint's `args` keep: the JSON-able ones."""
    return {name: value for name, value in values.items() if isinstance(value, (int, float, str, bool, list, type(None)))}


def validate(args, world_size: int, given: set, feature_checks: Iterable[Callable] = ()) -> Config:
    """Check `args` (parsed flags) for `world_size` ranks, fill in the derived values and return the typed
    sections. `given`: the destinations set on the command line (they win over the DeepSpeed JSON). The errors
    of the rules other modules own (the JSON's, the batch schedule's, the layout's, the expert count's, the
    model shape's) become
    ArgumentError here, once."""
    try:
        _validate(args, world_size, given, feature_checks)
    except (DeepSpeedConfigError, BatchScheduleError, TopologyError, ExpertCountError, ModelShapeError) as err:
        raise ArgumentError(str(err)) from None
    return from_args(args)


def _validate(args, world_size: int, given: set, feature_checks: Iterable[Callable]) -> None:
    model.check_sizes(args)
    layout = parallel.check_layout(args, world_size, given)
    if args.deepspeed_config:
        apply_deepspeed_config(args, args.deepspeed_config, given)
    parallel.check_batch(args, layout)
    training.check_stop_rules(args)
    model.check(args, layout.tp)
    mla.check(args, given)
    moe.check(args, layout, given)
    parallel.check_pipeline(args, layout)
    recompute.check(args)
    model.check_recompute(args, layout.tp)
    mtp.check(args)
    parallel.check_context_parallel(args, layout.tp)
    model.check_positions(args)
    optimizer.check_precision(args)
    training.check_length(args)
    parallel.check_schedule_reachable(args)
    optimizer.check_lr(args)
    training.check_schedule(args)
    data.check(args)
    for check in feature_checks:
        check(args)
    checkpointing.check(args)
    training.check_evaluation(args)
    optimizer.check(args, layout.pp)
    muon.check(args, given)
    log.check(args)
    optimizer.check_decoupled_lr(args)
    runtime.check(args)
    checkpointing.check_load(args)

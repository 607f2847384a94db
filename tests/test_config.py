"""The configuration layer: each check in one place (the command line refuses with the very sentence of the
code that owns the rule), a feature's flags module plugs in with one entry, and the files stay small."""
import ast
import dataclasses
import functools
import os
import typing
from pathlib import Path

import pytest

import megatron_zero
from megatron_zero import arguments, config
from megatron_zero.config.fields import derived, flag, flag_fields, section
from megatron_zero.config.errors import require
from megatron_zero.moe.expert_counts import check_expert_counts
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.distributed.topology import Layout, TopologyError

PACKAGE = Path(megatron_zero.__file__).parent


def _sentence(error_type, call):
    with pytest.raises(error_type) as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("changes,world,owner", [
    (dict(tensor_model_parallel_size=4), 6, lambda: Layout.from_world(6, 4, 1, 1)),
    (dict(context_parallel_size=3), 4, lambda: Layout.from_world(4, 1, 1, 3)),
    (dict(num_experts=4, context_parallel_size=2, expert_model_parallel_size=4), 2,
     lambda: Layout(dp=1, cp=2).check_expert_parallel(4)),
    (dict(num_experts=4, expert_model_parallel_size=4), 2, lambda: Layout(dp=2).check_expert_parallel(4)),
    (dict(num_experts=4, tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
          expert_tensor_parallel_size=1), 4, lambda: Layout(tp=2, dp=1, cp=2).check_expert_parallel(1, 1)),
    (dict(num_experts=4, tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1,
          expert_model_parallel_size=4), 2, lambda: Layout(tp=2, dp=1).check_expert_parallel(4, 1)),
])
def test_layout_rules_refused_in_the_topologys_words(changes, world, owner, capsys):
    """The world's divisibility and the expert groups' rules live in topology.Layout; the flags say the same."""
    sentence = _sentence(TopologyError, owner)
    assert refused(with_flags(BASE, **changes), world, capsys).strip() == f"pretrain_gpt.py: error: {sentence}"


@pytest.mark.parametrize("changes,counts", [
    (dict(num_experts=3, expert_model_parallel_size=2), (3, 2, 2)),
    (dict(num_experts=4, moe_router_topk=5), (4, 5, 1)),
])
def test_expert_count_refused_in_one_sentence_everywhere(changes, counts, capsys):
    """The flags ask moe/expert_counts.py, from one place (config/moe.py): GPTConfig and the MoE layers trust the
    checked count."""
    experts, topk, ep = counts
    sentence = _sentence(ValueError, lambda: check_expert_counts(experts, topk, ep))
    assert refused(with_flags(BASE, **changes), 2, capsys).strip() == f"pretrain_gpt.py: error: {sentence}"
    assert [module for module, name, _ in _package_calls() if name == "check_expert_counts"] == ["config/moe.py"]


@functools.lru_cache(maxsize=None)
def _package_calls() -> tuple:
    """(module, function name, first argument's name) of each call of a bare name in the package."""
    return tuple((path.relative_to(PACKAGE).as_posix(), node.func.id, getattr(node.args[0], "id", None)
                  if node.args else None)
                 for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name))


def _feature_flags(parser):
    parser.add_argument_group("a feature").add_argument("--feature-width", type=int, default=3,
                                                        help="the feature's width")


def _check_feature(args):
    require(args.feature_width <= args.hidden_size,
            f"--feature-width {args.feature_width} exceeds --hidden-size {args.hidden_size}")
    args.feature_share = args.feature_width / args.hidden_size


def test_a_features_flags_module_plugs_in(monkeypatch, capsys):
    """One FEATURES entry: its flags join the parser and --help, its check runs on the checked values."""
    monkeypatch.setattr(arguments, "FEATURES", arguments.FEATURES + ((_feature_flags, _check_feature),))
    assert "the feature's width (default: 3)" in " ".join(arguments.build_parser().format_help().split())
    assert arguments.parse_args(with_flags(BASE, feature_width=16)).feature_share == 0.25
    assert "--feature-width 65 exceeds --hidden-size 64" in refused(with_flags(BASE, feature_width=65), 1, capsys)


def test_no_file_of_the_package_over_500_lines():
    root = os.path.dirname(megatron_zero.__file__)
    sizes = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(directory, name)) as f:
                    sizes[os.path.relpath(os.path.join(directory, name), root)] = sum(1 for _ in f)
    assert sizes["arguments/__init__.py"] < 300
    assert not {name: n for name, n in sizes.items() if n > 500}


def _matches(value, annotation) -> bool:
    """`value` is of the field's annotated type (Optional, List and object read as typing means them)."""
    origin, inner = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is object:
        return True
    if origin is typing.Union:
        return any(_matches(value, a) for a in inner)
    if origin in (list, tuple):
        return isinstance(value, origin) and all(_matches(v, inner[0]) for v in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, annotation)


def test_sections_built_from_the_flags_are_typed_and_carry_the_derived_values():
    """The checked flags become frozen sections whose every field has its annotated type; the derived sizes
    (data-parallel size, micro-batches per step, the partition's counts, the dtype, offload) are fields."""
    argv = with_flags(BASE, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, pipeline_partition="1,3",
                      bf16=True, cpu_optimizer=True, zero_stage=2, save="/tmp/ckpt", save_interval=5)
    args = arguments.parse_command_line(argv)
    sections = config.validate(args, 8, arguments.explicit_flags(args), [c for _, c in arguments.FEATURES if c])
    assert config.from_args(arguments.parse_args(argv, world_size=8)) == sections
    par, opt, ckpt = sections.parallel, sections.optimizer, sections.checkpoint
    assert isinstance(par, config.ParallelConfig) and isinstance(opt, config.OptimizerConfig)
    assert (par.world_size, par.data_parallel_size, par.num_micro_batches) == (8, 2, 4)
    assert par.pipeline_partition == [1, 3] and par.virtual_pipeline_model_parallel_size == 1
    assert par.degrees() == dict(tp=2, pp=2, cp=1, ep=1, etp=2, cp_a2a=0)
    assert par.layout().dp == 2
    assert (opt.params_dtype, opt.offload, opt.zero_stage, opt.overlap_param_gather) == ("bf16", "cpu", 2, False)
    assert opt.loss_scaler()["dynamic"] and (ckpt.save, ckpt.save_interval, ckpt.verify_checkpoint) == ("/tmp/ckpt", 5, True)
    assert (sections.training.train_iters, sections.training.lr_decay_iters) == (10, 10)
    assert sections.data.tokenizer_type == "SentencePieceTokenizer" and sections.runtime.device == "auto"
    for name, cls in config.SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(sections, name), f.name)
            assert _matches(value, hints[f.name]), (cls.__name__, f.name, value, hints[f.name])
    with pytest.raises(dataclasses.FrozenInstanceError):
        par.tensor_model_parallel_size = 4


def test_each_flag_is_declared_by_its_field_once():
    """The parser's flag of every section field has the field's destination and default, in one section."""
    parser = arguments.build_parser()
    dests = {action.dest for action in parser._actions}
    seen = {}
    for cls in config.SECTIONS.values():
        for name in flag_fields(cls):
            assert name in dests and name not in seen, (cls.__name__, name, seen.get(name))
            seen[name] = cls.__name__
            field = {f.name: f for f in dataclasses.fields(cls)}[name]
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            assert parser.get_default(name) == default, name
    parsed = parser.parse_args(BASE + ["--zero-stage", "2", "--no-cuda", "--no-check-for-nan-in-loss-and-grad"])
    assert (parsed.zero_stage, parsed.device, parsed.check_for_nan_in_loss_and_grad) == (2, "cpu", False)


def test_a_field_without_a_flag_or_help_is_refused():
    with pytest.raises(TypeError, match="Bare.width is neither a flag"):
        @section("bare")
        class Bare:
            width: int = 3
    with pytest.raises(TypeError, match="Quiet.width's flag has no help"):
        @section("quiet")
        class Quiet:
            width: int = flag(" ", 3)

    @section("fine")
    class Fine:
        width: int = flag("the width", 3)
        twice: int = derived("twice the width", value=lambda args: 2 * args.width)

    assert Fine.from_args(type("Args", (), {"width": 4})) == Fine(width=4, twice=8)


def test_the_resume_check_compares_typed_model_settings():
    """A checkpoint's recorded args (a dict, in another writer's spelling) and the run's flags become the same
    typed ModelSettings where they describe the same model, and differ in the field where they do not."""
    from megatron_zero.model.architecture import ModelSettings

    here = ModelSettings.from_args(arguments.parse_args(with_flags(BASE, use_rotary_position_embeddings=True)))
    recorded = {**arguments.args_to_dict(arguments.parse_args(BASE)), "position_embedding_type": None,
                "use_rotary_position_embeddings": True, "add_position_embedding": False, "norm_epsilon": 1e-5,
                "layernorm_epsilon": None}  # Megatron-DeepSpeed's spelling of a RoPE model
    assert ModelSettings.from_args(recorded) == here and here.position_embedding_type == "rope"
    wider = ModelSettings.from_args({**recorded, "hidden_size": 128})
    assert [f.name for f in dataclasses.fields(here) if getattr(here, f.name) != getattr(wider, f.name)] == \
        ["hidden_size"]


def test_the_model_flags_defaults_are_gptconfigs():
    """A model flag left out means GPTConfig's default (the flags read it from there), Megatron-DeepSpeed's
    --moe-min-capacity 4 included; FP8's unset recipe is Float8Settings' default."""
    from megatron_zero.fp8.settings import Float8Settings
    from megatron_zero.model.config import GPTConfig

    parser = arguments.build_parser()
    dests = {action.dest for action in parser._actions}
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.default is not dataclasses.MISSING}
    resolved = {"rope_type"}  # unset: yarn with --multi-latent-attention, else rope (config/mla.py), as Megatron-LM
    differ = {name: (parser.get_default(name), value) for name, value in defaults.items()
              if name in dests and name not in resolved and parser.get_default(name) != value}
    assert not differ and parser.get_default("moe_min_capacity") == 4
    fp8 = arguments.parse_args(with_flags(BASE, fp8_format="hybrid", fp8_emulate=True))
    assert Float8Settings.from_args(fp8).recipe == Float8Settings().recipe == "delayed"


_MODEL = dict(vocab_size=128, hidden_size=64, num_layers=4, num_attention_heads=4, seq_length=32,
              max_position_embeddings=32)


@pytest.mark.parametrize("changes,tp,model", [
    (dict(tensor_model_parallel_size=3), 3, {}),
    (dict(hidden_size=66), 1, dict(hidden_size=66)),
    (dict(ffn_hidden_size=129, tensor_model_parallel_size=2), 2, dict(ffn_hidden_size=129)),
    (dict(num_query_groups=3), 1, dict(num_query_groups=3)),
    (dict(num_query_groups=6, num_attention_heads=12, hidden_size=96, tensor_model_parallel_size=4), 4,
     dict(num_query_groups=6, num_attention_heads=12, hidden_size=96)),
    (dict(hidden_size=12, num_query_groups=1, tensor_model_parallel_size=4), 4, dict(hidden_size=12, num_query_groups=1)),
    (dict(rotary_percent=1.5), 1, dict(rotary_percent=1.5)),
    (dict(position_embedding_type="rope", rotary_percent=0.1), 1, dict(position_embedding_type="rope",
                                                                     rotary_percent=0.1)),
    (dict(max_position_embeddings=16), 1, dict(max_position_embeddings=16)),
    (dict(recompute_granularity="full"), 1, dict(recompute_granularity="full")),
    (dict(seq_length=31, sequence_parallel=True, tensor_model_parallel_size=2), 2,
     dict(seq_length=31, max_position_embeddings=31, sequence_parallel=True)),
    (dict(num_experts=4, moe_shared_expert_gate=True), 1, dict(num_experts=4, moe_shared_expert_gate=True)),
    (dict(num_experts=4, moe_ffn_hidden_size=129, tensor_model_parallel_size=2), 2,
     dict(num_experts=4, moe_ffn_hidden_size=129)),
    (dict(num_experts=4, moe_pad_expert_input_to_capacity=True), 1,
     dict(num_experts=4, moe_pad_expert_input_to_capacity=True)),
    (dict(num_experts=4, topk=3), 1, dict(num_experts=4, moe_capacity_factor=1.0, moe_router_topk=3)),
    (dict(num_experts=4, moe_train_capacity_factor=-1.0), 1,
     dict(num_experts=4, moe_capacity_factor=-1.0, moe_eval_capacity_factor=1.0, moe_router_topk=1)),
])
def test_model_shape_rules_are_one_sentence_for_flags_and_gptconfig(changes, tp, model, capsys):
    """Each shape rule is written once (model/shape_rules.py): the command line refuses with the sentence GPTConfig
    (or its check at a tensor-parallel size) raises for the same model built by a tool or from saved arguments."""
    from megatron_zero.model.config import GPTConfig
    from megatron_zero.model.shape_rules import ModelShapeError

    with pytest.raises(ModelShapeError) as err:
        GPTConfig(**{**_MODEL, **model}).check_tp(tp)
    assert refused(with_flags(BASE, **changes), tp, capsys).strip() == f"pretrain_gpt.py: error: {err.value}"


def test_only_config_reads_the_namespace_by_name():
    """Outside config/ code reads the typed sections or the checked attributes, never getattr(args, ...) with a
    fallback (the standalone zero_to_fp32 copy, which reads other writers' saved args, excepted)."""
    readers = sorted({module for module, name, first in _package_calls() if (name, first) == ("getattr", "args")})
    assert [r for r in readers if not r.startswith("config/")] == ["checkpoint/export/standalone_zero_to_fp32.py"]

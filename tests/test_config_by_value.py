"""The configuration passed by value: the trainer gets the typed tree and hands each callee its section; the flat
`args` a checkpoint records are made back from the tree (config.saved_args) and are what the namespace held."""
import ast
import inspect
from pathlib import Path

import pytest

import megatron_zero
from megatron_zero import arguments, config
from megatron_zero.testing.flag_checks import BASE, with_flags
from megatron_zero.training import Trainer

PACKAGE = Path(megatron_zero.__file__).parent

# the training loop and the parts it builds: none takes the namespace (pretrain, the front door, parses it)
LOOP = ("training/trainer.py", "training/steps.py", "metrics/training_log.py", "training/step_hooks.py", "metrics/logger.py", "elastic/local_tier.py",
        "elastic/straggler.py", "elastic/restart.py", "model/mtp_metrics.py")
FRONT_DOOR = {("training/trainer.py", "pretrain")}


@pytest.mark.parametrize("argv,world", [
    (BASE, 1),
    (with_flags(BASE, tensor_model_parallel_size=2, sequence_parallel=True, bf16=True, num_experts=4,
                expert_model_parallel_size=2, moe_router_topk=2, rampup_batch_size=[4, 4, 64], train_samples=320,
                lr_warmup_samples=32, train_iters=None), 4),
    (with_flags(BASE, normalization="RMSNorm", swiglu=True, position_embedding_type="rope", group_query_attention=True,
                num_query_groups=2, iterations_to_skip=[3, 2]), 2),
])
def test_the_checkpoints_args_are_made_from_the_tree_as_the_namespace_held_them(argv, world):
    """What a checkpoint records as `args` (Megatron-LM's flat names) comes from the typed tree, value for value
    what the checked namespace held: resumes and the tools read the same checkpoints as before."""
    argv = [t for k, t in enumerate(argv) if t != "None" and not (t == "--train-iters" and argv[k + 1] == "None")]
    args = arguments.parse_args(argv, world_size=world)
    cfg = config.from_args(args)
    assert config.saved_args(cfg) == arguments.args_to_dict(args)
    assert set(vars(args)) <= set(config.flat(cfg))  # every value the checks derived has its field


def _loop_functions():
    for name in LOOP:
        tree = ast.parse((PACKAGE / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


def test_no_part_of_the_training_loop_takes_or_holds_the_namespace():
    """Trainer(cfg, state): no function of the loop's modules takes `args` (but the front door's), and none reads
    an `.args` attribute (the trainer held the namespace as self.args)."""
    params = inspect.signature(Trainer.__init__).parameters
    assert list(params)[:3] == ["self", "cfg", "state"] and "args" not in params
    taking = sorted((name, fn.name) for name, fn in _loop_functions()
                    if "args" in [a.arg for a in fn.args.args + fn.args.kwonlyargs] and (name, fn.name) not in FRONT_DOOR)
    assert taking == []
    reading = sorted({name for name in LOOP for node in ast.walk(ast.parse((PACKAGE / name).read_text()))
                      if isinstance(node, ast.Attribute) and node.attr == "args"})
    assert reading == []

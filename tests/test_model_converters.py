"""The model-converter protocol (megatron_zero/model/converters.py; a run's built by model_converters.py) driven
through the Trainer: a converter's `convert` runs once on the built stage and its line is logged, its
`post_optimizer_hook` runs once per optimizer step, the entry its `state_dict` adds is in the checkpoint's
model-states file (not in the client state) and a resume on the saving layout hands it back to its
`load_state_dict`, whose line is logged. The container applies the converters the flags ask for in one fixed
order."""
import os

import pytest
import torch

from megatron_zero.testing.multirank import run_ranks

FLAGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--eval-iters", "0",
         "--log-interval", "100"]


def _toy():
    from megatron_zero.model_converters import ModelConverter

    class Toy(ModelConverter):
        """Counts optimizer steps in a tensor it saves under its own model-states entry."""
        name, state_key = "toy", "toy_steps"

        def __init__(self):
            self.steps, self.converted, self.restored = torch.zeros((), dtype=torch.int64), [], None

        def convert(self, model):
            self.converted.append(type(model).__name__)
            return "toy: converted"

        def post_optimizer_hook(self, model):
            self.steps += 1

        def state_dict(self, model, dp_group):
            return {"steps": self.steps.clone()}

        def load_state_dict(self, model, saved, optimizer):
            if saved is None:
                return "toy: no steps saved"
            self.restored = int(saved["steps"])
            self.steps.copy_(saved["steps"])
            return f"toy: {self.restored} steps restored"

    return Toy()


def _train_save_resume(save_dir):
    import megatron_zero.training.trainer as training
    from megatron_zero.arguments import parse_args
    from megatron_zero.config import from_args
    from megatron_zero.checkpoint.format import model_states_name
    from megatron_zero.model_converters import ModelConverters
    from megatron_zero.distributed.topology import build_parallel_state

    toys, lines, clients = [], [], []
    flagged, resume = training.model_converters, training.resume_checkpoint

    def with_toy(cfg, state, device):  # the flags' converters, and the toy last
        toys.append(_toy())
        return ModelConverters([*flagged(cfg, state, device), toys[-1]])

    def resume_recorded(*args, **kwargs):
        clients.append(resume(*args, **kwargs))
        return clients[-1]

    training.model_converters, training.resume_checkpoint = with_toy, resume_recorded
    training.Trainer._log = lambda self, line: lines.append(line)

    def run(iters, *extra):
        argv = FLAGS + ["--train-iters", str(iters), "--save", save_dir, "--save-interval", "3", *extra]
        trainer = training.Trainer(from_args(parse_args(argv, world_size=1)), build_parallel_state(1, 1))
        trainer.train()
        return trainer.converters.names, list(lines)

    first = run(3)
    saved = torch.load(os.path.join(save_dir, "global_step3", model_states_name(0, 1)), weights_only=False)
    lines.clear()
    second = run(5, "--load", save_dir, "--override-opt_param-scheduler")  # (its length: 5, not 3)
    return {"converted": [t.converted for t in toys], "names": [first[0], second[0]], "lines": [first[1], second[1]],
            "saved": int(saved["toy_steps"]["steps"]), "client_keys": sorted(clients[-1]),
            "restored": toys[1].restored, "steps": [int(t.steps) for t in toys]}


def test_a_converter_through_the_trainer(tmp_path):
    got = run_ranks(_train_save_resume, 1, str(tmp_path / "ckpt"), timeout=300)[0]
    assert got["converted"] == [["GPTModel"], ["GPTModel"]]  # once per built stage
    assert got["names"] == [["output_loss", "toy"]] * 2
    assert "toy: converted" in got["lines"][0]
    assert got["saved"] == 3  # the hook ran once per step; its state is the model-states file's own entry
    assert "toy_steps" not in got["client_keys"] and "train_state" in got["client_keys"]
    assert got["restored"] == 3 and "toy: 3 steps restored" in got["lines"][1]
    assert got["steps"] == [3, 5]  # the resumed run's 2 steps counted on from the restored 3


def test_converters_apply_in_one_order():
    from megatron_zero.arguments import parse_args
    from megatron_zero.config import from_args
    from megatron_zero.model_converters import ModelConverter, ModelConverters, model_converters

    args = parse_args(FLAGS + ["--train-iters", "1", "--compile-layers", "--no-cross-entropy-loss-fusion"],
                      world_size=1)
    assert model_converters(from_args(args), None, torch.device("cpu")).names == ["output_loss", "compile"]
    # (FP8 first where it is asked for: tests/test_fp8_flags.py)
    same = ModelConverter()
    same.state_key = "one_entry"
    with pytest.raises(ValueError, match="one model-states entry"):
        ModelConverters([same, same])

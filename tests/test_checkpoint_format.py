"""checkpoint/format.py: every file name we write is recognised by its pattern, and the one reader of a
header's TP / PP sizes prefers DeepSpeed's checkpoint_parallel_dimensions, then the saved args."""
import argparse

from megatron_zero.checkpoint.format import (LAYER_FILE, MODEL_FILE, ZERO3_MODEL_FILE, ZERO_FILE, header_args,
                                             header_tp_pp, layer_file_name, model_states_name, optim_states_name)


def test_written_names_match_their_patterns():
    assert MODEL_FILE.match(model_states_name(3, zero_stage=1)).group(1) == "03"
    assert ZERO3_MODEL_FILE.match(model_states_name(3, zero_stage=3, dp_rank=5)).groups() == ("5", "03")
    assert ZERO_FILE.match(optim_states_name(5, 3)).groups() == ("5", "03")
    assert ZERO_FILE.match(optim_states_name(5, 3, bf16=True)).groups() == ("5", "03")
    assert LAYER_FILE.match(layer_file_name(7, 1)).groups() == ("07", "01")
    assert not MODEL_FILE.match(model_states_name(0, zero_stage=3))


def test_header_tp_pp_prefers_parallel_dimensions_then_args():
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert header_tp_pp({"args": args}) == (2, 4)
    assert header_tp_pp({"args": vars(args)}) == (2, 4)
    assert header_tp_pp({"args": args, "checkpoint_parallel_dimensions": {"tp_degree": 1, "pp_degree": 8}}) == (1, 8)
    assert header_tp_pp({"checkpoint_parallel_dimensions": {}, "args": {"tensor_model_parallel_size": 2}}) == (2, None)
    assert header_tp_pp({}) == (None, None)
    assert header_args({"args": None}) == {} and header_args({"args": args})["pipeline_model_parallel_size"] == 4

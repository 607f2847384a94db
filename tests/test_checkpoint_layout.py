"""Our checkpoints read by DeepSpeed's zero_to_fp32 and by ours; mismatches refused with a sentence."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_zero.checkpoint import load_checkpoint, save_checkpoint
from megatron_zero.checkpoint.deepspeed_layout import universal_checkpoint_info
from megatron_zero.model.sharding import gather_state_dicts
from megatron_zero.testing.checkpoint_stage import build_stage, random_train_step
from megatron_zero.testing.multirank import RankFailure, run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config


def _save_full_weights(save_dir, tp, pp, zero):
    """Train one step, save, and return on rank 0 the fp32 model (TP>1 or PP>1: gathered, full form)."""
    state, config, model, opt = build_stage(tp, pp, zero)
    random_train_step(state, config, model, opt)
    save_checkpoint(save_dir, 1, state, model, opt, {"args": {"tensor_model_parallel_size": tp}, "iteration": 1})
    ctx = opt.impl.gathered() if zero == 3 else torch.no_grad()
    with ctx:
        local = {k: v.detach().clone() for k, v in model.state_dict().items()}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, local)
    if dist.get_rank() != 0:
        return None
    if tp * pp == 1:
        return local  # the model's own weights (vocab padded), what DeepSpeed's zero_to_fp32 returns
    full = {}
    for p in range(pp):
        shards = [per_rank[state.layout.rank(p, 0, t)] for t in range(tp)]
        full.update({k: v for k, v in gather_state_dicts(shards, config).items() if k not in full})
    return full


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_deepspeed_zero_to_fp32_reads_our_dp_only_checkpoint(tmp_path, zero):
    ds = pytest.importorskip("deepspeed.utils.zero_to_fp32", reason="deepspeed is not installed; CI installs it")
    save_dir = str(tmp_path / "ckpt")
    want = run_ranks(_save_full_weights, 2, save_dir, 1, 1, zero, timeout=120)[0]
    got = ds.get_fp32_state_dict_from_zero_checkpoint(save_dir)
    got = ds.to_torch_tensor(got) if hasattr(ds, "to_torch_tensor") else got
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name].contiguous(), t), name


def test_our_zero_to_fp32_consolidates_tp2_pp2_dp2(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    want = run_ranks(_save_full_weights, 8, save_dir, 2, 2, 2, timeout=180)[0]
    out = str(tmp_path / "full.pt")
    script = os.path.join(save_dir, "global_step1", "zero_to_fp32.py")
    run = subprocess.run([sys.executable, script, save_dir, out], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = torch.load(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    import json
    manifest = json.load(open(os.path.join(save_dir, "global_step1", "manifest.json")))["files"]
    layers = {n: f["rank"] for n, f in manifest.items() if n.startswith("layer_")}
    assert sorted(layers) == [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(1, 5) for t in (0, 1)]
    # stage 0 (layers 1-2) of TP rank 0 is written by both of its DP replicas (ranks 0 and 2), not by one
    assert {layers["layer_01-model_00-model_states.pt"], layers["layer_02-model_00-model_states.pt"]} == {0, 2}


def _resume_on(save_dir, tp, pp, zero, hidden, drop=None):
    state, config, model, opt = build_stage(tp, pp, zero, hidden)
    if drop and dist.get_rank() == 0:  # without the manifest too, so load's own file check speaks
        os.remove(os.path.join(save_dir, "global_step1", drop))
        os.remove(os.path.join(save_dir, "global_step1", "manifest.json"))
    dist.barrier()
    return load_checkpoint(save_dir, state, model, opt, verify=drop is None)


def _saved(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    run_ranks(_save_full_weights, 2, save_dir, 2, 1, 1, timeout=120)  # TP2, two ranks: the cheapest TP layout
    return save_dir


def test_mismatches_are_refused_with_a_sentence(tmp_path):
    save_dir = _saved(tmp_path)
    with pytest.raises(RankFailure, match=r"CheckpointError: the checkpoint .* was saved with TP=2 x PP=1 x DP=1 "
                                          r"but this run is TP=1 x PP=1 x DP=2"):
        run_ranks(_resume_on, 2, save_dir, 1, 1, 1, 32, timeout=120)
    with pytest.raises(RankFailure, match=r"holds a model of another shape \(\d+ parameters differ: "
                                          r"tied_modules.embed.word_embeddings.weight \[56, 32\] in the checkpoint "
                                          r"vs \[56, 48\] here"):
        run_ranks(_resume_on, 2, save_dir, 2, 1, 1, 48, timeout=120)
    with pytest.raises(RankFailure, match=r"CheckpointError: the checkpoint file \S+layer_03-model_01-model_states"
                                          r"\.pt is missing \(it holds 3\.input_layernorm\.weight"):
        run_ranks(_resume_on, 2, save_dir, 2, 1, 1, 32, "layer_03-model_01-model_states.pt", timeout=120)


def test_universal_info_describes_our_parameters():
    info = universal_checkpoint_info(tiny_gpt_config(num_layers=2), padded_vocab_size=112)
    import re
    def kind(name, info=info):
        return [k for k in ("tp_replicated_parameter_patterns", "parameter_with_row_parallelism_patterns",
                            "vocabulary_parameter_patterns", "parameter_with_2_sub_params_cat_dim_0",
                            "pipeline_replicated_parameter_patterns")
                if any(re.match(p, name) for p in info.get(k, []))]
    assert kind("2.self_attention.dense.weight") == ["parameter_with_row_parallelism_patterns"]
    assert kind("3.mlp.dense_4h_to_h.bias") == ["tp_replicated_parameter_patterns"]
    assert kind("4.weight") == ["tp_replicated_parameter_patterns"]  # final norm
    assert kind("2.self_attention.query_key_value.weight") == []      # column-parallel: dim 0
    assert kind("tied_modules.embed.word_embeddings.weight") == ["vocabulary_parameter_patterns",
                                                                 "pipeline_replicated_parameter_patterns"]
    assert info["original_vocab_size"] == 100 and info["padded_vocab_size"] == 112
    assert "parameter_with_2_sub_params_cat_dim_0" not in info  # GPT-2's info is what it always was
    llama = universal_checkpoint_info(tiny_llama_config(num_layers=2), padded_vocab_size=112)
    assert kind("3.mlp.dense_h_to_4h.weight", llama) == ["parameter_with_2_sub_params_cat_dim_0"]
    assert kind("1.word_embeddings.weight", llama) == ["vocabulary_parameter_patterns"]  # untied: stage 0 only
    assert kind("5.lm_head.weight", llama) == ["vocabulary_parameter_patterns"]
    assert kind("4.weight", llama) == ["tp_replicated_parameter_patterns"]

"""torchtitan's DCP Llama layout both ways (megatron_zero/checkpoint/interop/titan.py).

torchtitan 0.3.0 does not import on this CPU (it needs spmd_types), so its layout is written following its code
and its forward is megatron_zero/testing/titan_reference.py, written from its code. Checked: our Llama's
weights and Adam moments written in torchtitan's layout read back bit for bit; torchtitan's forward over the
written tensors (interleaved-pair RoPE, so wq/wk rows are permuted) gives our logits within 1e-5 (fp32 sums in
other orders: ~1e-6 relative on O(1) logits); and the same checkpoint loads into ours at TP2 (slow).
"""
import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.interop.titan import TitanFiles, write_titan
from megatron_zero.model.gpt import reference_model
from megatron_zero.model.params import param_names
from megatron_zero.model.sharding import gather_state_dicts, shard_state_dict
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config
from megatron_zero.testing.titan_reference import titan_logits


class _Source:
    """Full tensors of a model, with moments derived from them, as the per-parameter interface."""

    def __init__(self, full):
        self.tensors = full

    def full(self, name, which):
        t = self.tensors[name]
        return {"fp32": t, "exp_avg": t * 0.5, "exp_avg_sq": t.abs()}[which], None, 1

    def step(self, name):
        return 7


def _config():
    return tiny_llama_config(num_layers=2, num_query_groups=2)


def _model(cfg):
    torch.manual_seed(0)
    model = reference_model(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model, gather_state_dicts([{n: p.detach() for n, p in model.named_parameters()}], cfg)


def test_titan_round_trip_and_logits(tmp_path):
    cfg = _config()
    model, full = _model(cfg)
    write_titan(_Source(full), cfg, str(tmp_path / "step-7"), 7)
    files = TitanFiles(str(tmp_path / "step-7"), cfg)
    assert files.iteration == 7 and files.has_optimizer
    for name in param_names(cfg):
        for which, expect in (("fp32", full[name]), ("exp_avg", full[name] * 0.5), ("exp_avg_sq", full[name].abs())):
            assert torch.equal(files.full(name, which)[0], expect), (name, which)
        assert files.step(name) == 7
    titan = {}
    reader = dcp.FileSystemReader(str(tmp_path / "step-7"))
    keys = [k for k in reader.read_metadata().state_dict_metadata if not k.startswith(("optimizer.", "train_state."))]
    titan = {k: torch.empty(reader.read_metadata().state_dict_metadata[k].size) for k in keys}
    dcp.load(titan, storage_reader=reader, no_dist=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)[..., :cfg.vocab_size]
    assert (titan_logits(titan, cfg, tokens) - ours).abs().max() <= 1e-5


def test_titan_refuses_gpt2(tmp_path):
    with pytest.raises(CheckpointError, match="torchtitan's Llama layout"):
        write_titan(_Source({}), tiny_gpt_config(), str(tmp_path / "x"), 1)


def _load_tp2(directory):
    from megatron_zero.checkpoint.reshape.universal_load import load_from
    from megatron_zero.pipeline.gpt_stage import build_gpt_stage
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.training.trainer import param_groups
    from megatron_zero.zero import ZeroOptimizer
    cfg = _config()
    state = build_parallel_state(tp=2, pp=1)
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(param_groups(model, 0.0), dp_group=state.dp_group, stage=1, lr=1e-3,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=model)
    client = load_from(TitanFiles(directory, cfg), state, model, opt)
    return client["iteration"], {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_titan_loads_at_tp2(tmp_path):
    cfg = _config()
    _, full = _model(cfg)
    write_titan(_Source(full), cfg, str(tmp_path / "step-7"), 7)
    results = run_ranks(_load_tp2, 2, str(tmp_path / "step-7"), timeout=300)
    assert {r[0] for r in results} == {7}
    merged = gather_state_dicts([r[1] for r in results], cfg)
    for name in param_names(cfg):
        assert torch.equal(merged[name], full[name]), name
    assert shard_state_dict(full, cfg, 1, 0).keys() == reference_model(cfg).state_dict().keys()


def test_convert_checkpoint_cli_dcp_universal_round_trip(tmp_path):
    """tools/convert_checkpoint.py: universal -> dcp -> universal is exact; pairs it does not make are one sentence."""
    import os
    import subprocess
    import sys

    from megatron_zero.checkpoint.interop.convert import config_args
    from megatron_zero.checkpoint.interop.to_universal import write_universal
    from megatron_zero.checkpoint.reshape.universal_load import UniversalFiles
    from megatron_zero.checkpoint.storage.reader import open_directory
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = tiny_llama_config(num_layers=2, num_query_groups=2, make_vocab_size_divisible_by=1)
    _, full = _model(cfg)
    src = _Source(full)
    src.has_optimizer = True
    write_universal(src, cfg, {"iteration": 7, "args": config_args(cfg),
                               "universal_checkpoint_info": {"original_vocab_size": cfg.vocab_size}},
                    str(tmp_path / "u" / "a"), "test")
    tool = [sys.executable, os.path.join(root, "tools", "convert_checkpoint.py")]
    run = subprocess.run(tool + ["--from", "universal", "--to", "dcp", "--input", str(tmp_path / "u" / "a"),
                                 "--output", str(tmp_path / "titan")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    run = subprocess.run(tool + ["--from", "dcp", "--to", "universal", "--input", str(tmp_path / "titan" / "step-7"),
                                 "--output", str(tmp_path / "v" / "b"), "--num-attention-heads", "4", "--seq-length",
                                 str(cfg.seq_length), "--make-vocab-size-divisible-by", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    back = UniversalFiles(open_directory(str(tmp_path / "v" / "b")))
    for name in param_names(cfg):
        for which in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(back.full(name, which)[0], _Source(full).full(name, which)[0]), (name, which)
    assert back.step(param_names(cfg)[0]) == 7
    run = subprocess.run(tool + ["--from", "dcp", "--to", "universal", "--input", str(tmp_path / "titan" / "step-7"),
                                 "--output", str(tmp_path / "w")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().endswith("pass --num-attention-heads")

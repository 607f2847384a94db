"""--load of a directory that holds a checkpoint --load does not read (a torchtitan DCP step, a Hugging Face model)
is refused in one sentence naming the format and the command that converts it, not trained from scratch; an empty
directory still starts from scratch. Driven through pretrain_gpt.py."""
import os

import torch
import torch.distributed.checkpoint as dcp

from megatron_zero.testing.launch import byte_data, pretrain


def refusal(run):
    err = [line for line in run.stderr.splitlines() if "--load" in line and "convert" in line]
    assert run.returncode != 0 and len(err) == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "starting from scratch" not in run.stdout + run.stderr
    return err[0]


def test_dcp_step_refused_with_the_converter(tmp_path):
    step = tmp_path / "titan" / "step-20"
    dcp.save({"tok_embeddings.weight": torch.zeros(4, 4)}, checkpoint_id=str(step))
    assert os.path.isfile(step / ".metadata")
    line = refusal(pretrain(tmp_path, byte_data(str(tmp_path / "bytes")), load=step))
    assert "torch.distributed.checkpoint" in line and "convert_checkpoint.py --from dcp --to universal" in line


def test_hf_directory_refused_with_the_importer(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (hf / "model.safetensors").write_bytes(b"")
    line = refusal(pretrain(tmp_path, byte_data(str(tmp_path / "bytes")), load=hf))
    assert "Hugging Face" in line and "convert_from_hf.py" in line


def test_empty_directory_starts_from_scratch(tmp_path):
    (tmp_path / "empty").mkdir()
    run = pretrain(tmp_path, byte_data(str(tmp_path / "bytes")), load=tmp_path / "empty")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "starting from scratch" in run.stdout + run.stderr

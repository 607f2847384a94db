"""--apply-layernorm-1p through the command line: pretrain_gpt.py trains the tiny Llama (RMSNorm) zero-centred at
TP2 for 6 iterations saving at 3; the run resumed from that checkpoint logs the uninterrupted run's losses
bit-identically (tests/test_cli_resume.py derives why); a resume without the flag is refused in one sentence
naming the switch; tools/convert_to_hf.py writes gamma = 1 + w, which transformers' LlamaForCausalLM loads and
computes our model's logits with (1e-5, as tests/test_hf_llama.py), and tools/convert_from_hf.py
--apply-layernorm-1p takes it back to w (one fp32 rounding of the add and the subtraction: 2 ulp of 1)."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
from megatron_zero.checkpoint.export.hf.exporter import shape_reader
from megatron_zero.checkpoint.saved_config import saved_args, saved_config
from megatron_zero.model.params import is_norm_weight
from megatron_zero.testing.cli import CliResume, cli_flags, imported_flags, layout_flags, text_data, tool
from megatron_zero.testing.hf_parity import our_logits
from megatron_zero.testing.launch import PRETRAIN

pytestmark = pytest.mark.multirank
ONE_P = {"apply-layernorm-1p": True}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_1p")
    data = text_data(root / "text")
    return CliResume(str(root), lambda *changes: cli_flags(data, str(root / "cache"), "llama", ONE_P, *changes),
                     layout_flags(tp=2))


def test_resume_as_saved_is_bit_identical(run):
    run.assert_matches(run.resume(), 0.0)


def test_resume_without_the_switch_is_refused(run):
    argv = run.flags({"train-iters": run.iters}, {"load": run.checkpoint, "apply-layernorm-1p": None})  # 1 rank
    done = subprocess.run([sys.executable, PRETRAIN] + [str(a) for a in argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "apply_layernorm_1p True in the checkpoint vs False here" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_hf_export_computes_our_logits_and_imports_back(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    tool("convert_to_hf.py", run.checkpoint, hf)
    config = saved_config(*shape_reader(run.checkpoint), saved_args(run.checkpoint), where=run.checkpoint)
    assert config.apply_layernorm_1p and config.normalization == "RMSNorm"
    toks = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(1))
    want = our_logits(run.checkpoint, config, toks)
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(toks).logits, want, rtol=1e-5, atol=1e-5)
    ours = get_fp32_state_dict(run.checkpoint)
    assert torch.equal(model.model.norm.weight.detach(), ours[f"{config.num_layers + 2}.weight"] + 1)

    back = tmp_path / "back"
    tool("convert_from_hf.py", "--input-dir", hf, "--output-dir", back, "--apply-layernorm-1p")
    assert "--apply-layernorm-1p" in imported_flags(str(back))
    imported = get_fp32_state_dict(str(back))
    for name, w in ours.items():
        if is_norm_weight(name, config):
            torch.testing.assert_close(imported[name], w, rtol=0, atol=2.4e-7)
        else:
            assert torch.equal(imported[name], w), name

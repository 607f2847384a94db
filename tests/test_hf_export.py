"""convert_to_hf: transformers' GPT2LMHeadModel loads the export of a trained TP2xPP2 checkpoint and
computes our logits (1e-5)."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
from megatron_zero.model.gpt import reference_model
from megatron_zero.model.sharding import shard_state_dict
from megatron_zero.testing import run_ranks
from megatron_zero.testing.layout_train import config, train

try:
    import transformers
except ImportError:  # pragma: no cover - depends on the environment
    transformers = None
    print("transformers is not installed: tests/test_hf_export.py is skipped (pip install transformers)")

pytestmark = pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install transformers)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def our_logits(full_sd, tokens):
    cfg = config()
    model = reference_model(cfg)
    model.load_state_dict(shard_state_dict(full_sd, cfg, 1, 0))
    model.eval()
    with torch.no_grad():
        return model(tokens)[..., :cfg.vocab_size]


def hf_logits(path, tokens):
    model = transformers.GPT2LMHeadModel.from_pretrained(path)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def test_convert_trained_tp2_pp2_checkpoint(tmp_path):
    run_ranks(train, 4, 2, 2, 1, 2, str(tmp_path), None, "universal", 3, 3, timeout=300)
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_to_hf.py"), str(tmp_path), str(out),
                           "--num-attention-heads", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    tokens = torch.randint(0, 100, (2, 8))
    sd = get_fp32_state_dict(str(tmp_path))
    torch.testing.assert_close(hf_logits(str(out), tokens), our_logits(sd, tokens), rtol=1e-5, atol=1e-5)

"""tools/convert_checkpoint.py holds one tensor at a time: its peak resident memory, beyond what its imports hold, is
bounded by the largest tensor plus a fixed buffer, whatever the model's size.

The peak is the kernel's high-water mark (VmHWM, reset once the imports are done: host_memory.tool_peak_growth),
so nothing is sampled or timed. The model: 6 Llama layers of hidden 256 (ffn 1024), 3 x 22 MiB of weights and
Adam moments, largest tensor 2 MiB. The bound, 4 x the largest tensor + 24 MiB: a tensor, its parts
(torchtitan splits QKV and SwiGLU's halves), a read's copy, and what torch's DCP planner, the allocator and
the page tables keep (measured 7-18 MiB at 12 and at 24 layers: it does not grow with the model). Before the writers streamed,
universal -> dcp grew with the model (its whole state in memory: 218 MiB at 12 layers).
"""
import os

import pytest
import torch

from megatron_zero.checkpoint.interop.convert import config_args
from megatron_zero.checkpoint.interop.to_universal import write_universal
from megatron_zero.model.params import param_names, param_spec
from megatron_zero.testing.host_memory import tool_peak_growth
from megatron_zero.testing.tiny_gpt import tiny_llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
CFG = tiny_llama_config(num_layers=6, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=1024, make_vocab_size_divisible_by=1)
SIZES = [4 * torch.Size(param_spec(n, CFG).full_shape).numel() for n in param_names(CFG)]
BOUND = 4 * max(SIZES) + (24 << 20)


class _Source:
    has_optimizer = True

    def full(self, name, which):
        g = torch.Generator().manual_seed(len(name) + len(which))
        return torch.randn(param_spec(name, CFG).full_shape, generator=g), None, param_spec(name, CFG).sub_params

    def step(self, name):
        return 3


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("memory") / "u" / "src")
    write_universal(_Source(), CFG, {"iteration": 4, "args": config_args(CFG),
                                     "universal_checkpoint_info": {"original_vocab_size": CFG.vocab_size}}, path, "t")
    assert 3 * sum(SIZES) > 2 * BOUND  # the state is well beyond the bound: holding it would show
    return path


def test_universal_to_dcp_holds_one_tensor(universal, tmp_path):
    grown = tool_peak_growth(TOOL, "--from", "universal", "--to", "dcp", "--input", universal, "--output",
                             str(tmp_path / "out"), "--quiet")
    assert grown <= BOUND, f"universal -> dcp held {grown / 2**20:.1f} MiB, over {BOUND / 2**20:.1f} MiB"


@pytest.mark.slow
def test_other_directions_hold_one_tensor(universal, tmp_path):
    """universal -> torch_dist (before: every chunk kept referenced by torch's writer until its file closed), and
    the reading directions torch_dist -> universal, dcp -> universal, under the same bound."""
    grown = tool_peak_growth(TOOL, "--from", "universal", "--to", "torch_dist", "--input", universal, "--output",
                             str(tmp_path / "torch_dist"), "--quiet")
    assert grown <= BOUND, f"universal -> torch_dist held {grown / 2**20:.1f} MiB"
    assert tool_peak_growth(TOOL, "--from", "universal", "--to", "dcp", "--input", universal, "--output",
                            str(tmp_path / "dcp"), "--quiet") <= BOUND
    titan = ["--num-attention-heads", "4", "--seq-length", str(CFG.seq_length), "--make-vocab-size-divisible-by", "1"]
    for src, extra in ((str(tmp_path / "dcp" / "step-4"), titan), (str(tmp_path / "torch_dist"), [])):
        grown = tool_peak_growth(TOOL, "--from", "dcp" if extra else "torch_dist", "--to", "universal", "--input",
                                 src, "--output", str(tmp_path / "back" / os.path.basename(src)), "--quiet", *extra)
        assert grown <= BOUND, f"{src} -> universal held {grown / 2**20:.1f} MiB"

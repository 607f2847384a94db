"""A Hugging Face MoE model imported and trained through the command line: a tiny random MixtralForCausalLM /
Qwen2MoeForCausalLM (built from a transformers config, nothing downloaded) goes through tools/convert_from_hf.py,
and pretrain_gpt.py, given the flags the import wrote (megatron_flags.txt) and --load, trains it on 2 ranks
at --expert-model-parallel-size 1 and 2: the same micro-batches reach the same experts, so the logged losses
agree within relative 1e-5 (tests/test_cli_resume.py's tolerance for another layout, derived there: fp32
rounding along the path plus the log's 7 significant digits)."""
import os

import pytest

from megatron_zero.testing.cli import cli_flags, imported_flags, logged_losses, pretrain_cli, save_tiny_hf, text_data, tool
from megatron_zero.testing.launch import flags_argv

pytest.importorskip("transformers")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]
ITERS, OTHER_LAYOUT_REL = 4, 1e-5


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_imported_moe_trains_alike_at_ep1_and_ep2(tmp_path, kind):
    hf = save_tiny_hf(str(tmp_path / "hf"), kind)
    imported = str(tmp_path / "imported")
    tool("convert_from_hf.py", "--input-dir", hf, "--output-dir", imported)
    data = text_data(str(tmp_path / "text"))
    base = cli_flags(data, str(tmp_path / "cache"), None) + imported_flags(imported)
    runs = {ep: logged_losses(pretrain_cli(2, base + flags_argv({"load": imported, "train-iters": ITERS,
                                                                    "expert-model-parallel-size": ep})))
            for ep in (1, 2)}
    assert sorted(runs[1]) == sorted(runs[2]) == list(range(1, ITERS + 1)), runs
    for it in runs[1]:
        assert abs(runs[2][it] - runs[1][it]) <= OTHER_LAYOUT_REL * abs(runs[1][it]), (it, runs)
    assert os.path.isfile(os.path.join(imported, "megatron_flags.txt"))

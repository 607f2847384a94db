"""A Hugging Face MoE model imported, trained and exported through the command line: a tiny random
MixtralForCausalLM / Qwen2MoeForCausalLM (built from a transformers config, nothing downloaded) goes through
tools/convert_from_hf.py, and pretrain_gpt.py, given the flags the import wrote (megatron_flags.txt) and
--load, trains it on 2 ranks at --expert-model-parallel-size 1 and 2: the same micro-batches reach the same
experts, so the logged losses agree within relative 1e-5 (tests/test_cli_resume.py's tolerance for another
layout, derived there: fp32 rounding along the path plus the log's 7 significant digits).

The EP2 run saves (DeepSpeed-MoE's per-expert files, ZeRO-1 optimizer files); tools/convert_to_hf.py exports
that trained checkpoint, transformers loads the export, and its logits equal our model's from the same
checkpoint within 1e-5 relative (normwise, as tests/test_hf_moe.py compares the two implementations)."""
import os

import pytest
import torch

from megatron_zero.checkpoint.export.consolidate import resolve_checkpoint_dir
from megatron_zero.checkpoint.saved_config import saved_args, saved_config
from megatron_zero.checkpoint.export.hf.exporter import shape_reader
from megatron_zero.testing.cli import cli_flags, imported_flags, logged_losses, pretrain_cli, save_tiny_hf, text_data, tool
from megatron_zero.testing.hf_parity import our_logits
from megatron_zero.testing.launch import flags_argv
from megatron_zero.testing.tolerances import assert_close_normwise

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]
ITERS, OTHER_LAYOUT_REL, LOGITS_REL = 4, 1e-5, 1e-5


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_imported_moe_trains_alike_at_ep1_and_ep2_and_exports(tmp_path, kind):
    hf = save_tiny_hf(str(tmp_path / "hf"), kind)
    imported = str(tmp_path / "imported")
    tool("convert_from_hf.py", "--input-dir", hf, "--output-dir", imported)
    data = text_data(str(tmp_path / "text"))
    base = cli_flags(data, str(tmp_path / "cache"), None) + imported_flags(imported)
    save = str(tmp_path / "trained")
    runs = {ep: logged_losses(pretrain_cli(2, base + flags_argv({"load": imported, "train-iters": ITERS,
                                                                    "expert-model-parallel-size": ep,
                                                                    "save": save if ep == 2 else None})))
            for ep in (1, 2)}
    assert sorted(runs[1]) == sorted(runs[2]) == list(range(1, ITERS + 1)), runs
    for it in runs[1]:
        assert abs(runs[2][it] - runs[1][it]) <= OTHER_LAYOUT_REL * abs(runs[1][it]), (it, runs)
    assert os.path.isfile(os.path.join(imported, "megatron_flags.txt"))

    exported = str(tmp_path / "exported")
    tool("convert_to_hf.py", save, exported)
    ckpt = resolve_checkpoint_dir(save, None)
    assert any(f.startswith("layer_") and "_expert_" in f for f in os.listdir(ckpt))  # DeepSpeed-MoE's files
    config = saved_config(*shape_reader(ckpt), saved_args(ckpt))
    toks = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    assert type(model).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[kind]
    with torch.no_grad():
        theirs = model(toks).logits
    assert_close_normwise(theirs, our_logits(ckpt, config, toks), LOGITS_REL, f"{kind} logits")

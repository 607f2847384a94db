"""A Hugging Face model imported and trained through the command line: a tiny random LlamaForCausalLM /
MistralForCausalLM (built from a transformers config, nothing downloaded) goes through
tools/convert_from_hf.py; pretrain_gpt.py, given the flags the import wrote (megatron_flags.txt), starts
from it with --load and trains 6 iterations on 2 ranks saving at 3; runs resumed from that checkpoint as
saved, reshaped while loading at another layout, and converted by tools/ds_to_universal.py and loaded with
--universal-checkpoint log the uninterrupted run's losses at iterations 4-6.

Tolerances as in tests/test_cli_resume.py (derived there): bit-identical resumed as saved, relative 1e-5 at
another layout. The default tier resumes the Llama import as saved; the rest are `slow`, covered in the default
tier by that test and by tests/test_cli_resume.py's Llama universal resume.
"""
import os

import pytest

from megatron_zero.testing.cli import CliResume, cli_flags, imported_flags, layout_flags, save_tiny_hf, text_data, tool
from megatron_zero.testing.launch import flags_argv

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

AS_SAVED_REL, RESHAPED_REL = 0.0, 1e-5
# HF model -> (transformers config overrides, the layout it trains and saves at, universal's, reshaped's)
PLANS = {
    "llama": ({}, layout_flags(), layout_flags(tp=2), layout_flags(pp=2)),
    "mistral": ({"sliding_window": 16}, layout_flags(tp=2), layout_flags(pp=2), layout_flags(zero=2)),
}
DEFAULT = {("llama", "as saved")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """HF model kind -> its CliResume, started from the import (made on first use)."""
    made = {}
    root = tmp_path_factory.mktemp("cli_hf_import")
    data = text_data(root / "text")

    def get(kind):
        if kind not in made:
            where = root / kind
            os.makedirs(where)
            hf = save_tiny_hf(str(where / "hf"), kind, **PLANS[kind][0])
            imported = str(where / "imported")
            tool("convert_from_hf.py", "--input-dir", hf, "--output-dir", imported)
            model = imported_flags(imported)

            def flags(*changes):
                merged = {"load": imported}
                for change in changes:
                    merged.update(change)
                return cli_flags(data, str(root / "cache"), None) + model + flags_argv(merged)
            made[kind] = CliResume(str(where), flags, PLANS[kind][1])
        return made[kind]
    return get


CASES = [(kind, how) for kind in PLANS for how in ("as saved", "universal", "reshaped")]


@pytest.mark.parametrize("kind,how", [
    pytest.param(kind, how, marks=() if (kind, how) in DEFAULT else pytest.mark.slow, id=f"hf-{kind}-{how}")
    for kind, how in CASES])
def test_import_trains_and_resumes(runs, kind, how):
    run = runs(kind)
    _, _, universal, reshaped = PLANS[kind]
    layout = {"as saved": None, "universal": universal, "reshaped": reshaped}[how]
    run.assert_matches(run.resume(how, layout), AS_SAVED_REL if how == "as saved" else RESHAPED_REL)

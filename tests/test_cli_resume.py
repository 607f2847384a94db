"""Resuming GPT-2, Llama and Mistral checkpoints through the command line, as users do: pretrain_gpt.py trains
6 iterations on 2 ranks saving at 3; runs resumed from that checkpoint (as saved; reshaped while loading at
another TP / PP / DP and ZeRO stage; converted by tools/ds_to_universal.py and loaded with
--universal-checkpoint at another layout) log the uninterrupted run's losses at iterations 4-6.

Tolerances (fp32, one thread a rank):
- as saved: bit-identical. The same ranks run the same operations in the same order on the restored state
  (weights, Adam moments and step, lr schedule, data position), so nothing may differ.
- another layout: relative 1e-5. The log prints 7 significant digits (rounding: 1e-7 relative at a loss
  near 5). A new layout reorders fp32 sums (TP all-reduces hidden-dimension partial sums, ZeRO partitions
  the gradient reduction differently, PP accumulates micro-batch losses per stage), a few eps (1.2e-7)
  relative per step. Adam can turn such a difference into a full-size update only on an element whose
  gradient is near zero, which moves the loss at second order. The measured differences are at most one
  unit in the last printed digit (2e-7 relative), 50 times inside the bound. Losing any resumed state
  (the Adam moments, the lr schedule, a wrong shard) moves these losses by more than 1e-3.

Llama: RMSNorm, RoPE, SwiGLU, 2 query groups, untied output, no biases; Mistral: the same family in
Megatron-DeepSpeed's spellings (--normalization rmsnorm, --use-rotary-position-embeddings,
--num-key-value-heads 1: one key/value head, replicated at TP 2) with rotary base 1e6.
The default tier resumes each architecture as saved, and Llama also universal; the rest are `slow`, each
covered in the default tier by the same architecture resumed as saved and by Llama's universal resume.
"""
import os

import pytest

from megatron_zero.testing.cli import CliResume, cli_flags, layout_flags, text_data

pytestmark = pytest.mark.multirank

AS_SAVED_REL, RESHAPED_REL = 0.0, 1e-5
# architecture -> (the layout it trains and saves at, the universal resume's, the reshaped resume's), 2 ranks
PLANS = {
    "gpt2": (layout_flags(), layout_flags(tp=2), layout_flags(pp=2)),
    "llama": (layout_flags(tp=2), layout_flags(zero=2), layout_flags(pp=2)),
    "mistral": (layout_flags(pp=2), layout_flags(tp=2), layout_flags(zero=3)),
}
DEFAULT = {("gpt2", "as saved"), ("llama", "as saved"), ("llama", "universal"), ("mistral", "as saved")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """architecture -> its CliResume (the uninterrupted run, made on first use)."""
    made = {}
    root = tmp_path_factory.mktemp("cli_resume")
    data = text_data(root / "text")

    def get(arch):
        if arch not in made:
            where = str(root / arch)
            os.makedirs(where)
            made[arch] = CliResume(where, lambda *changes: cli_flags(data, str(root / "cache"), arch, *changes),
                                   PLANS[arch][0])
        return made[arch]
    return get


CASES = [(arch, how) for arch in PLANS for how in ("as saved", "universal", "reshaped")]


@pytest.mark.parametrize("arch,how", [
    pytest.param(arch, how, marks=() if (arch, how) in DEFAULT else pytest.mark.slow, id=f"{arch}-{how}")
    for arch, how in CASES])
def test_resume_matches_uninterrupted_run(runs, arch, how):
    run = runs(arch)
    source, universal, reshaped = PLANS[arch]
    layout = {"as saved": None, "universal": universal, "reshaped": reshaped}[how]
    run.assert_matches(run.resume(how, layout), AS_SAVED_REL if how == "as saved" else RESHAPED_REL)

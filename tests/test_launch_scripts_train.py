"""Each of the six public launch scripts, cut down, trains 5 iterations on the CPU through pretrain_gpt.py.

Cut down means: sizes (layers, hidden, heads, sequence, batch, vocabulary) and parallel sizes made
small enough for at most 2 CPU ranks, paths pointed at the built-in corpus (its SentencePiece model,
or a GPT-2 BPE vocab/merges trained on it, with the corpus preprocessed by that tokenizer), the flags
the parser refuses removed (tests/test_launch_script_flags.py pins which), --train-iters 5,
--distributed-backend nccl replaced by gloo (the CPU's), and --fp8-emulate added to an --fp8-format script
(the CPU has no FP8 tensor cores). Every other flag is the script's own.
"""
import os
import re
import subprocess
import sys

import pytest

from megatron_zero.arguments.flag_refusals import refusals
from megatron_zero.testing.launch import ROOT, losses_from_log, torchrun
from megatron_zero.testing.launch_scripts import replace_flag, script_argv

pytestmark = pytest.mark.slow

SMALL = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
         "--max-position-embeddings": "64", "--train-iters": "5", "--ffn-hidden-size": "128"}
# per script: (ranks, flags changed beyond SMALL)
CUTS = {
    "megatron_lm_gpt3_175b": (2, {"--global-batch-size": "4", "--tensor-model-parallel-size": "1",
                                  "--pipeline-model-parallel-size": "2",
                                  "--step-batch-size-schedule": "0:2 256:4"}),  # tokens: batch 2, 2, then 4
    "megatron_lm_llama3_8b_fp8": (2, {"--global-batch-size": "4", "--num-query-groups": "2", "--kv-channels": "16",
                                      "--vocab-size": "512", "--train-samples": "20", "--lr-decay-samples": "16",
                                      "--lr-warmup-samples": "4", "--profile-step-start": "2",
                                      "--profile-step-end": "3"}),
    "megatron_lm_mixtral_8x7b": (2, {"--global-batch-size": "4", "--num-query-groups": "2",
                                     "--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "2"}),
    "mds_llama2": (2, {"--global-batch-size": "8", "--micro-batch-size": "2", "--num-key-value-heads": "2",
                       "--distributed-backend": "gloo", "--pipeline-model-parallel-size": "1"}),
    "mds_universal_bf16": (2, {"--num-attention-heads": "4", "--tensor-model-parallel-size": "1"}),
    "mds_moe64": (2, {"--global-batch-size": "8", "--micro-batch-size": "4", "--train-tokens": "2560",
                      "--num-experts": "4", "--moe-expert-parallel-size": "2"}),
}
# DeepSpeed JSONs the cut-down runs use: the script's own, with the cut batch sizes (train = micro x GA x DP)
DS_BATCH = {"mds_llama2": (8, 2), "mds_universal_bf16": (4, 1), "mds_moe64": (8, 4)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The built-in corpus with its SentencePiece model, and preprocessed with a GPT-2 BPE trained on it."""
    from megatron_zero.testing.tiny_tokenizer import byte_level_bpe

    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_corpus.py"), "--output-dir", str(out)],
                   check=True, capture_output=True)
    bpe = byte_level_bpe(str(out / "bpe"), vocab_size=400)
    bpe_dir = os.path.dirname(bpe) if os.path.isfile(bpe) else bpe
    jsonl = [f for f in os.listdir(out) if f.endswith(".jsonl")][0]
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                    str(out / jsonl), "--output-prefix", str(out / "bpe_corpus"), "--tokenizer-type",
                    "GPT2BPETokenizer", "--vocab-file", os.path.join(bpe_dir, "vocab.json"), "--merge-file",
                    os.path.join(bpe_dir, "merges.txt"), "--append-eod"], check=True, capture_output=True)
    return {"sp_data": str(out / "pydoc_text_document"), "sp_model": str(out / "tokenizer.model"),
            "bpe_data": str(out / "bpe_corpus_text_document"), "vocab": os.path.join(bpe_dir, "vocab.json"),
            "merges": os.path.join(bpe_dir, "merges.txt")}


def _ds_config(name, tmp_path):
    import json

    from megatron_zero.testing.launch_scripts import DATA_DIR, scripts

    with open(os.path.join(DATA_DIR, scripts()[name]["ds_config"])) as f:
        config = json.load(f)
    config["train_batch_size"], config["train_micro_batch_size_per_gpu"] = DS_BATCH[name]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def cut_down_argv(name, corpus, tmp_path):
    ranks, cut = CUTS[name]
    bpe = name in ("megatron_lm_gpt3_175b", "mds_universal_bf16", "mds_moe64")
    paths = {"CKPT": str(tmp_path / "ckpt"), "LOAD_CKPT": str(tmp_path / "load"), "TENSORBOARD": str(tmp_path / "tb"),
             "DATA_PATH": corpus["bpe_data"] if bpe else corpus["sp_data"], "VOCAB_FILE": corpus["vocab"],
             "MERGE_FILE": corpus["merges"], "TOKENIZER_MODEL": corpus["sp_model"],
             "DATA_CACHE": str(tmp_path / "cache")}
    if name in DS_BATCH:
        paths["DS_CONFIG"] = _ds_config(name, tmp_path)
    os.makedirs(tmp_path / "load", exist_ok=True)  # --save/--load dirs that do not exist yet: a first run
    argv = script_argv(name, paths)
    argv = refusals(argv)[1]
    present = set(argv)
    for flag, value in {**SMALL, **cut}.items():
        if flag in present or any(t.startswith(flag + "=") for t in argv):
            argv = replace_flag(argv, flag, value)
    if "--fp8-format" in present:  # FP8 on the CPU: torchao's emulated GEMMs
        argv = argv + ["--fp8-emulate"]
    if "--train-samples" in present:  # a sample-based script: 5 iterations of the cut global batch
        argv = replace_flag(argv, "--train-samples", str(5 * int(cut["--global-batch-size"])))
    return ranks, argv


def _universal_checkpoint_to_load(argv, ranks, tmp_path):
    """run_universal_bf16.sh resumes from a universal checkpoint of an earlier run (its README's steps): train
    the same model 5 iterations without --universal-checkpoint, convert with tools/ds_to_universal.py into
    the script's --load directory; the script then trains iterations 6 to 10. Both runs have --train-iters 10,
    the first stopping at --exit-interval 5, as the script's own runs share --train-iters and stop at its
    --exit-interval: the schedule a resume checks is the one saved."""
    argv = replace_flag(argv, "--train-iters", "10")
    first = replace_flag(replace_flag(argv, "--save", str(tmp_path / "first")), "--load", str(tmp_path / "first"))
    first = replace_flag(first, "--exit-interval", "5")
    run = torchrun(ranks, [t for t in first if t != "--universal-checkpoint"], timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    convert = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ds_to_universal.py"), "--input_folder",
                              str(tmp_path / "first" / "global_step5"), "--output_folder",
                              str(tmp_path / "load" / "global_step5_universal")], capture_output=True, text=True)
    assert convert.returncode == 0, convert.stderr
    (tmp_path / "load" / "latest_universal").write_text("global_step5_universal")
    return argv, 10


@pytest.mark.parametrize("name", sorted(CUTS))
def test_cut_down_script_trains_five_iterations(name, corpus, tmp_path):
    ranks, argv = cut_down_argv(name, corpus, tmp_path)
    last = 5
    if "--universal-checkpoint" in argv:
        argv, last = _universal_checkpoint_to_load(argv, ranks, tmp_path)
    run = torchrun(ranks, argv, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = losses_from_log(run.stdout)
    assert len(losses) >= 1 and all(loss == loss for loss in losses), run.stdout[-2000:]
    assert f"from iteration {last - 5} " in run.stdout, run.stdout[-2000:]
    assert re.search(rf"iteration\s+{last}/\s*{last} ", run.stdout), run.stdout[-2000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{last}"
    if "--step-batch-size-schedule" in argv:  # train_gpt3_175b_distributed.sh: the cut schedule's step at 4 samples
        assert "the global batch grows to 4 (4 micro-batches per step) at iteration 2" in run.stdout, run.stdout[-2000:]
    if "--decoupled-lr" in argv:  # train_llama3_8b_h100_fp8.sh: the embedding and output layer's own lr
        assert "decoupled learning rate:" in run.stdout, run.stdout[-2000:]
    if "--fp8-format" in argv:  # train_llama3_8b_h100_fp8.sh: the blocks' linear layers in FP8
        assert ("FP8 (hybrid, delayed scaling, amax history 1024 (max), emulated): 8 linear layers"
                in run.stdout), run.stdout[-2000:]
        # its --fp8-param-gather, kept: ZeRO-1 (DP2 here) all-gathers those layers' weights in FP8
        assert "; ZeRO all-gathers their weights in FP8" in run.stdout, run.stdout[-2000:]
    if "--profile" in argv:  # train_llama3_8b_h100_fp8.sh: a torch.profiler trace under --tensorboard-dir
        traces = [f for _, _, files in os.walk(tmp_path / "tb") for f in files if f.endswith(".pt.trace.json")]
        assert len(traces) == 1, traces
    if name == "mds_moe64":  # DeepSpeed-MoE's capacity gating in blocks 1, 3, ... (--expert-interval's default 2)
        assert "2-layer GPT-2 model with 4 experts per MoE layer (EP=2)" in run.stdout, run.stdout[-2000:]
        assert re.search(r"load_balancing_loss: [0-9.]+E[+-]\d+", run.stdout), run.stdout[-2000:]
    if "--loss-scale" in argv:  # run_universal_bf16.sh: a static scale with --bf16, as Megatron-LM applies it
        assert f"loss scale: {float(argv[argv.index('--loss-scale') + 1])} " in run.stdout

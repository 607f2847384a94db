"""Hugging Face GPT-2 import/export: tiny random GPT2LMHeadModels built here from configs, nothing downloaded.

Claims (fp32): our model on an imported checkpoint gives HF's logits (1e-5); HF -> ours -> HF is
bit-exact for safetensors, .bin and sharded inputs and at every --dtype; the imported checkpoint
loads at TP2 x PP2 (weights only, fresh optimizer) and its first training loss is HF's loss on
the same batch (1e-5).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.export.hf import gpt2
from megatron_zero.checkpoint.export.hf.exporter import export_hf
from megatron_zero.checkpoint.export.hf.importer import import_hf
from megatron_zero.testing import run_ranks
from megatron_zero.testing.hf_parity import SEQ, VOCAB, first_loss, hf_tensors, our_logits, tokens

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_model(seed=0, **overrides):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1,
                                  eos_token_id=VOCAB - 1, **overrides)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # non-trivial biases and norms, so every mapping counts
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_hf(tmp_path, name="hf", **kwargs):
    path = str(tmp_path / name)
    hf_model().save_pretrained(path, **kwargs)
    return path


def test_import_matches_hf_logits(tmp_path):
    src = save_hf(tmp_path)
    out = import_hf(src, str(tmp_path / "ckpt"))
    config = gpt2.config_from_hf(json.load(open(os.path.join(src, "config.json"))))
    toks = tokens()
    with torch.no_grad():
        want = hf_model()(toks).logits
    torch.testing.assert_close(our_logits(str(tmp_path / "ckpt"), config, toks), want, rtol=1e-5, atol=1e-5)
    assert out["flags"][:2] == ["--num-layers", "2"]
    assert open(tmp_path / "ckpt" / "megatron_flags.txt").read().split() == out["flags"]


@pytest.mark.parametrize("save", [dict(), dict(safe_serialization=False), dict(max_shard_size="20KB"), "base"],
                         ids=["safetensors", "bin", "sharded", "base-model-names"])
def test_round_trip_is_bit_exact(tmp_path, save):
    src = save_hf(tmp_path, **(save if isinstance(save, dict) else {}))
    if save == "base":  # as the Hub's gpt2 stores them: GPT2Model names, no `transformer.` prefix
        path = os.path.join(src, "model.safetensors")
        tensors = safetensors_torch.load_file(path)
        safetensors_torch.save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, path,
                                    metadata={"format": "pt"})
    import_hf(src, str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), max_shard_size="30KB")
    want = {k: v for k, v in hf_model().state_dict().items() if not k.endswith(".attn.bias") and k != "lm_head.weight"}
    got = hf_tensors(str(tmp_path / "back"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    index = json.load(open(tmp_path / "back" / "model.safetensors.index.json"))
    assert sorted(index["weight_map"]) == sorted(want)
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, hf_model()(tokens()).logits)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_round_trip(tmp_path, dtype):
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    src = str(tmp_path / "hf")
    hf_model().to(torch_dtype).save_pretrained(src)
    import_hf(src, str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), dtype=dtype)
    want, got = safetensors_torch.load_file(os.path.join(src, "model.safetensors")), hf_tensors(str(tmp_path / "back"))
    assert all(got[k].dtype == torch_dtype and torch.equal(got[k], want[k]) for k in got)
    assert json.load(open(tmp_path / "back" / "config.json"))["torch_dtype"] == {"bf16": "bfloat16",
                                                                                  "fp16": "float16"}[dtype]


def test_first_loss_at_tp2_pp2_equals_hf_loss(tmp_path):
    src = save_hf(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    import_hf(src, ckpt, tp=2, pp=2)
    config = gpt2.config_from_hf(json.load(open(os.path.join(src, "config.json"))))
    config.seq_length, config.hidden_dropout, config.attention_dropout = SEQ - 1, 0.0, 0.0
    config.make_vocab_size_divisible_by = 16
    losses = run_ranks(first_loss, 4, 2, 2, ckpt, config, timeout=300)
    toks = tokens(4)
    with torch.no_grad():
        want = hf_model()(toks, labels=toks).loss.item()  # HF shifts the labels itself
    assert all(abs(loss - want) <= 1e-5 * abs(want) for loss in losses), (losses, want)


def tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_tools_and_bad_input(tmp_path, capsys):
    src = save_hf(tmp_path)
    assert tool("convert_from_hf")(["--input-dir", src, "--output-dir", str(tmp_path / "ckpt"),
                                    "--tensor-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "--tensor-model-parallel-size 2" in out and "--hidden-size 32" in out
    assert tool("convert_to_hf")([str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "bf16"]) == 0
    assert json.load(open(tmp_path / "back" / "config.json"))["torch_dtype"] == "bfloat16"
    assert tool("convert_from_hf")(["--input-dir", src, "--output-dir", str(tmp_path / "c3"),
                                    "--tensor-model-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-model-parallel-size 3" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="activation_function 'relu'"):
        gpt2.config_from_hf({**json.load(open(os.path.join(src, "config.json"))), "activation_function": "relu"})
    with open(os.path.join(src, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(src, "model.safetensors")) - 1000)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        import_hf(src, str(tmp_path / "c5"))
    assert not os.path.exists(tmp_path / "c5")
    os.remove(os.path.join(src, "model.safetensors"))
    with pytest.raises(CheckpointError, match="holds none of"):
        import_hf(src, str(tmp_path / "c4"))


def test_import_trains_and_generates_with_hf_tokenizer(tmp_path):
    """convert_from_hf -> preprocess (HuggingFaceTokenizer) -> pretrain --load at TP2 -> generate_text."""
    from megatron_zero.testing.multirank import free_port
    from megatron_zero.testing.tiny_tokenizer import byte_level_bpe, corpus_texts

    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    byte_level_bpe(str(src), 300)
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(src))
    run = lambda *a, **kw: subprocess.run([sys.executable, *a], capture_output=True, text=True,  # noqa: E731
                                          timeout=300, **kw)
    done = run(os.path.join(ROOT, "tools", "convert_from_hf.py"), "--input-dir", str(src), "--output-dir",
               str(ckpt), "--tensor-model-parallel-size", "2")
    assert done.returncode == 0, done.stderr
    flags = open(ckpt / "megatron_flags.txt").read().split()
    assert flags[-4:] == ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(ckpt / "tokenizer")]
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in corpus_texts(10))
    done = run(os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(tmp_path / "docs.jsonl"),
               "--output-prefix", str(tmp_path / "docs"), "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", str(ckpt / "tokenizer"), "--append-eod")
    assert done.returncode == 0, done.stderr
    train = flags + ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
                     "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--split", "100,0,0",
                     "--data-path", str(tmp_path / "docs_text_document"), "--load", str(ckpt),
                     "--save", str(tmp_path / "save"), "--hidden-dropout", "0", "--attention-dropout", "0"]
    done = run("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               os.path.join(ROOT, "pretrain_gpt.py"), *train, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "from iteration 0" in done.stdout and len(re.findall(r"lm loss: ([0-9.E+-]+)", done.stdout)) == 2
    done = run(os.path.join(ROOT, "tools", "generate_text.py"), "--load", str(tmp_path / "save"), "--prompt",
               "The import statement", "--max-new-tokens", "4", "--greedy")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The import statement")


BOUNDED = r"""
import sys, torch, transformers
from megatron_zero.checkpoint.export.hf.exporter import export_hf
from megatron_zero.checkpoint.export.hf.importer import import_hf
def hwm():
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) * 1024
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) * 1024
root = sys.argv[1]
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=8192, n_positions=64, n_embd=512, n_layer=2,
                                                             n_head=8))
model.save_pretrained(root + "/st")
model.save_pretrained(root + "/bin", safe_serialization=False)
del model
import_hf(root + "/st", root + "/warm")  # first use: lazy imports and allocator pools
for what, run in (("safetensors", lambda: import_hf(root + "/st", root + "/a")),
                  ("bin", lambda: import_hf(root + "/bin", root + "/b")),
                  ("export", lambda: export_hf(root + "/a", root + "/back", max_shard_size="20MB"))):
    base = rss()
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    run()
    print(what, hwm() - base)
"""


def test_conversion_memory_is_about_one_tensor(tmp_path):
    """A 42 MB model (largest tensor: the 16 MiB word embedding) converts within 1.5x its largest tensor of RSS."""
    done = subprocess.run([sys.executable, "-c", BOUNDED, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    growth = {line.split()[0]: int(line.split()[1]) for line in done.stdout.splitlines() if line.strip()}
    assert set(growth) == {"safetensors", "bin", "export"}, done.stdout
    assert all(extra < 24 << 20 for extra in growth.values()), growth  # 1.5x the largest tensor

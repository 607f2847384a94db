#!/usr/bin/env python
"""Hugging Face import and export: time and peak RSS of ours against transformers in the same run.

A GPT2LMHeadModel or LlamaForCausalLM (--arch) of --size (random weights, built here) is saved with
save_pretrained (safetensors, 2 GB shards). Then, each in a fresh process (peak RSS = that process's
VmHWM, which includes importing torch):
    transformers from_pretrained     loads the HF directory into a model (what an import starts from)
    transformers save_pretrained     writes the loaded model back (what an export ends with)
    ours convert_from_hf             HF directory -> our weights-only universal checkpoint (streamed)
    ours convert_to_hf               that checkpoint -> HF directory, 2 GB shards (streamed)
Every output is checked: the exported tensors equal the source's, bit for bit.
The ratio column is ours / transformers (from_pretrained for import, save_pretrained for export).

    .venv/bin/python bench/bench_hf_convert.py [--arch gpt2|llama] [--size tiny|125m|1b] [--dir /tmp]
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {  # GPT-2 shapes; 1b: hidden 2048 x 16 layers, 0.91 B parameters (3.6 GB in fp32)
    "tiny": dict(n_embd=256, n_layer=4, n_head=8, vocab_size=50257, n_positions=1024),
    "125m": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    "1b": dict(n_embd=2048, n_layer=16, n_head=16, vocab_size=50257, n_positions=1024),
}
LLAMA_SIZES = {  # 1b: Llama-3.2-1B's shapes, tied as it is (1.24 B parameters, 4.6 GiB in fp32)
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=688, vocab_size=32000),
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
}
ARCHS = {"gpt2": ("GPT2LMHeadModel", "GPT2Config", SIZES), "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA_SIZES)}
MEASURE = """
import json, os, sys, time
sys.path.insert(0, {root!r})
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
import torch, transformers
{setup}
t0 = time.perf_counter()
{op}
print(json.dumps({{"seconds": time.perf_counter() - t0, "peak_mib": hwm()}}))
"""
CASES = {
    "transformers from_pretrained": ("", "m = transformers.{cls}.from_pretrained({src!r})"),
    "transformers save_pretrained": ("m = transformers.{cls}.from_pretrained({src!r})",
                                     "m.save_pretrained({out!r}, max_shard_size='2GB')"),
    "ours convert_from_hf": ("from megatron_zero.checkpoint.export.hf.importer import import_hf",
                             "import_hf({src!r}, {ckpt!r})"),
    "ours convert_to_hf": ("from megatron_zero.checkpoint.export.hf.exporter import export_hf",
                           "export_hf({ckpt!r}, {back!r}, max_shard_size='2GB')"),
}


def measure(name, paths):
    setup, op = CASES[name]
    code = MEASURE.format(root=ROOT, setup=setup.format(**paths), op=op.format(**paths))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def same_tensors(a_dir, b_dir):
    from safetensors import safe_open

    def index(d):
        files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
        return {n: os.path.join(d, f) for f in files for n in safe_open(os.path.join(d, f), "pt").keys()}
    a, b = index(a_dir), index(b_dir)
    a = {n: p for n, p in a.items() if not n.endswith(".attn.bias") and (n != "lm_head.weight" or n in b)}
    if sorted(a) != sorted(b):
        return False
    return all(safe_open(a[n], "pt").get_tensor(n).equal(safe_open(b[n], "pt").get_tensor(n)) for n in a)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=list(ARCHS), default="gpt2")
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument("--dir", default=None, help="scratch directory (needs about 4x the model's fp32 size)")
    a = p.parse_args()
    import torch
    import transformers

    tmp = tempfile.mkdtemp(dir=a.dir)
    cls, config_cls, sizes = ARCHS[a.arch]
    paths = {k: os.path.join(tmp, k) for k in ("src", "out", "ckpt", "back")}
    paths["cls"] = cls
    try:
        torch.manual_seed(0)
        model = getattr(transformers, cls)(getattr(transformers, config_cls)(**sizes[a.size]))
        params = sum(t.numel() for t in model.parameters())
        model.save_pretrained(paths["src"], max_shard_size="2GB")
        del model
        results = {name: measure(name, paths) for name in CASES}
        exact = same_tensors(paths["src"], paths["back"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"# {platform.node()} {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, {cls} --size {a.size}: "
          f"{params / 1e9:.3f} B parameters, fp32 {params * 4 / 2**30:.2f} GiB; round trip bit-exact: {exact}")
    print(f"{'step':<32}{'seconds':>9}{'peak RSS MiB':>14}{'time ratio':>12}{'RSS ratio':>11}")
    base = {"ours convert_from_hf": "transformers from_pretrained",
            "ours convert_to_hf": "transformers save_pretrained"}
    for name, r in results.items():
        ref = results.get(base.get(name, name))
        print(f"{name:<32}{r['seconds']:>9.2f}{r['peak_mib']:>14.0f}{r['seconds'] / ref['seconds']:>11.2f}x"
              f"{r['peak_mib'] / ref['peak_mib']:>10.2f}x")
    if not exact:
        raise SystemExit("the round trip changed the weights")


if __name__ == "__main__":
    main()

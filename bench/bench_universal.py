#!/usr/bin/env python
"""ds_to_universal and zero_to_fp32: ours against DeepSpeed 0.19's, same ~100M-parameter checkpoint, one run.

    .venv/bin/python bench/bench_universal.py [--hidden 768 --layers 12 --vocab 32000] [--keep DIR]

Builds a TP1 x PP1 x DP2 ZeRO-1 checkpoint of our GPT (one real training step, so the Adam
moments are non-zero; the layout DeepSpeed's zero_to_fp32 can also read), then runs each
tool as a subprocess and prints wall time and peak RSS summed over the tool's whole process
tree (sampled every 20 ms), plus the temporary files each conversion creates. zero_to_fp32 runs
`--reps` times per implementation, ours and DeepSpeed's interleaved; a row shows the median
time and the median peak RSS. The load average is printed before and after.
"""
import argparse
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_checkpoint(hidden, layers, vocab, save_dir):
    import torch
    from megatron_zero.checkpoint import save_checkpoint
    from megatron_zero.model.config import GPTConfig
    from megatron_zero.pipeline.gpt_stage import build_gpt_stage
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.training.trainer import param_groups
    from megatron_zero.zero import ZeroOptimizer

    state = build_parallel_state(1, 1)
    cfg = GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_attention_heads=12,
                    seq_length=32, max_position_embeddings=1024, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(param_groups(model, 0.01), dp_group=state.dp_group, stage=1, lr=1e-4,
                        mp_group=state.mp_group, tp_rank=0)
    tokens = torch.randint(0, vocab, (1, 33), generator=torch.Generator().manual_seed(state.rank))
    opt.backward(model(tokens[:, :-1], labels=tokens[:, 1:]))
    opt.step()
    save_checkpoint(save_dir, 1, state, model, opt,
                          {"iteration": 1, "args": {"num_attention_heads": 12}, "consumed_train_samples": 2})
    return sum(p.numel() for p in model.parameters())


def measure(cmd, env=None):
    """(seconds, peak RSS MiB of the process tree)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return seconds, peak / 2**20


def count_files(path):
    return sum(len(files) for _, _, files in os.walk(path))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=3, help="zero_to_fp32 runs per implementation (median shown)")
    p.add_argument("--fp32-only", action="store_true", help="skip the ds_to_universal rows")
    p.add_argument("--keep", default=None, help="work directory to keep (default: a temporary one, removed)")
    a = p.parse_args()
    work = a.keep or tempfile.mkdtemp(prefix="bench_universal_")
    os.makedirs(work, exist_ok=True)
    from megatron_zero.testing import run_ranks
    save = os.path.join(work, "ckpt")
    params = run_ranks(make_checkpoint, 2, a.hidden, a.layers, a.vocab, save, timeout=1200)[0]
    src = os.path.join(save, "global_step1")
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    py = sys.executable
    rows = []

    def once(cmd, out):
        result = measure(cmd, env)
        shutil.rmtree(out, ignore_errors=True)
        for f in ("latest_universal",):
            if os.path.exists(os.path.join(save, f)):
                os.remove(os.path.join(save, f))
        return result

    def run(what, who, cmd, out, temp=None):
        seconds, rss = once(cmd, out)
        rows.append((what, who, seconds, rss, temp))

    load_before = os.getloadavg()

    if not a.fp32_only:
        out = os.path.join(save, "u_ours")
        run("ds_to_universal", "megatron_zero", [py, os.path.join(ROOT, "tools", "ds_to_universal.py"),
            "--input_folder", src, "--output_folder", out, "--num_merge_workers", "2", "--num_extract_workers", "2",
            "--quiet"], out, 0)
        out = os.path.join(save, "u_ds")
        cmd = [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src, "--output_folder", out,
               "--num_extract_workers", "2", "--num_merge_workers", "2"]
        seconds, rss = measure(cmd + ["--keep_temp_folder"], env)  # once to count its temporary files
        temp = count_files(os.path.join(out, "tmp"))
        shutil.rmtree(out)
        run("ds_to_universal", "DeepSpeed 0.19.8", cmd, out, temp)
    for fmt, extra in (("pytorch_model.bin", []), ("safetensors", ["--safe_serialization"])):
        ours_out, ds_out = os.path.join(work, "fp32_ours"), os.path.join(work, "fp32_ds")
        ours = [py, os.path.join(ROOT, "tools", "zero_to_fp32.py"), save, ours_out, "--quiet"] + extra  # 5GB shards
        theirs = [py, "-m", "deepspeed.utils.zero_to_fp32", save, ds_out] + extra
        runs = {"ours": [], "ds": []}
        for _ in range(a.reps):  # interleaved, so both see the same background load
            runs["ours"].append(once(ours, ours_out))
            runs["ds"].append(once(theirs, ds_out))
        for who, key in (("megatron_zero", "ours"), ("DeepSpeed 0.19.8", "ds")):
            rows.append((f"zero_to_fp32 ({fmt})", who, statistics.median(r[0] for r in runs[key]),
                         statistics.median(r[1] for r in runs[key]), None))
    print(f"\ncheckpoint: {params / 1e6:.1f}M parameters, TP1 x PP1 x DP2 ZeRO-1, {size / 2**20:.0f} MiB on disk; "
          f"{os.cpu_count()} cores; zero_to_fp32 median of {a.reps}; load average {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after\n")
    print("| tool | implementation | time (s) | peak RSS (MiB) | temporary files | time ratio | RSS ratio |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for i in range(0, len(rows), 2):
        ours, theirs = rows[i], rows[i + 1]
        for r in (ours, theirs):
            ratio = (f"{r[2] / theirs[2]:.2f}", f"{r[3] / theirs[3]:.2f}")
            temp = "" if r[4] is None else str(r[4])
            print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.0f} | {temp} | {ratio[0]} | {ratio[1]} |")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

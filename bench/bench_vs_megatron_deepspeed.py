"""Training throughput (tokens/s) of our pretrain_gpt.py against Megatron-DeepSpeed's, same model, data and layout.

    bash bench/peers/setup_megatron_deepspeed.sh        # once: MDS tree, venv, shims, shm op (outside the repo)
    .venv/bin/python bench/bench_vs_megatron_deepspeed.py --mds-dir /work/mds_src \
        --mds-python /work/mds_venv/bin/python [--reps 3] [--iters 12] [--warmup 2] [--layouts dp2,tp2,pp2,tp2pp2]

Both sides train the same GPT (4 layers, hidden 256, 8 heads, seq 256, RMSNorm (Megatron-DeepSpeed's
LayerNorm path crashes on the CPU), GeLU MLP, learned positions, tied embeddings, no dropout), fp32, micro-batch
4, global batch 16 (4096 tokens a step), Adam lr 1e-3, gradient clipping 1.0, on the same indexed dataset
(tools/build_corpus.py's .bin/.idx) and SentencePiece model (GPTSentencePieceTokenizer on both sides), one
thread per rank, gloo, launched with torchrun. Layouts: DP2 with ZeRO-1 on both sides, TP2, PP2, TP2xPP2
(ZeRO stage 0 on both sides where DP is 1); dp2moe: DP2 ZeRO-1 with every second MLP a DeepSpeed-MoE layer of
4 experts over EP2, Megatron-DeepSpeed's MoE flags on both sides (LAYOUT_FLAGS). Megatron-DeepSpeed runs through
DeepSpeed with its documented CPU flags (bench/peers/setup_megatron_deepspeed.sh; why each is needed: bench/peers/README.md).

Each launch trains `--warmup + --iters` iterations, logging every iteration; both print Megatron's
"elapsed time per iteration (ms)", the wall time of the iteration on the last rank. The first `--warmup`
iterations are dropped; a launch's tokens/s is 4096 x iters / the sum of its remaining times. Per layout the
launches are interleaved, ours then MDS, `--reps` times (the order flipped every other rep), so both sides
share the machine's noise; the table gives the median over reps, the spread (min-max over reps) and the
ratio of the medians. The loss after the last iteration shows both trained (different initial weights).
"""
import argparse
import glob
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zero.testing.multirank import free_port  # noqa: E402

MODEL = {"num-layers": 4, "hidden-size": 256, "num-attention-heads": 8, "seq-length": 256,
         "max-position-embeddings": 256, "micro-batch-size": 4, "global-batch-size": 16, "lr": 1e-3,
         "clip-grad": 1.0, "hidden-dropout": 0.0, "attention-dropout": 0.0, "seed": 1234, "log-interval": 1,
         "eval-iters": 0, "eval-interval": 10 ** 6, "split": "100,0,0",
         "tokenizer-type": "GPTSentencePieceTokenizer"}
TOKENS_PER_ITER = 16 * 256
LAYOUTS = {"dp2": (1, 1, 2), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "tp2pp2": (2, 2, 1), "tp1": (1, 1, 1),
           "dp2moe": (1, 1, 2)}  # tp, pp, dp
LABELS = {"dp2": "DP2 ZeRO-1", "tp2": "TP2", "pp2": "PP2", "tp2pp2": "TP2 x PP2", "tp1": "one rank",
          "dp2moe": "MoE EP2 x DP2 ZeRO-1"}
# dp2moe: every second MLP (--expert-interval's default, 2) a DeepSpeed-MoE layer, Megatron-DeepSpeed's flags on
# both sides (its examples_deepspeed/MoE scripts' gating: top-2, capacity factor 1, min capacity 4, aux loss
# 0.01), 4 experts over EP2 with their own parameter group
LAYOUT_FLAGS = {"dp2moe": ["--num-experts", "4", "--moe-expert-parallel-size", "2", "--topk", "2",
                           "--moe-loss-coeff", "0.01", "--moe-train-capacity-factor", "1.0", "--moe-min-capacity", "4",
                           "--create-moe-param-group"]}
# Megatron-DeepSpeed's flags for a CPU (bench/peers/README.md): no fused CUDA kernels, gloo, RMSNorm
MDS_CPU_FLAGS = ["--distributed-backend", "gloo", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                 "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]
ITER_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")


def flags(d: dict) -> list:
    out = []
    for k, v in d.items():
        out += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    return out


def ours_cmd(layout, data, iters, model=MODEL, extra=()):
    tp, pp, dp = LAYOUTS[layout]
    argv = flags({**model, **data, "train-iters": iters, "tensor-model-parallel-size": tp,
                  "pipeline-model-parallel-size": pp, "zero-stage": 1 if dp > 1 else 0,
                  "normalization": "RMSNorm"}) + list(extra)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp * dp),
            "--master_port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py")] + argv, ROOT


def mds_cmd(layout, data, iters, mds_dir, mds_python, workdir, model=MODEL, extra=()):
    tp, pp, dp = LAYOUTS[layout]
    cfg = os.path.join(workdir, f"ds_{layout}.json")
    with open(cfg, "w") as f:
        json.dump({"train_batch_size": model["global-batch-size"],
                   "train_micro_batch_size_per_gpu": model["micro-batch-size"], "gradient_clipping": 1.0,
                   "zero_optimization": {"stage": 1 if dp > 1 else 0}, "steps_per_print": 10 ** 9,
                   "wall_clock_breakdown": False}, f)
    argv = flags({**model, **data, "train-iters": iters, "tensor-model-parallel-size": tp,
                  "pipeline-model-parallel-size": pp, "normalization": "rmsnorm"}) + list(extra)
    argv += MDS_CPU_FLAGS + ["--deepspeed", "--deepspeed_config", cfg] + (["--no-pipeline-parallel"] if pp == 1 else [])
    return [mds_python, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp * dp),
            "--master_port", str(free_port()), os.path.join(mds_dir, "pretrain_gpt.py")] + argv, mds_dir


def launch_env(cwd, nproc, ext_dir):
    """The environment of a launch from `cwd` (ROOT: ours) with `nproc` ranks."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(nproc),
            "TORCH_EXTENSIONS_DIR": ext_dir, "PYTHONPATH": ROOT if cwd == ROOT else ""}


def remove_shm_buffers(cmd):
    """DeepSpeed's shm comm op leaves its buffers in /dev/shm, named by the launch's port: delete them."""
    port = cmd[cmd.index("--master_port") + 1]
    for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        os.unlink(leftover)


def run(cmd, cwd, nproc, ext_dir, timeout):
    try:
        p = subprocess.run(cmd, cwd=cwd, env=launch_env(cwd, nproc, ext_dir), capture_output=True, text=True,
                           timeout=timeout)
    finally:
        remove_shm_buffers(cmd)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd[:6])} ... failed (exit {p.returncode}):\n{out[-3000:]}")
    return out


def measure(out, warmup, iters):
    """(tokens/s over the iterations after the warm-up, last loss) from one launch's log."""
    times = {}
    for line in out.splitlines():
        m = ITER_MS.search(line)
        if m:
            times[int(m.group(1))] = float(m.group(2))
            loss = LOSS.search(line)
    kept = [times[i] for i in range(warmup + 1, warmup + iters + 1) if i in times]
    if len(kept) != iters:
        sys.exit(f"bench: found {len(kept)} of {iters} timed iteration lines in a log:\n{out[-2000:]}")
    return TOKENS_PER_ITER * iters / (sum(kept) / 1e3), float(loss.group(1))


def build_data(workdir):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_corpus.py"), "--output-dir",
                          os.path.join(workdir, "corpus")], capture_output=True, text=True, check=True).stdout
    env = dict(line.split("=", 1) for line in out.split())
    return {"data-path": env["DATA_PATH"], "tokenizer-model": env["TOKENIZER_MODEL"]}


def machine():
    model = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    import torch
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, python {platform.python_version()}"


def mds_arguments(description):
    """An argument parser with the flags that locate Megatron-DeepSpeed (--mds-dir, --mds-python, its extensions)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--mds-dir", required=True, help="Megatron-DeepSpeed source tree (set up by "
                                                     "bench/peers/setup_megatron_deepspeed.sh)")
    ap.add_argument("--mds-python", required=True, help="the python of Megatron-DeepSpeed's venv")
    ap.add_argument("--torch-extensions-dir", default=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                                     "/work/mds_torch_extensions"))
    return ap


def check_mds(a):
    """Exit with one sentence unless --mds-dir and --mds-python point at a set-up Megatron-DeepSpeed."""
    if not os.path.isfile(os.path.join(a.mds_dir, "pretrain_gpt.py")) or not os.access(a.mds_python, os.X_OK):
        sys.exit("bench: --mds-dir must hold Megatron-DeepSpeed's pretrain_gpt.py and --mds-python be its venv's "
                 "python; run bench/peers/setup_megatron_deepspeed.sh first")


def main():
    ap = mds_arguments(__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12, help="timed iterations per launch")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations at the start of each launch")
    ap.add_argument("--layouts", default="dp2,tp2,pp2,tp2pp2")
    ap.add_argument("--timeout", type=int, default=600)
    a = ap.parse_args()
    layouts = [x for x in a.layouts.split(",") if x]
    for x in layouts:
        if x not in LAYOUTS:
            sys.exit(f"bench: --layouts: unknown layout {x!r}; choose from {', '.join(LAYOUTS)}")
    check_mds(a)
    print(f"machine: {machine()}; reps {a.reps} (interleaved), {a.warmup} warm-up + {a.iters} timed iterations "
          f"per launch, {TOKENS_PER_ITER} tokens per iteration")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        data = build_data(work)
        n = a.warmup + a.iters
        for layout in layouts:
            tp, pp, dp = LAYOUTS[layout]
            res = {"ours": [], "mds": []}
            for rep in range(a.reps):
                for side in (("ours", "mds") if rep % 2 == 0 else ("mds", "ours")):
                    extra = LAYOUT_FLAGS.get(layout, ())
                    cmd, cwd = (ours_cmd(layout, data, n, extra=extra) if side == "ours" else
                                mds_cmd(layout, data, n, a.mds_dir, a.mds_python, work, extra=extra))
                    tps, loss = measure(run(cmd, cwd, tp * pp * dp, a.torch_extensions_dir, a.timeout),
                                        a.warmup, a.iters)
                    res[side].append((tps, loss))
                    print(f"  {LABELS[layout]:<11} rep {rep + 1} {side:<4} {tps:7.0f} tokens/s  loss {loss:.4f}",
                          flush=True)
            rows.append((layout, res))
    print()
    print("| layout | ours tok/s (min-max) | Megatron-DeepSpeed tok/s (min-max) | ours / MDS | last loss ours / MDS |")
    print("|---|---|---|---|---|")
    for layout, res in rows:
        cells = []
        for side in ("ours", "mds"):
            t = [r[0] for r in res[side]]
            cells.append((statistics.median(t), min(t), max(t)))
        (mo, lo, ho), (mm, lm, hm) = cells
        print(f"| {LABELS[layout]} | {mo:.0f} ({lo:.0f}-{ho:.0f}) | {mm:.0f} ({lm:.0f}-{hm:.0f}) | {mo / mm:.2f} | "
              f"{res['ours'][-1][1]:.3f} / {res['mds'][-1][1]:.3f} |")


if __name__ == "__main__":
    main()

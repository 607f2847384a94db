"""The 16-bit model at save time: ours (every rank streams its run from the checkpoint) vs DeepSpeed's
save_16bit_model (ZeRO-3 gathers every parameter, rank 0 builds the state dict and torch.saves it).

    .venv/bin/python bench/bench_save_16bit.py [--layers 12 --hidden 768 --vocab 32000]

A GPT in bf16 with ZeRO-3 on 2 gloo CPU ranks, after one training step; each side runs on 2 fresh
ranks (ours: model + ZeroOptimizer; DeepSpeed: an engine of the same model). Ours is timed after the checkpoint
it reads is saved (the save itself is not counted: the 16-bit model rides on it). Each rank reports
seconds and peak extra RSS (sampled every 2 ms, minus before): anonymous memory (what the save holds)
and total (also the checkpoint's pages we map while reading, which the kernel can drop); a row shows
the slowest rank and the worst rank's RSS, in MiB and as a fraction of the bf16 model's size.
DeepSpeed JIT-builds a shared-memory comm op on first use (minutes; TORCH_EXTENSIONS_DIR).
"""
import argparse
import os
import platform
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_checkpoint_save import batch, config, dir_bytes  # noqa: E402
from megatron_zero.testing.host_memory import anon_and_rss as memory, measured  # noqa: E402
from megatron_zero.testing.multirank import run_ranks  # noqa: E402


def deepspeed_engine(cfg, tokens, labels):
    import deepspeed
    from megatron_zero.model.gpt import GPTModel

    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
              "steps_per_print": 10 ** 9}
    model = GPTModel(cfg)  # deepspeed.initialize partitions it (ZeRO-3); zero.Init hangs on gloo here
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    engine.backward(engine(tokens, labels=labels))
    engine.step()
    return engine


def ours(a, root):
    from megatron_zero.checkpoint import save_checkpoint
    from megatron_zero.checkpoint.export.save_16bit import save_16bit_model
    from megatron_zero.model.gpt import GPTModel
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.zero import ZeroOptimizer

    state = build_parallel_state(1, 1)
    cfg = config(a)
    model = GPTModel(cfg)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=3, lr=1e-4, dtype="bf16",
                        module=model)
    tokens, labels = batch(cfg)
    opt.backward(model(tokens, labels=labels))
    opt.step()
    save_checkpoint(os.path.join(root, "ours"), 1, state, model, opt, {"iteration": 1})
    dist.barrier()
    out = measured(lambda: save_16bit_model(os.path.join(root, "ours", "global_step1"), torch.bfloat16), memory)
    dist.barrier()
    return out + (dir_bytes(os.path.join(root, "ours", "global_step1", "model_16bit")),)


def deepspeed_run(a, root):
    cfg = config(a)
    tokens, labels = batch(cfg)
    engine = deepspeed_engine(cfg, tokens, labels)
    dist.barrier()
    out = measured(lambda: engine.save_16bit_model(os.path.join(root, "ds"), "pytorch_model.bin"), memory)
    dist.barrier()
    return out + (dir_bytes(os.path.join(root, "ds")),)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-16bit-", dir=os.path.dirname(os.path.abspath(__file__)))
    try:
        from megatron_zero.model.gpt import GPTModel
        params = sum(t.numel() for t in GPTModel(config(a)).parameters())
        largest = max(t.numel() for t in GPTModel(config(a)).parameters())
        model_mib = params * 2 / 2**20
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; GPT {a.layers} layers, "
              f"hidden {a.hidden}, vocab {a.vocab}: {params / 1e6:.1f}M params ({model_mib:.0f} MiB in bf16, largest "
              f"parameter {largest / 1e6:.1f}M), bf16, ZeRO-3, DP 2 (gloo), load {os.getloadavg()[0]:.1f}")
        res = {"ours": run_ranks(ours, 2, a, root, timeout=1800),  # separate processes: each starts from
               "deepspeed": run_ranks(deepspeed_run, 2, a, root, timeout=1800)}  # a fresh RSS baseline
        print("| 16-bit model save | seconds | MiB written | peak extra anon RSS, worst rank (MiB) | / bf16 model "
              "| peak extra total RSS (MiB, incl. mapped files) |")
        print("|---|---:|---:|---:|---:|---:|")
        rows = {}
        for key, label in (("ours", "megatron_zero save_16bit_model (streamed, every rank)"),
                           ("deepspeed", "DeepSpeed 0.19 engine.save_16bit_model")):
            secs, extra, total = (max(r[i] for r in res[key]) for i in range(3))
            rows[key] = (secs, extra)
            print(f"| {label} | {secs:.2f} | {res[key][0][3] / 2**20:.0f} | {extra / 2**20:.0f} | "
                  f"{extra / 2**20 / model_mib:.2f} | {total / 2**20:.0f} |")
        print(f"\nratio ours / DeepSpeed: time {rows['ours'][0] / rows['deepspeed'][0]:.2f}x, "
              f"peak extra anonymous RSS {rows['ours'][1] / max(1, rows['deepspeed'][1]):.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

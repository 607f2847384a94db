"""ZeRO++ accuracy and bytes: ZeRO-3 with qwZ, qgZ and both against unquantized ZeRO-3, in one run.

    .venv/bin/python bench/bench_zeropp.py [--steps 20] [--lr 1e-3] [--vocab 2048]

bench_zero_throughput.py's model (GPT, vocab 2048, hidden 256, 4 layers, 8 heads, seq 256, fp32),
DP 2 on gloo CPU ranks, micro-batch 4, AdamW, clipping 1.0, persistence threshold 1e5 (DeepSpeed's
default), the same token batches for every variant. Printed per variant: the loss at a few steps,
the largest relative difference of a step's loss from the unquantized run's over all steps, and
the bytes rank 0 sent in weight all-gathers and gradient reduce-scatters (and the ratio).
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_zero_throughput import CLIP, LR, MICRO, SEQ, WD, config  # noqa: E402

from megatron_zero.testing.multirank import run_ranks  # noqa: E402

VARIANTS = {"ZeRO-3": {}, "qwZ": {"quantized_weights": True}, "qgZ": {"quantized_gradients": True},
            "qwZ+qgZ": {"quantized_weights": True, "quantized_gradients": True}}


def run(n_steps, vocab, lr):
    import torch
    import torch.distributed as dist
    from megatron_zero.model.gpt import reference_model
    from megatron_zero.zero import ZeroOptimizer

    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    data = [torch.randint(0, vocab, (MICRO, SEQ + 1), generator=g) for _ in range(4)]  # cycled
    out = {}
    for name, zeropp in VARIANTS.items():
        model = reference_model(config(vocab))
        opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=3, lr=lr,
                            weight_decay=WD, clip_grad=CLIP, module=model, **zeropp)
        losses = []
        for step in range(n_steps):
            mb = data[step % len(data)]
            loss = model(mb[:, :-1], labels=mb[:, 1:])
            opt.backward(loss)
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
        out[name] = (losses, dict(opt.impl.comm_bytes))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=LR)
    a = ap.parse_args()
    res = run_ranks(run, 2, a.steps, a.vocab, a.lr, timeout=1800)[0]
    base, base_bytes = res["ZeRO-3"]
    marks = sorted({0, a.steps // 4, a.steps // 2, a.steps - 1})
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, DP 2, {a.steps} steps, lr {a.lr}")
    print("| variant | " + " | ".join(f"loss @{s + 1}" for s in marks) +
          " | max rel. loss diff | all-gather bytes (ratio) | reduce-scatter bytes (ratio) |")
    print("|---" * (len(marks) + 4) + "|")
    for name, (losses, sent) in res.items():
        rel = max(abs(x - y) / abs(y) for x, y in zip(losses, base))
        ag, rs = sent["all_gather"], sent["reduce_scatter"]
        print(f"| {name} | " + " | ".join(f"{losses[s]:.4f}" for s in marks) + f" | {rel:.1e} | "
              f"{ag} ({ag / base_bytes['all_gather']:.2f}) | {rs} ({rs / base_bytes['reduce_scatter']:.2f}) |")


if __name__ == "__main__":
    main()

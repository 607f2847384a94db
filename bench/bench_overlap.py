"""Tokens/s of ZeRO 0/1/2 with --overlap-grad-reduce (and --overlap-param-gather at stage 1/2) against
the same stage blocking, in the same run.

    .venv/bin/python bench/bench_overlap.py [--steps 8] [--warmup 2] [--rounds 3] [--stages 0,1,2]
                                            [--bucket 2000000]

bench_zero_throughput.py's model and data (GPT, vocab 2048, hidden 256, 4 layers, 8 heads, seq 256,
fp32, micro-batch 4, gradient accumulation 2, DP 2 on gloo CPU ranks, one thread per rank), the
schedule's forward_backward (which arms the overlapped reduce before the last micro-batch's
backward) and the optimizer step. Per stage, blocking and overlapped launches alternate, the order
reversed each round; a step's time is the slowest rank's; the table gives the median over all
timed steps and the ratio overlapped / blocking. The last column, the loss after the last step,
must be the same on both sides (the overlapped path is bit-identical at DP 2).
"""
import argparse
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_zero_throughput import CLIP, DP, GA, LR, MICRO, SEQ, WD, batches, config, timed_loop  # noqa: E402

from megatron_zero.testing.multirank import run_ranks  # noqa: E402


def run(stage, overlap, n_steps, vocab, bucket):
    import torch.distributed as dist
    from megatron_zero.model.gpt import reference_model
    from megatron_zero.pipeline.schedule import forward_backward
    from megatron_zero.zero import ZeroOptimizer

    model = reference_model(config(vocab))
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=stage, lr=LR,
                        weight_decay=WD, clip_grad=CLIP, module=model, bucket_size=bucket,
                        overlap_grad_reduce=overlap, overlap_param_gather=overlap and stage > 0)
    data = batches(n_steps, vocab)

    def step(i):
        def forward_step(j, _):
            mb = data[i][j]
            return model(mb[:, :-1], labels=mb[:, 1:]) / GA

        losses = forward_backward(forward_step, GA, None, 0, 1, backward_loss=opt.backward,
                                  before_last_backward=opt.arm_grad_reduce)
        opt.step()
        return float(sum(losses))

    return timed_loop(step, n_steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8, help="steps per launch (warm-up included)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stages", default="0,1,2")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--bucket", type=int, default=2_000_000, help="bucket size in elements (both sides)")
    a = ap.parse_args()
    tokens = MICRO * GA * DP * SEQ
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, DP {DP}, bucket {a.bucket}")
    print("| stage | blocking tok/s | overlapped tok/s | overlapped / blocking | loss (blocking, overlapped) |")
    print("|---|---|---|---|---|")
    for stage in [int(s) for s in a.stages.split(",")]:
        walls, last = {False: [], True: []}, {}
        for rnd in range(a.rounds):
            for overlap in ((False, True) if rnd % 2 == 0 else (True, False)):
                per_rank = run_ranks(run, DP, stage, overlap, a.steps, a.vocab, a.bucket, timeout=900)
                walls[overlap] += [max(r[0][i] for r in per_rank) for i in range(a.warmup, a.steps)]
                last[overlap] = per_rank[0][2]
        base, over = (tokens / statistics.median(walls[k]) for k in (False, True))
        print(f"| {stage} | {base:.0f} | {over:.0f} | {over / base:.2f} | {last[False]:.6f}, {last[True]:.6f} |",
              flush=True)


if __name__ == "__main__":
    main()

"""Time per iteration of plain 1F1B against interleaved 1F1B (--num-layers-per-virtual-pipeline-stage)
at PP 2, in the same run.

    .venv/bin/python bench/bench_interleaved.py [--steps 6] [--warmup 2] [--rounds 3] [--micro-batches 4]
                                                [--layers 4]

bench_zero_throughput.py's model (GPT, vocab 2048, hidden 256, 8 heads, seq 256, fp32, dropout 0,
micro-batch 4), --layers layers over PP 2 on gloo CPU ranks (one thread each), M micro-batches a
step (the bubble of plain 1F1B is (PP - 1) / (M + PP - 1) of a step; interleaving v chunks divides
it by about v), ZeRO-1 at DP 1 (AdamW). Plain and interleaved launches alternate, the order reversed
each round; a step's time is the slowest rank's; the table gives the median over the timed steps and
the ratio. The last column, the loss after the last step, must agree between the two.
"""
import argparse
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_zero_throughput import HEADS, HIDDEN, LR, MICRO, SEQ, WD, timed_loop  # noqa: E402

from megatron_zero.testing.multirank import run_ranks  # noqa: E402

PP, VOCAB = 2, 2048


def run(virtual_stages, layers, m, n_steps):
    import torch
    from megatron_zero.model.config import GPTConfig
    from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage, stage_p2p
    from megatron_zero.testing.train_step import pipeline_train_step
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.zero import ZeroOptimizer

    cfg = GPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=layers, num_attention_heads=HEADS,
                    seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    state = build_parallel_state(tp=1, pp=PP)
    model = build_gpt_stage(cfg, state, virtual_stages=virtual_stages)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=1, lr=LR, weight_decay=WD,
                        mp_group=state.mp_group)
    p2p = stage_p2p(state, activation_shape(MICRO, cfg), torch.float32, virtual_stages=virtual_stages)
    g = torch.Generator().manual_seed(1234)
    data = [[torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g) for _ in range(m)] for _ in range(n_steps)]

    def step(i):
        micro = [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in data[i]]
        return pipeline_train_step(model, opt, state, p2p, micro)[0]

    return timed_loop(step, n_steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="steps per launch (warm-up included)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    v = a.layers // PP  # one layer per virtual stage
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, PP {PP}, {a.layers} layers, {a.micro_batches} micro-batches")
    print("| schedule | s / iteration | interleaved / plain | loss after the last step |")
    print("|---|---|---|---|")
    walls, last = {1: [], v: []}, {}
    for rnd in range(a.rounds):
        for chunks in ((1, v) if rnd % 2 == 0 else (v, 1)):
            per_rank = run_ranks(run, PP, chunks, a.layers, a.micro_batches, a.steps, timeout=900)
            walls[chunks] += [max(r[0][i] for r in per_rank) for i in range(a.warmup, a.steps)]
            last[chunks] = per_rank[0][2]
    plain = statistics.median(walls[1])
    for chunks, name in ((1, "1F1B"), (v, f"interleaved 1F1B, v = {v}")):
        t = statistics.median(walls[chunks])
        spread = f"{min(walls[chunks]):.3f}-{max(walls[chunks]):.3f}"
        print(f"| {name} | {t:.3f} ({spread}) | {t / plain:.2f} | {last[chunks]:.6f} |", flush=True)


if __name__ == "__main__":
    main()

"""Training throughput (tokens/s) of our ZeRO stages 0-3 against DeepSpeed's ZeRO engine at the same stage.

    .venv/bin/python bench/bench_zero_throughput.py [--steps 10] [--warmup 3] [--rounds 2] [--stages 0,1,2,3]
                                                   [--ds-optimizers torch_adam,default] [--vocab 2048]

The same GPT-2-style model (megatron_zero's GPTModel, vocab 2048, hidden 256, 4 layers,
8 heads, seq 256: 3.75M params; --vocab 8192 gives 5.3M), fp32, dropout 0, the
same random tokens (fixed seed, different per rank), micro-batch 4, gradient accumulation 2,
DP 2 on gloo CPU ranks (global batch 16 sequences = 4096 tokens a step), AdamW (lr 1e-3,
weight decay 0.01), gradient clipping 1.0 on both sides; everything else at its default.

  ours:      ZeroOptimizer(stage=s, module=model); per micro-batch
             opt.backward(model(tokens, labels=labels) / GA); then opt.step()
  DeepSpeed: deepspeed.initialize(model=<the GPT, forward(batch) -> loss>, zero stage s,
             AdamW with torch_adam: true (torch.optim.AdamW, what ours steps with), and
             AdamW with DeepSpeed's default FusedAdam if its op builds here (the first build
             JIT-compiles it: a few minutes, once); per micro-batch
             engine.backward(engine(batch)); engine.step()

Each (side, stage) is its own 2-rank launch (run_ranks: gloo group on a free port,
torch.set_num_threads(1) per rank), `--rounds` launches each with `--warmup` untimed steps
and steps/rounds timed ones; per stage the launches are interleaved (ours, DeepSpeed, ...,
the order reversed every round) so both sides share the machine's noise. A step's wall time
is the slowest rank's; tokens/s = 4096 / median step over all timed steps. Also reported:
tokens per CPU-second (process CPU time of both ranks, gloo's threads included), which
moves much less than wall time when other jobs load the machine. The last column, the loss
after the last step, shows both sides did the same work (same weights, data and update).
"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from megatron_zero.testing.multirank import run_ranks  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 2048, 256, 4, 8, 256
MICRO, GA, DP = 4, 2, 2
LR, WD, CLIP, SEED = 1e-3, 0.01, 1.0, 1234


def config(vocab):
    from megatron_zero.model.config import GPTConfig
    return GPTConfig(vocab_size=vocab, hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=HEADS,
                     seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                     seed=SEED)


def batches(n_steps, vocab):
    """[step][micro] -> LongTensor [MICRO, SEQ + 1], this rank's share of the global batch."""
    import torch.distributed as dist
    g = torch.Generator().manual_seed(SEED + dist.get_rank())
    return [[torch.randint(0, vocab, (MICRO, SEQ + 1), generator=g) for _ in range(GA)] for _ in range(n_steps)]


def timed_loop(step_fn, n_steps):
    """Run step_fn(i) for every step; -> (per-step wall seconds, per-step CPU seconds of this
    process (all its threads, gloo's included), last loss)."""
    import torch.distributed as dist
    wall, cpu, loss = [], [], None
    dist.barrier()
    for i in range(n_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step_fn(i)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu, loss


def run_ours(stage, n_steps, vocab):
    import torch.distributed as dist
    from megatron_zero.model.gpt import reference_model
    from megatron_zero.zero import ZeroOptimizer

    model = reference_model(config(vocab))
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=stage, lr=LR,
                        weight_decay=WD, clip_grad=CLIP, module=model)
    data = batches(n_steps, vocab)

    def step(i):
        total = 0.0
        for mb in data[i]:
            loss = model(mb[:, :-1], labels=mb[:, 1:]) / GA
            opt.backward(loss)
            total += loss.item()
        opt.step()
        return total

    return timed_loop(step, n_steps) + ("AdamW",)


class LossModule(torch.nn.Module):
    """Our GPT with a forward DeepSpeed's engine can call on one batch: batch -> mean loss."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, batch):
        return self.gpt(batch[:, :-1], labels=batch[:, 1:])


def run_deepspeed(stage, n_steps, vocab, ds_optimizer):
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated collective names
    import deepspeed
    from deepspeed.utils import logger as ds_logger
    from megatron_zero.model.gpt import reference_model

    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # finds the process group run_ranks made
    gpt = reference_model(config(vocab))
    model = LossModule(gpt)
    params = {"lr": LR, "weight_decay": WD}
    if ds_optimizer == "torch_adam":
        params["torch_adam"] = True
    ds_cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
              "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": params},
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    if stage == 3:
        # lm_logits uses the tied word embedding outside Embedding.forward: have GPTModel's
        # forward (and backward) gather it, as DeepSpeed asks for parameters used outside their module
        deepspeed.zero.register_external_parameter(gpt, gpt.embedding.word_embeddings.weight)
    data = batches(n_steps, vocab)

    def step(i):
        total = 0.0
        for mb in data[i]:
            loss = engine(mb)
            engine.backward(loss)
            engine.step()  # a no-op apart from the accumulation boundary
            total += loss.item() / GA
        return total

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the basic optimizer
    return timed_loop(step, n_steps) + (f"{type(inner).__module__}.{type(inner).__name__}",)


def lscpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ds_fused_adam_builds():
    """Whether DeepSpeed's own (Fused)Adam op builds/loads on this machine: (ok, why not)."""
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder
        FusedAdamBuilder().load(verbose=False)
        return True, ""
    except Exception as e:  # no compiler, no ninja, ...
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


SIDES = {"ours": "ours (ZeroOptimizer, torch AdamW)",
         "torch_adam": "DeepSpeed (AdamW, torch_adam: true)",
         "default": "DeepSpeed (AdamW, its default FusedAdam)"}


def launch(side, stage, n_steps, vocab):
    if side == "ours":
        return run_ranks(run_ours, DP, stage, n_steps, vocab, timeout=900)
    return run_ranks(run_deepspeed, DP, stage, n_steps, vocab, side, timeout=900)


def summarise(launches, warmup):
    """Pool the timed steps of every launch: a step's wall time is the slowest rank's, its CPU
    time the sum over ranks. -> tokens/s (median wall), tokens per CPU-second (median CPU)."""
    wall, cpu = [], []
    for per_rank in launches:
        steps = len(per_rank[0][0])
        wall += [max(r[0][i] for r in per_rank) for i in range(warmup, steps)]
        cpu += [sum(r[1][i] for r in per_rank) for i in range(warmup, steps)]
    tokens = MICRO * GA * DP * SEQ
    return {"tok_s": tokens / statistics.median(wall), "tok_cpu_s": tokens / statistics.median(cpu),
            "loss": launches[-1][0][2], "optimizer": launches[-1][0][3], "n": len(wall)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side and stage, split over the rounds")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every launch")
    ap.add_argument("--rounds", type=int, default=2,
                    help="launches per side and stage, interleaved ours/DeepSpeed, order reversed each round")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--ds-optimizers", default="torch_adam,default",
                    help="DeepSpeed optimizers: torch_adam (AdamW with torch_adam: true = torch.optim.AdamW, "
                         "what ours steps with), default (DeepSpeed's own FusedAdam, if it builds)")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary (8192 gives 5.3M params)")
    a = ap.parse_args()
    stages = [int(s) for s in a.stages.split(",")]
    per_round = -(-a.steps // a.rounds)
    n = a.warmup + per_round
    import deepspeed
    ds_opts = [o for o in a.ds_optimizers.split(",") if o]
    if "default" in ds_opts:
        ok, why = ds_fused_adam_builds()
        if not ok:
            print(f"(DeepSpeed's default FusedAdam does not build here, skipped: {why})")
            ds_opts.remove("default")
    from megatron_zero.model.gpt import reference_model
    n_params = sum(p.numel() for p in reference_model(config(a.vocab)).parameters())
    print(f"machine: {lscpu_model()} (lscpu model name), {os.cpu_count()} cores "
          f"({len(os.sched_getaffinity(0))} usable), Python {platform.python_version()}, torch {torch.__version__}, "
          f"deepspeed {deepspeed.__version__}, load average {os.getloadavg()[0]:.1f} at start")
    print(f"GPT vocab {a.vocab}, hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, seq {SEQ}: "
          f"{n_params / 1e6:.2f}M params, fp32, dropout 0; DP {DP} (gloo, 1 thread/rank), micro-batch {MICRO}, "
          f"GA {GA}: {MICRO * GA * DP * SEQ} tokens/step; AdamW lr {LR} wd {WD}, clip {CLIP}")
    print(f"per side and stage: {a.rounds} launch(es) x ({a.warmup} warm-up + {per_round} timed steps), "
          f"interleaved; median over the {a.rounds * per_round} timed steps", flush=True)
    sides = ["ours"] + ds_opts
    rows, t_start = [], time.monotonic()
    for stage in stages:
        got = {side: [] for side in sides}
        for rnd in range(a.rounds):
            order = sides if (rnd + stage) % 2 == 0 else sides[::-1]
            for side in order:
                got[side].append(launch(side, stage, n, a.vocab))
                last = summarise(got[side][-1:], a.warmup)
                print(f"  stage {stage} round {rnd + 1} {side}: {last['tok_s']:.0f} tokens/s, "
                      f"{last['tok_cpu_s']:.0f} tokens/CPU-s, load {os.getloadavg()[0]:.1f} "
                      f"[{time.monotonic() - t_start:.0f} s]", flush=True)
        rows.append((stage, {side: summarise(got[side], a.warmup) for side in sides}))
    print(f"load average {os.getloadavg()[0]:.1f} at end; {time.monotonic() - t_start:.0f} s of launches")
    for side in ds_opts:
        print(f"{SIDES[side]} ran {rows[0][1][side]['optimizer']}")
    print()
    print("tokens/s: global tokens per wall second, median step; ours/DS: ratio of tokens/s (>1: ours faster);")
    print("CPU ours/DS: ratio of tokens per CPU-second summed over both ranks (less sensitive to other load)")
    head = ["ZeRO stage", "ours tokens/s"]
    for o in ds_opts:
        short = "DS torch_adam" if o == "torch_adam" else "DS FusedAdam"
        head += [f"{short} tokens/s", "ours/DS", "CPU ours/DS"]
    head.append("loss after last step, ours / " + " / ".join("DS" for _ in ds_opts))
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for stage, res in rows:
        ours = res["ours"]
        cells = [f"{stage}", f"{ours['tok_s']:.0f}"]
        for o in ds_opts:
            ds = res[o]
            cells += [f"{ds['tok_s']:.0f}", f"{ours['tok_s'] / ds['tok_s']:.2f}",
                      f"{ours['tok_cpu_s'] / ds['tok_cpu_s']:.2f}"]
        cells.append(" / ".join(f"{res[s]['loss']:.4f}" for s in sides))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""Checkpoint save speed and memory: ours vs DeepSpeed's save_checkpoint vs torch.save vs the disk (dd).

    .venv/bin/python bench/bench_checkpoint_save.py [--layers 10 --hidden 768 --vocab 32000 --reps 3 --no-torch-save]

A ~100M-parameter GPT, fp32, ZeRO-2 on 2 gloo CPU ranks, after one training step; the same ranks
hold our model+ZeroOptimizer and a DeepSpeed engine of the same model, and the reps of every method
are interleaved with a dd of the disk, so the disk's drift hits all alike (ours and DeepSpeed's
alternate which runs first; --no-torch-save leaves out the slow torch.save row; --phases times
the phases of our synchronous save instead: writing the bytes, fsync, outcome collectives, commit). Each rank
reports its save time, the bytes it wrote and its peak extra RSS during the save (RSS sampled
every 2 ms, minus RSS before); an async save's rows are the call's blocking part and the time
until the background writer has read the whole state (what the next optimizer step waits for at
worst, with no training in between); a row's time is the slowest rank (the save is done when all are),
bytes/s is all bytes over that time, RSS is the worst rank as a fraction of that rank's state
(its model weights + optimizer partition). Every save ends with fsync of what it wrote.
"""
import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_zero.testing.host_memory import measured  # noqa: E402
from megatron_zero.testing.multirank import run_ranks  # noqa: E402


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def fsync_tree(path, only=None):
    for r, _, fs in os.walk(path):
        for f in fs:
            if only is None or f in only:
                fd = os.open(os.path.join(r, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)


def config(a):
    from megatron_zero.model.config import GPTConfig
    return GPTConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=12,
                     seq_length=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def batch(cfg):
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randint(0, cfg.vocab_size, (1, 64), generator=g), torch.randint(0, cfg.vocab_size, (1, 64), generator=g)


def state_bytes(model, opt_sd):
    from megatron_zero.checkpoint.storage.tensor_io import map_tensors
    seen = []
    map_tensors({"m": model.state_dict(), "o": opt_sd}, lambda t: seen.append(t.numel() * t.element_size()))
    return sum(seen)


def timed_save(out, key, d, fn, rank, after=None):
    dist.barrier()
    dt, extra = measured(fn)
    if after is not None:  # not timed: e.g. let an async save finish
        after()
    dist.barrier()
    out[key].append((dt, extra, dir_bytes(d) if rank == 0 else 0))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def all_saves(a, root):
    """Every method on the same ranks, reps interleaved (ours, async, torch.save, DeepSpeed, dd), so the
    disk's drift hits all alike."""
    from megatron_zero.checkpoint import finalize_async_saves, save_checkpoint
    from megatron_zero.checkpoint.save import _client, build_plan
    from megatron_zero.checkpoint.storage.writer import CopyFile, get_writer
    from megatron_zero.model.gpt import GPTModel
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.zero import ZeroOptimizer

    state = build_parallel_state(1, 1)
    cfg = config(a)
    model = GPTModel(cfg)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=2, lr=1e-4)
    tokens, labels = batch(cfg)
    opt.backward(model(tokens, labels=labels))
    opt.step()
    engine = deepspeed_engine(cfg, tokens, labels) if a.deepspeed else None
    rank = dist.get_rank()
    out = {"state_bytes": state_bytes(model, opt.state_dict()), "ours": [], "ours_async_block": [],
           "ours_async_read": [], "torch": [],
           "deepspeed": [], "dd": []}
    for rep in range(a.reps):
        d = os.path.join(root, f"ours{rep}")

        def ours():
            timed_save(out, "ours", d, lambda: save_checkpoint(d, 10, state, model, opt, {"iteration": 10}), rank)
        if engine is None or rep % 2 == 0:  # ours and DeepSpeed's alternate which goes first
            ours()
        da = os.path.join(root, f"async{rep}")
        timed_save(out, "ours_async_block", da, lambda: save_checkpoint(da, 10, state, model, opt, {"iteration": 10},
                                                                         async_save=True), rank,
                   after=finalize_async_saves)
        dr = os.path.join(root, f"async_read{rep}")

        def save_until_state_read():  # how long the next optimizer step would wait, at worst
            save_checkpoint(dr, 10, state, model, opt, {"iteration": 10}, async_save=True)
            get_writer().wait_until_state_read()
        timed_save(out, "ours_async_read", dr, save_until_state_read, rank, after=finalize_async_saves)
        if not a.no_torch_save:  # torch.save of exactly the objects this rank's plan holds, each to its file, then fsync
            dt_ = os.path.join(root, f"torch{rep}")
            os.makedirs(dt_, exist_ok=True)
            plan = [(n, o) for n, o in build_plan(10, state, model, opt, _client({"iteration": 10}, state, 10))
                    if not isinstance(o, CopyFile)]

            def torch_save():
                for n, o in plan:
                    torch.save(o, os.path.join(dt_, n))
                fsync_tree(dt_, {n for n, _ in plan})

            timed_save(out, "torch", dt_, torch_save, rank)
            plan.clear()
        if engine is not None:
            dd_ = os.path.join(root, f"ds{rep}")

            def ds_save():
                engine.save_checkpoint(dd_, tag="global_step10")
                mine = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"} | (
                    {"mp_rank_00_model_states.pt", "zero_to_fp32.py", "latest"} if rank == 0 else set())
                fsync_tree(dd_, mine)

            timed_save(out, "deepspeed", dd_, ds_save, rank)
            if rep % 2 == 1:
                ours()
        if rank == 0:
            out["dd"].append(dd_speed(root))
        dist.barrier()
    return out


def phases(a, root):
    """Our sync save only, with its phases timed per rank: writing the files' bytes, fsync (on the
    helper thread, overlapped), the outcome collectives (mostly waiting for the slower rank), the commit."""
    import collections

    import megatron_zero.checkpoint.storage.tensor_io as tio
    import megatron_zero.checkpoint.storage.writer as writer
    from megatron_zero.checkpoint import save_checkpoint
    from megatron_zero.model.gpt import GPTModel
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.zero import ZeroOptimizer

    state, cfg = build_parallel_state(1, 1), config(a)
    model = GPTModel(cfg)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=2, lr=1e-4)
    tokens, labels = batch(cfg)
    opt.backward(model(tokens, labels=labels))
    opt.step()
    spent = collections.defaultdict(float)

    def timed(owner, name, key):
        fn = getattr(owner, name)

        def wrapper(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[key] += time.perf_counter() - start
        setattr(owner, name, staticmethod(wrapper) if isinstance(vars(owner).get(name), staticmethod) else wrapper)

    for owner, name, key in ((tio._ChecksumWriter, "_write", "write bytes"), (tio.DeferredFsync, "_sync", "fsync"),
                             (writer, "_all_outcomes", "outcomes"), (writer, "commit", "commit")):
        timed(owner, name, key)
    out = []
    for rep in range(a.reps):
        d = os.path.join(root, f"phases{rep}")
        spent.clear()
        dist.barrier()
        start = time.perf_counter()
        save_checkpoint(d, 10, state, model, opt, {"iteration": 10})
        out.append(dict(spent, total=time.perf_counter() - start))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(d, ignore_errors=True)
    return out


def deepspeed_engine(cfg, tokens, labels):
    import deepspeed
    from megatron_zero.model.gpt import GPTModel

    model = GPTModel(cfg)
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    engine.backward(engine(tokens, labels=labels))
    engine.step()
    return engine


def dd_speed(root, mib=2048):
    path = os.path.join(root, "dd.bin")
    run = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fsync"],
                         capture_output=True, text=True)
    os.remove(path)
    line = run.stderr.strip().splitlines()[-1]
    seconds = float(line.split(",")[-2].strip().split()[0])
    return mib * 2 ** 20 / seconds


def row(name, per_rank, state, disk):
    """per_rank: [rank][rep] -> (seconds, extra rss, bytes on rank 0)."""
    reps = len(per_rank[0])
    times = [max(per_rank[r][i][0] for r in range(len(per_rank))) for i in range(reps)]
    t = statistics.median(times)
    spread = f"{min(times):.2f}-{max(times):.2f}"
    nbytes = per_rank[0][0][2]
    extra = max(max(x[1] for x in per_rank[r]) / state[r] for r in range(len(per_rank)))
    rate = nbytes / t if nbytes else float("nan")
    speed = "— | —" if "async" in name else f"{rate / 2**20:.0f} | {rate / disk:.2f}"  # async: nothing written yet
    print(f"| {name} | {t:.2f} | {spread} | {nbytes / 2**20:.0f} | {speed} | {extra:.3f} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-torch-save", action="store_true", help="leave out the torch.save row (slow: ~6 s a rep)")
    p.add_argument("--phases", action="store_true", help="time the phases of our sync save instead")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo's disk)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=a.dir or os.path.dirname(os.path.abspath(__file__)))
    try:
        params = sum(t.numel() for t in __import__("megatron_zero.model.gpt", fromlist=["GPTModel"])
                     .GPTModel(config(a)).parameters())
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"python {platform.python_version()}; GPT {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}: "
              f"{params / 1e6:.1f}M params, fp32, ZeRO-2, DP 2 (gloo), {a.reps} reps, median")
        if a.phases:
            res = run_ranks(phases, 2, a, root, timeout=3600)
            keys = ["total", "write bytes", "fsync", "outcomes", "commit"]
            print("| rank | " + " | ".join(f"{k} s (median, min-max)" for k in keys) + " |")
            print("|---" * (len(keys) + 1) + "|")
            for rank, reps in enumerate(res):
                cells = [[r.get(k, 0.0) for r in reps] for k in keys]
                print(f"| {rank} | " + " | ".join(f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f})"
                                                 for c in cells) + " |")
            return
        try:
            import deepspeed  # noqa: F401
            a.deepspeed = True
        except ImportError:
            print("(DeepSpeed row skipped: deepspeed is not installed)")
            a.deepspeed = False
        res = run_ranks(all_saves, 2, a, root, timeout=3600)
        disk = statistics.median(res[0]["dd"])
        state = [o["state_bytes"] for o in res]
        print(f"disk (dd 2 GiB, conv=fsync, median of {len(res[0]['dd'])} between the reps): "
              f"{disk / 2**20:.0f} MiB/s; state per rank: {', '.join(f'{s / 2**20:.0f} MiB' for s in state)}")
        print("| save | seconds (median) | min-max | MiB written | MiB/s | / disk | peak extra RSS / state |")
        print("|---|---|---|---|---|---|---|")
        row("megatron_zero save_checkpoint", [o["ours"] for o in res], state, disk)
        row("megatron_zero async (blocking part)", [o["ours_async_block"] for o in res], state, disk)
        row("megatron_zero async (until the state is read)", [o["ours_async_read"] for o in res], state, disk)
        if not a.no_torch_save:
            row("torch.save of the same objects + fsync", [o["torch"] for o in res], state, disk)
        if a.deepspeed:
            row("DeepSpeed 0.19 save_checkpoint + fsync", [o["deepspeed"] for o in res], state, disk)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

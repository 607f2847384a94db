"""What losing a worker costs under torchrun --max-restarts: iterations lost and seconds from the kill to the
next training step, pretrain_gpt.py as a user runs it.

    .venv/bin/python bench/bench_restart.py [--rounds 3] [--save-interval 10] [--kill-after 15] [--local-interval 2]

Each round is one 2-rank torchrun launch (gloo, OMP_NUM_THREADS=1, a byte-level 2-layer GPT, --save and
--load on one directory every --save-interval iterations, --max-restarts 1). When the log shows iteration
--kill-after, rank 1 is SIGKILLed. Measured by polling the log every 20 ms:
  - detect + restart: from the kill to the resumed attempt's first line (torchrun noticed the death,
    stopped the other worker, started new ones, and they loaded the checkpoint);
  - kill to next step: from the kill to the resumed attempt's first training line;
  - lost iterations: iterations the first attempt had finished after the checkpoint it resumes from
    (they are trained again).
Each round runs twice, alternating: --save alone, then with the node-local tier every --local-interval
iterations (--non-persistent-ckpt-type local, a directory beside --save).
The table shows each round and the median. Start-up (importing torch, building the model) is most of the
restart on this CPU; on a GPU cluster add NCCL's communicator set-up and the checkpoint read.
"""
import argparse
import os
import pathlib
import platform
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.testing.launch import byte_data, tiny_flags  # noqa: E402
from megatron_zero.testing.restarts import RestartJob, resumed_from  # noqa: E402


def one_round(where, save_interval: int, kill_after: int, iters: int, local_interval=None) -> dict:
    data = byte_data(os.path.join(where, "bytes"))
    local = {"non-persistent-save-interval": local_interval, "non-persistent-ckpt-type": "local",
             "non-persistent-local-ckpt-dir": os.path.join(where, "local")} if local_interval else {}
    job = RestartJob(where, 2, tiny_flags(pathlib.Path(where), data, **{
        "train-iters": iters, "save-interval": save_interval, "load": os.path.join(where, "ckpt"), **local}))
    try:
        job.wait_for(rf"iteration +{kill_after}/")
        killed = time.monotonic()
        job.signal_rank(1, signal.SIGKILL)
        job.wait_for(r"loaded checkpoint \S+ \(", 600)
        t_resumed = time.monotonic()
        while not job.attempts()[1]:  # the resumed attempt's first training line
            assert job.proc.poll() is None and time.monotonic() < t_resumed + 600, job.text()[-3000:]
            time.sleep(0.02)
        t_step = time.monotonic()
        assert job.finish() == 0, job.text()[-3000:]
    finally:
        job.kill()
    before, _ = job.attempts()
    step = int(resumed_from(job.text())[0].rsplit("global_step", 1)[1])
    return {"restart_s": t_resumed - killed, "next_step_s": t_step - killed,
            "lost": max(before) - step}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--kill-after", type=int, default=15)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--local-interval", type=int, default=2)
    a = p.parse_args()
    rows = {"--save alone": [], f"local tier every {a.local_interval}": []}
    for r in range(a.rounds):
        for name, local in zip(rows, (None, a.local_interval)):
            with tempfile.TemporaryDirectory() as where:
                rows[name].append(one_round(where, a.save_interval, a.kill_after, a.iters, local))
            got = rows[name][-1]
            print(f"round {r + 1}, {name}: kill -> resumed attempt loaded {got['restart_s']:.1f} s, kill -> next "
                  f"step {got['next_step_s']:.1f} s, {got['lost']} iterations lost", flush=True)
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs, --save-interval {a.save_interval}, kill after iteration "
          f"{a.kill_after}, medians of {a.rounds} rounds")
    print("| | kill -> checkpoint loaded | kill -> next training step | iterations lost |\n|---|---|---|---|")
    for name, got in rows.items():
        print(f"| {name} | {statistics.median(r['restart_s'] for r in got):.1f} s | "
              f"{statistics.median(r['next_step_s'] for r in got):.1f} s | {statistics.median(r['lost'] for r in got):g} |")


if __name__ == "__main__":
    main()

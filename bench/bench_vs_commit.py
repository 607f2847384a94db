"""Training throughput (tokens/s) of this tree's pretrain_gpt.py against a named earlier commit's, in one run.

    .venv/bin/python bench/bench_vs_commit.py --commit 26f7e54 [--reps 3] [--iters 15] [--warmup 10] \
        [--layouts tp1,dp2,tp2,pp2,tp2pp2]

The model, data and launch of bench/bench_vs_megatron_deepspeed.py (4 layers, hidden 256, seq 256, mb 4, gbs 16,
fp32, RMSNorm, the built-in corpus, one thread per rank, torchrun). The commit is checked out into a temporary git
worktree (its compiled kernels copied from this tree when csrc/ is unchanged, else built there) and imported
through PYTHONPATH, so both sides run with this venv's packages. Per layout the launches are interleaved, this
tree then the commit, `--reps` times (the order flipped every other rep); the table gives the medians, the spread
and their ratio (this tree / the commit). Losses are printed so a change of numerics shows.
"""
import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_megatron_deepspeed import LABELS, LAYOUTS, ROOT, build_data, machine, measure, ours_cmd  # noqa: E402


def checkout(commit: str, where: str) -> str:
    """A detached worktree of `commit` at `where`, with this tree's built kernels when csrc/ is the same."""
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", where, commit], check=True)
    same_kernels = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", commit, "--", "csrc"]).returncode == 0
    if same_kernels:
        for so in glob.glob(os.path.join(ROOT, "megatron_zero", "*.so")):
            shutil.copy(so, os.path.join(where, "megatron_zero"))
    else:
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=where, check=True,
                       capture_output=True)
    return where


def launch(tree: str, layout: str, data: dict, n: int, timeout: int) -> str:
    cmd, _ = ours_cmd(layout, data, n)
    cmd[cmd.index(os.path.join(ROOT, "pretrain_gpt.py"))] = os.path.join(tree, "pretrain_gpt.py")
    p = subprocess.run(cmd, cwd=tree, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree},
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"bench: {tree}'s pretrain_gpt.py at {layout} failed (exit {p.returncode}):\n"
                 f"{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout + p.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", required=True, help="the earlier commit to measure against (any git revision)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15, help="timed iterations per launch")
    ap.add_argument("--warmup", type=int, default=10, help="untimed iterations at the start of each launch")
    ap.add_argument("--layouts", default="tp1,dp2,tp2,pp2,tp2pp2")
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    layouts = [x for x in a.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS or x == "dp2moe"]
    if unknown:
        sys.exit(f"bench: --layouts: unknown layout {unknown[0]!r}; choose from tp1, dp2, tp2, pp2, tp2pp2")
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", "-q", a.commit + "^{commit}"],
                      capture_output=True).returncode != 0:
        sys.exit(f"bench: --commit {a.commit} is not a commit of {ROOT}'s repository")
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    print(f"machine: {machine()}; load {open('/proc/loadavg').read().split()[0]}; this tree (HEAD {head}) against "
          f"{a.commit}; reps {a.reps} (interleaved), {a.warmup} warm-up + {a.iters} timed iterations per launch")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        old = os.path.join(work, "earlier")
        try:
            checkout(a.commit, old)
            data = build_data(work)
            for layout in layouts:
                res = {"this tree": [], a.commit: []}
                for rep in range(a.reps):
                    sides = (("this tree", ROOT), (a.commit, old))
                    for name, tree in (sides if rep % 2 == 0 else sides[::-1]):
                        tps, loss = measure(launch(tree, layout, data, a.warmup + a.iters, a.timeout), a.warmup, a.iters)
                        res[name].append(tps)
                        print(f"  {LABELS[layout]:<11} rep {rep + 1} {name:<10} {tps:7.0f} tokens/s  loss {loss:.4f}",
                              flush=True)
                new, before = (statistics.median(res[k]) for k in res)
                rows.append((LABELS[layout], new, res["this tree"], before, res[a.commit], new / before))
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old], capture_output=True)
    print(f"\n| layout | this tree (tokens/s) | {a.commit} (tokens/s) | ratio |\n|---|---|---|---|")
    for label, new, new_all, before, before_all, ratio in rows:
        print(f"| {label} | {new:.0f} ({min(new_all):.0f}-{max(new_all):.0f}) | {before:.0f} "
              f"({min(before_all):.0f}-{max(before_all):.0f}) | {ratio:.2f}x |")


if __name__ == "__main__":
    main()

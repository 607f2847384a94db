"""The GPU acceptance run behind scripts/gpu_check.sh: plan the steps for the GPUs present, run each, write one report.

    python scripts/gpu_check.py REPORT.md      run everything, write REPORT.md (exit 0: all passed, 1: a step failed,
                                               3: no CUDA device, 2: bad usage)
    python scripts/gpu_check.py --plan N       print the steps for N GPUs, run nothing (also GPU_CHECK_DRY_RUN=1,
                                               with GPU_CHECK_GPUS=N)
    python scripts/gpu_check.py --budget SECONDS REPORT.md
                                               the same within SECONDS of wall time: each step's timeout is cut
                                               to what is left, and the steps after it are reported as not run
                                               (exit 4 when nothing failed but some did not run)

It uses the machine's own python and torch (no virtual environment): the kernels are built in place
(`setup.py build_ext --inplace`) and every step runs from this checkout (PYTHONPATH). The steps, in priority
order (a short GPU slot with --budget runs the first ones): environment, python modules, the wheels carried under
.whl/ (installed offline: torchao, crc32c), kernel build, kernels present (--require-fused-kernels' rule),
bench/bench_gpu.py at Llama-3-8B's shape (ours bf16, compiled and FP8 tensorwise against plain PyTorch), data
(Python's pydoc topics as bytes: tools/preprocess_data.py with the ByteTokenizer, no download, no SentencePiece),
short training runs per layout that fits (1 GPU: TP1 bf16 with the fused kernels, full recompute, flash attention;
a Llama-shaped run; offload; >= 2 GPUs: TP2, PP2, DP2 with ZeRO-1/2/3, offload; >= 4: TP2 x PP2; >= 8: TP2 x PP2 x
DP2), a save and a resume (1 GPU: save, resume, tools/ds_to_universal.py, universal resume; >= 2: save at TP2,
reshaped resume at DP2, universal resume at PP2),
then the `gpu`-marked tests, one step per file, the files most likely to find something first (GPU_TEST_FILES), the
CUDA compile test last (the build already compiled every kernel). While a step runs, the peak GPU memory
(nvidia-smi) and each process's host RSS are sampled; training steps report their last logged MFU, TFLOP/s per
GPU and loss. The report is rewritten after every step (a machine taken away mid-run leaves it). Logs:
GPU_CHECK_WORKDIR (default runs/gpu_check)/logs.
"""
from __future__ import annotations

import datetime
import glob
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megatron_zero.testing.multirank import free_port  # noqa: E402  (standard library only: a held port)

PY = sys.executable
WHEELS = os.path.join(ROOT, ".whl")  # wheels carried to a machine without a package index (.gitignore)
# most likely to find something first: the training path with the kernels (its tests never ran on a GPU before
# the first report), the kernels against their references, the offload's streams and pinned copies, checkpoints
# through pinned memory, then the features each GPU test touches once (MoE, grouped GEMM, context parallelism)
GPU_TEST_FILES = ("test_gpu_training.py", "test_ops_cuda.py", "test_zero_offload_upload.py", "test_checkpoint_staging.py",
                  "test_moe_gpu.py", "test_moe_grouped_gemm.py", "test_context_parallel_gpu.py", "test_zero_offload.py",
                  "test_fp8_gpu.py")
MODULES = ("numpy", "crc32c", "safetensors", "pytest", "setuptools", "tokenizers", "sentencepiece", "tensorboard")
NEEDED = ("numpy", "crc32c", "pytest", "setuptools")  # training, checkpoints, the tests, the build


@dataclass
class Step:
    name: str
    argv: List[str]
    timeout: int = 900
    kind: str = "cmd"  # "train": its log has training lines; "bench": writes the JSON rows; "pytest"
    note: str = ""
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    step: Step
    ok: bool
    seconds: float
    log: str
    metrics: Dict[str, object] = field(default_factory=dict)
    ran: bool = True  # False: the budget was spent before the step's turn


def not_run(step: Step, why: str) -> Outcome:
    return Outcome(step, False, 0.0, "", {"note": f"not run: {why}"}, ran=False)


def model_flags(work: str, iters: int, **changes) -> List[str]:
    """A 4-layer GPT on the byte-level pydoc data; changes: {"flag-name": value or True (a switch) or None (drop)}."""
    flags = {"num-layers": 4, "hidden-size": 512, "num-attention-heads": 8, "seq-length": 512,
             "max-position-embeddings": 512, "micro-batch-size": 4, "global-batch-size": 32, "lr": 3e-4,
             "min-lr": 3e-5, "lr-decay-style": "cosine", "lr-warmup-iters": 2, "train-iters": iters,
             "weight-decay": 0.01, "clip-grad": 1.0, "hidden-dropout": 0.0, "attention-dropout": 0.0, "seed": 1234,
             "bf16": True, "data-path": os.path.join(work, "data", "pydoc_text_document"),
             "tokenizer-type": "ByteTokenizer", "split": "98,2,0", "data-cache-path": os.path.join(work, "cache"),
             "log-interval": 5, "eval-interval": 1000, "eval-iters": 0}
    flags.update(changes)
    argv = []
    for k, v in flags.items():
        if v is True:
            argv.append(f"--{k}")
        elif v is not None and v is not False:
            argv += [f"--{k}", str(v)]
    return argv


def pretrain(nproc: int, flags: List[str]) -> List[str]:
    script = os.path.join(ROOT, "pretrain_gpt.py")
    if nproc == 1:
        return [PY, script] + flags
    return [PY, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
            script] + flags


def train(name: str, nproc: int, flags: List[str], note: str = "") -> Step:
    """A pretrain_gpt.py step: one process, or torchrun with nproc ranks (a free port either way)."""
    return Step(name, pretrain(nproc, flags), kind="train", note=note, env={"MASTER_PORT": str(free_port())})


LLAMA = {"normalization": "RMSNorm", "position-embedding-type": "rope", "swiglu": True, "disable-bias-linear": True,
         "untie-embeddings-and-output-weights": True, "num-query-groups": 4, "group-query-attention": True}


def training_steps(ngpus: int, work: str) -> List[Step]:
    t = lambda name, nproc, **f: train(name, nproc, model_flags(work, 20, **f))  # noqa: E731
    steps = [t("train 1 GPU: TP1 bf16, fused kernels, full recompute, flash attention", 1,
               **{"require-fused-kernels": True, "recompute-granularity": "full", "recompute-method": "uniform",
                  "attention-backend": "flash"}),
             t("train 1 GPU: Llama-shaped (RMSNorm, RoPE, SwiGLU, GQA), fused kernels", 1,
               **{"require-fused-kernels": True, **LLAMA}),
             t("train 1 GPU: ZeRO-2 with CPU offload", 1, **{"zero-stage": 2, "cpu-optimizer": True})]
    if ngpus >= 2:
        steps += [t("train 2 GPUs: TP2, sequence parallel", 2,
                    **{"tensor-model-parallel-size": 2, "sequence-parallel": True, "require-fused-kernels": True}),
                  t("train 2 GPUs: PP2", 2, **{"pipeline-model-parallel-size": 2}),
                  t("train 2 GPUs: DP2 ZeRO-1, overlapped reduce and gather", 2,
                    **{"zero-stage": 1, "overlap-grad-reduce": True, "overlap-param-gather": True}),
                  t("train 2 GPUs: DP2 ZeRO-2", 2, **{"zero-stage": 2}),
                  t("train 2 GPUs: DP2 ZeRO-3", 2, **{"zero-stage": 3}),
                  t("train 2 GPUs: DP2 ZeRO-2 with CPU offload", 2, **{"zero-stage": 2, "cpu-optimizer": True})]
    if ngpus >= 4:
        steps.append(t("train 4 GPUs: TP2 x PP2", 4, **{"tensor-model-parallel-size": 2,
                                                        "pipeline-model-parallel-size": 2}))
    if ngpus >= 8:
        steps.append(t("train 8 GPUs: TP2 x PP2 x DP2, ZeRO-1", 8, **{"tensor-model-parallel-size": 2,
                                                                      "pipeline-model-parallel-size": 2,
                                                                      "zero-stage": 1}))
    return steps


def checkpoint_steps(ngpus: int, work: str) -> List[Step]:
    ckpt = os.path.join(work, "checkpoints")
    to_universal = lambda it: Step(f"tools/ds_to_universal.py global_step{it}", [  # noqa: E731
        PY, os.path.join(ROOT, "tools", "ds_to_universal.py"), "--input_folder", os.path.join(ckpt, f"global_step{it}"),
        "--output_folder", os.path.join(ckpt, f"global_step{it}_universal"), "--num_extract_workers", "4",
        "--num_merge_workers", "2"])
    rss = "host RSS: the peak of the run that saves"
    if ngpus == 1:
        # one schedule (--train-iters 20) for the three runs, each stopping at --exit-interval: a resume checks it
        return [train("save (1 GPU, ZeRO-1)", 1, model_flags(work, 20, save=ckpt, **{"save-interval": 10,
                                                                                      "exit-interval": 10}), rss),
                train("resume (1 GPU)", 1, model_flags(work, 20, load=ckpt, save=ckpt, **{"exit-interval": 15})),
                to_universal(15),
                train("universal resume (1 GPU, ZeRO-2)", 1, model_flags(
                    work, 20, load=ckpt, save=ckpt, **{"universal-checkpoint": True, "zero-stage": 2}))]
    return [train("save (2 GPUs: TP2)", 2, model_flags(work, 20, save=ckpt, **{
                "save-interval": 10, "exit-interval": 10, "tensor-model-parallel-size": 2}), rss),
            train("reshaped resume (2 GPUs: TP2 -> DP2 ZeRO-2)", 2, model_flags(
                work, 20, load=ckpt, save=ckpt, **{"zero-stage": 2, "exit-interval": 15})),
            to_universal(15),
            train("universal resume (2 GPUs: PP2)", 2, model_flags(
                work, 20, load=ckpt, save=ckpt, **{"universal-checkpoint": True, "pipeline-model-parallel-size": 2}))]


def wheel_steps() -> List[Step]:
    """The wheels carried under .whl/ (ignored by git: torchao, crc32c for an image without them), installed
    offline first; none when there is no .whl/."""
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    if not wheels:
        return []
    return [Step("wheels carried under .whl/ (pip, offline)", [PY, "-m", "pip", "install", "--no-index", "--no-deps",
                                                              "--find-links", WHEELS] + wheels, timeout=300)]


def bench_step(work: str) -> Step:
    """bench/bench_gpu.py at Llama-3-8B's shape right after the kernel build, before anything a short lease
    could lose it to: ours in bf16, compiled (--compile-layers) and in FP8 (tensorwise, where torchao is
    installed or carried as a wheel) against the plain PyTorch loop, each side's MFU and peak memory."""
    torchao = importlib.util.find_spec("torchao") is not None or bool(glob.glob(os.path.join(WHEELS, "torchao*.whl")))
    return Step("bench/bench_gpu.py: Llama-3-8B shape (vocab 128256, seq 8192): ours bf16 / compiled / FP8 against "
                "PyTorch", [PY, os.path.join(ROOT, "bench", "bench_gpu.py"), "--sizes", "llama3-8b", "--steps", "3",
                            "--warmup", "1", "--no-offload", "--no-pretrain", "--compile", "--json",
                            os.path.join(work, "bench_gpu.json")] + (["--fp8", "tensorwise"] if torchao else []),
                timeout=600, kind="bench")


def plan(ngpus: int, work: str) -> List[Step]:
    """Every step for a machine with `ngpus` GPUs, in order."""
    probe = ("import sys, torch; from megatron_zero.ops import kernel_report, require_fused_kernels; "
             "print(kernel_report()); require_fused_kernels(torch.device('cuda', 0), offload=True)")
    jsonl = os.path.join(work, "data", "pydoc.jsonl")
    corpus = (f"import json, os; from pydoc_data.topics import topics; os.makedirs({os.path.dirname(jsonl)!r}, "
              f"exist_ok=True); open({jsonl!r}, 'w').writelines(json.dumps({{'text': t}}) + chr(10) "
              "for t in topics.values())")
    steps = [Step("environment", [PY, "-c", "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, "
                                  "[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"]),
             Step("python modules", [PY, "-c", f"import importlib.util as u, sys; m = [n for n in {MODULES!r} if "
                                     "u.find_spec(n) is None]; print('missing:', ', '.join(m) or 'none'); "
                                     f"sys.exit(1 if set(m) & set({NEEDED!r}) else 0)"]),
             *wheel_steps(),
             Step("build the kernels (setup.py build_ext --inplace)", [PY, "setup.py", "build_ext", "--inplace"],
                  timeout=2400),
             Step("kernels present (CUDA and CPU Adam)", [PY, "-c", probe]),
             bench_step(work),
             Step("data: Python's pydoc topics as JSONL", [PY, "-c", corpus]),
             Step("data: tools/preprocess_data.py, ByteTokenizer", [
                 PY, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl, "--output-prefix",
                 os.path.join(work, "data", "pydoc"), "--tokenizer-type", "ByteTokenizer", "--append-eod"])]
    steps += training_steps(ngpus, work) + checkpoint_steps(ngpus, work)
    steps += [Step(f"tests: {name} -m gpu", [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu",
                                             os.path.join(ROOT, "tests", name)], timeout=1800, kind="pytest")
              for name in GPU_TEST_FILES]
    steps.append(Step("tests: test_cuda_compile.py (nvcc)", [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                                             os.path.join(ROOT, "tests", "test_cuda_compile.py")],
                      kind="pytest"))
    return steps


# ---- running ---------------------------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Peak GPU memory used (nvidia-smi, GiB, the fullest GPU) and peak host RSS of one process of a tree."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.gpu_gib, self.rss_gib, self.done = pid, None, 0.0, threading.Event()

    def run(self):
        smi = shutil.which("nvidia-smi")
        while not self.done.wait(0.5):
            for pid in self._tree():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
                    self.rss_gib = max(self.rss_gib, kb / 2**20)
                except (OSError, StopIteration, ValueError):
                    pass
            if smi:
                out = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True).stdout
                used = [float(x) / 1024 for x in out.split() if x.replace(".", "").isdigit()]
                if used:
                    self.gpu_gib = max(self.gpu_gib or 0.0, max(used))

    def _tree(self) -> List[int]:
        children: Dict[int, List[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(entry))
                except (OSError, ValueError, IndexError):
                    pass
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out


def run_step(step: Step, index: int, logs: str, timeout: float = None) -> Outcome:
    """Run one step (killed after `timeout` s, default the step's own) -> its outcome."""
    timeout = step.timeout if timeout is None else timeout
    env = {**os.environ, **step.env, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    log_path = os.path.join(logs, f"{index:02d}-{re.sub(r'[^A-Za-z0-9]+', '_', step.name).strip('_')[:60]}.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(step.argv) + "\n")
        log.flush()
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = proc.wait()
            why = "its timeout" if timeout >= step.timeout else "the end of the budget"
            log.write(f"\ngpu_check: killed after {timeout:.0f} s ({why})\n")
        sampler.done.set()
        sampler.join()
    with open(log_path) as f:
        text = f.read()
    metrics = {"peak GPU GiB": sampler.gpu_gib, "peak host RSS GiB": sampler.rss_gib, "log": log_path}
    if "gpu_check: killed after" in text:
        metrics["note"] = text.rsplit("gpu_check: ", 1)[1].strip()
    ok = code == 0
    if step.kind == "train":
        metrics.update(train_metrics(text))
        ok = ok and "lm loss" in metrics
    if step.kind == "pytest":
        summary = [x for x in text.splitlines() if re.search(r"\b(passed|failed|skipped|error)", x)]
        metrics["tests"] = summary[-1].strip("= ") if summary else "no summary"
    return Outcome(step, ok, time.perf_counter() - t0, text, metrics)


def train_metrics(text: str) -> Dict[str, object]:
    """The last training line's MFU, TFLOP/s per GPU and loss."""
    lines = [x for x in text.splitlines() if "lm loss:" in x and "iteration" in x]
    if not lines:
        return {}
    last, out = lines[-1], {}
    for key, pattern in (("MFU", r"MFU: ([0-9.]+)%"), ("TFLOP/s/GPU", r"TFLOP/s/GPU\): ([0-9.]+)"),
                         ("lm loss", r"lm loss: ([0-9.E+-]+)"), ("iteration", r"iteration +(\d+)/")):
        m = re.search(pattern, last)
        if m:
            out[key] = float(m.group(1))
    return out


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def summary(outcomes: List[Outcome]) -> str:
    """'P/N steps passed[, F failed][, R not run]'."""
    passed, failed = sum(o.ok for o in outcomes), sum(o.ran and not o.ok for o in outcomes)
    left = sum(not o.ran for o in outcomes)
    return f"{passed}/{len(outcomes)} steps passed" + (f", {failed} failed" if failed else "") + \
        (f", {left} not run" if left else "")


def write_report(path: str, outcomes: List[Outcome], ngpus: int, work: str, started: str, budget: float = None):
    env = outcomes[0].log.splitlines()[-1] if outcomes and outcomes[0].ok else "unknown"
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    limit = f"; budget {budget:.0f} s" if budget is not None else ""
    lines = [f"# GPU acceptance report ({summary(outcomes)})", "",
             f"- started {started}, host {platform.node()}, {ngpus} GPU(s){limit}; {env}",
             f"- commit {commit}; python {platform.python_version()}; logs under {work}/logs", "",
             "| # | step | result | time s | MFU % | TFLOP/s/GPU | lm loss | peak GPU GiB | peak host RSS GiB | notes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, o in enumerate(outcomes, 1):
        m = o.metrics
        notes = "; ".join(x for x in (o.step.note, m.get("tests", ""), m.get("note", "")) if x)
        result = "PASS" if o.ok else "FAIL" if o.ran else "NOT RUN"
        lines.append(f"| {i} | {o.step.name} | {result} | {o.seconds:.0f} | {fmt(m.get('MFU'), 2)} | "
                     f"{fmt(m.get('TFLOP/s/GPU'), 1)} | {fmt(m.get('lm loss'), 3)} | {fmt(m.get('peak GPU GiB'))} | "
                     f"{fmt(m.get('peak host RSS GiB'), 2)} | {notes} |")
    kernels = next((x for o in outcomes for x in o.log.splitlines() if x.startswith("kernels in use:")), None)
    if kernels:
        lines += ["", "## Kernels", "", kernels]
    bench = os.path.join(work, "bench_gpu.json")
    if os.path.exists(bench):
        with open(bench) as f:
            data = json.load(f)
        lines += ["", f"## bench/bench_gpu.py on {data['device']} ({data['micro_batches']} micro-batches a step, peak "
                  f"{data['peak_tflops']} TFLOP/s bf16)", "", "| model | side | layers | params | seq x micro-batch | "
                  "tokens/s | TFLOP/s | MFU % | peak GiB | schedule |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            lines.append(f"| {r['model']} | {r['side']} | {r['layers']} | {r['params'] / 1e9:.2f}B | "
                         f"{r['seq']} x {r['micro_batch']} | "
                         + (f"{r['error']} | | | | |" if "error" in r else
                            f"{r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {fmt(r['mfu_percent'])} | "
                            f"{fmt(r['peak_gib'])} | {r['schedule']} |"))
    failed = [o for o in outcomes if o.ran and not o.ok]
    if failed:
        lines += ["", "## Failures (last 40 lines of each log)"]
        for o in failed:
            tail = "\n".join(o.log.splitlines()[-40:])
            lines += ["", f"### {o.step.name}", "", "```", tail, "```"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def print_plan(steps: List[Step], ngpus: int):
    print(f"gpu_check plan for {ngpus} GPU(s): {len(steps)} steps")
    for i, s in enumerate(steps, 1):
        print(f"{i:2d}. {s.name}")
        print(f"    $ {shlex.join(s.argv)}")


USAGE = ("give the report's path (e.g. `bash scripts/gpu_check.sh REPORT.md`, optionally after --budget SECONDS), "
         "or --plan N to list the steps for N GPUs")


def parse(argv: List[str]):
    """-> (report path or None, --plan count or None, --budget seconds or None); a str: the usage error."""
    report, count, budget, rest = None, None, None, list(argv)
    while rest:
        a = rest.pop(0)
        if a in ("--plan", "--budget"):
            if not rest:
                return f"{a} needs a value"
            value = rest.pop(0)
            if a == "--plan":
                if not value.isdigit() or int(value) < 1:
                    return f"--plan needs a GPU count of at least 1, got {value!r}"
                count = int(value)
            else:
                try:
                    budget = float(value)
                except ValueError:
                    budget = -1.0
                if budget <= 0:
                    return f"--budget needs a positive number of seconds, got {value!r}"
        elif a.startswith("-") or report is not None:
            return USAGE
        else:
            report = a
    return report, count, budget


def run_plan(steps: List[Step], report: str, ngpus: int, work: str, budget: float = None) -> List[Outcome]:
    """Run the steps in order, the report rewritten after each; with a budget, each step's timeout is cut to the
    seconds left and the steps after the budget is spent are reported as not run."""
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    t0, outcomes = time.monotonic(), []
    pending = lambda why: [not_run(s, why) for s in steps[len(outcomes):]]  # noqa: E731
    write_report(report, pending("not yet"), ngpus, work, started, budget)  # the plan, before anything runs
    for i, step in enumerate(steps, 1):
        left = None if budget is None else budget - (time.monotonic() - t0)
        if left is not None and left < 1:
            break
        print(f"gpu_check: [{i}] {step.name} ...", flush=True)
        outcomes.append(run_step(step, i, logs, None if left is None else min(step.timeout, left)))
        print(f"gpu_check: [{i}] {'PASS' if outcomes[-1].ok else 'FAIL'} in {outcomes[-1].seconds:.0f} s", flush=True)
        write_report(report, outcomes + pending("not yet"), ngpus, work, started, budget)  # if the machine goes away
    outcomes += pending(f"the budget of {budget:.0f} s was spent" if budget is not None else "not yet")
    write_report(report, outcomes, ngpus, work, started, budget)
    return outcomes


def main(argv: List[str]) -> int:
    work = os.path.abspath(os.environ.get("GPU_CHECK_WORKDIR", os.path.join(ROOT, "runs", "gpu_check")))
    parsed = parse(argv)
    if isinstance(parsed, str):
        print(f"gpu_check.sh: {parsed}", file=sys.stderr)
        return 2
    report, count, budget = parsed
    if os.environ.get("GPU_CHECK_DRY_RUN", "") not in ("", "0") and count is None:
        env = os.environ.get("GPU_CHECK_GPUS", "1")
        if not env.isdigit() or int(env) < 1:
            print(f"gpu_check.sh: GPU_CHECK_GPUS needs a GPU count of at least 1, got {env!r}", file=sys.stderr)
            return 2
        count = int(env)
    if count is not None:
        print_plan(plan(count, work), count)
        return 0
    if report is None:
        print(f"gpu_check.sh: {USAGE}", file=sys.stderr)
        return 2
    report = os.path.abspath(report)
    ngpus = cuda_devices()
    if ngpus == 0:
        return 3
    shutil.rmtree(os.path.join(work, "checkpoints"), ignore_errors=True)
    outcomes = run_plan(plan(ngpus, work), report, ngpus, work, budget)
    print(f"gpu_check: {summary(outcomes)}" + (f" within a budget of {budget:.0f} s" if budget else "")
          + f"; report: {report}")
    if any(o.ran and not o.ok for o in outcomes):
        return 1
    return 4 if any(not o.ran for o in outcomes) else 0


def cuda_devices() -> int:
    """The CUDA devices torch sees; 0 after saying, in one sentence, why the run cannot start."""
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check.sh: {PY} cannot import torch ({e}), so there is no CUDA to check; run it with the "
              "python of a CUDA torch (PYTHON=...)", file=sys.stderr)
        return 0
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        print(f"gpu_check.sh: no CUDA device is visible to torch {torch.__version__} (CUDA build: "
              f"{torch.version.cuda}), so the GPU acceptance run cannot start; run it on a machine with NVIDIA GPUs.",
              file=sys.stderr)
    return n


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

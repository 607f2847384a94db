"""scripts/gpu_check.sh, checked on the CPU: one sentence and exit 3 without CUDA; the plan for 1, 2 and 8 GPUs
(every layout the GPU acceptance run promises, every flag of every command accepted by the real parsers); and the
report written from step outcomes (pass/fail, MFU, memory) with a fake plan of shell commands."""
import importlib.util
import os
import shlex
import subprocess
import sys

import pytest

from megatron_zero.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def _sh(*args, env=None):
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


def _module(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_it_says_so_in_one_sentence_and_exits_3(tmp_path):
    run = _sh(str(tmp_path / "REPORT.md"))
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stdout == "" and run.stderr.count("\n") == 1 and "no CUDA device" in run.stderr, run.stderr
    assert not (tmp_path / "REPORT.md").exists()
    assert _sh().returncode == 2  # no report path: usage, in one sentence
    assert _sh("--plan", "zero").returncode == 2


def _plan(ngpus, work, how="flag"):
    run = (_sh("--plan", str(ngpus), env={"GPU_CHECK_WORKDIR": str(work)}) if how == "flag" else
           _sh(env={"GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_GPUS": str(ngpus), "GPU_CHECK_WORKDIR": str(work)}))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    names = [x.split(". ", 1)[1] for x in lines[1:] if not x.startswith("    $ ")]
    commands = [shlex.split(x[len("    $ "):]) for x in lines[1:] if x.startswith("    $ ")]
    assert len(names) == len(commands) and lines[0].startswith(f"gpu_check plan for {ngpus} GPU(s)")
    return dict(zip(names, commands))


def _pretrain_argv(cmd):
    """(ranks, flags) of a pretrain_gpt.py command, direct or under torch.distributed.run."""
    i = next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py"))
    nproc = int(cmd[cmd.index("--nproc_per_node") + 1]) if "--nproc_per_node" in cmd else 1
    return nproc, cmd[i + 1:]


def _kind(name):
    """The priority class of a step of the plan, by its name."""
    for prefix, kind in (("environment", 0), ("python modules", 0), ("build", 1), ("kernels present", 2), ("data", 2),
                         ("train", 3), ("save", 3), ("resume", 3), ("reshaped", 3), ("universal", 3), ("tools/", 3),
                         ("bench", 2), ("tests: test_cuda_compile", 6), ("tests", 5)):
        if name.startswith(prefix):
            return kind
    raise AssertionError(f"a step of no known kind: {name}")


def test_plan_for_one_gpu_lists_every_promised_step(tmp_path):
    steps = _plan(1, tmp_path)
    assert list(steps) == list(_plan(1, tmp_path, how="env"))  # GPU_CHECK_DRY_RUN=1 GPU_CHECK_GPUS=1: the same
    names = list(steps)
    assert names[:3] == ["environment", "python modules", "build the kernels (setup.py build_ext --inplace)"]
    # priority order, for a budget that ends early: environment, build, kernels and at once the bench, training and
    # checkpoints, then the test files most likely to find something (the training tier first), the compile test last
    kinds = [_kind(n) for n in names]
    assert kinds == sorted(kinds) and set(kinds) == {0, 1, 2, 3, 5, 6}, list(zip(kinds, names))
    assert names[4].startswith("bench")  # right after the kernels are built and found
    tests = [n.split()[1] for n in names if n.startswith("tests")]
    assert tests[:2] == ["test_gpu_training.py", "test_ops_cuda.py"] and tests[-1] == "test_cuda_compile.py"
    assert steps[names[2]] == [sys.executable, "setup.py", "build_ext", "--inplace"]  # the python it was given
    assert any(n.startswith("tests: test_gpu_training.py -m gpu") for n in names)
    assert any(n.startswith("tests: test_ops_cuda.py -m gpu") for n in names)
    assert any(n.startswith("tests: test_context_parallel_gpu.py -m gpu") for n in names)
    one = " ".join(steps["train 1 GPU: TP1 bf16, fused kernels, full recompute, flash attention"])
    for flag in ("--bf16", "--require-fused-kernels", "--recompute-granularity full", "--attention-backend flash"):
        assert flag in one, flag
    assert [n for n in names if not n.startswith("tests") and ("save" in n or "resume" in n or "universal" in n)] == [
        "save (1 GPU, ZeRO-1)", "resume (1 GPU)", "tools/ds_to_universal.py global_step15",
        "universal resume (1 GPU, ZeRO-2)"]
    bench = next(c for n, c in steps.items() if n.startswith("bench"))
    assert bench[1].endswith("bench/bench_gpu.py") and "llama3-8b" in bench and "--compile" in bench
    assert not any("--nproc_per_node" in c for c in steps.values())


def test_plan_for_two_and_eight_gpus_adds_the_parallel_layouts(tmp_path):
    two, eight = _plan(2, tmp_path), _plan(8, tmp_path)
    layouts = {n: " ".join(c) for n, c in two.items() if n.startswith("train 2 GPUs")}
    wanted = {"TP2": "--tensor-model-parallel-size 2", "PP2": "--pipeline-model-parallel-size 2",
              "ZeRO-1": "--zero-stage 1", "ZeRO-2": "--zero-stage 2", "ZeRO-3": "--zero-stage 3",
              "offload": "--cpu-optimizer"}
    for key, flag in wanted.items():
        assert any(key in n and flag in c for n, c in layouts.items()), key
    assert "reshaped resume (2 GPUs: TP2 -> DP2 ZeRO-2)" in two and "universal resume (2 GPUs: PP2)" in two
    assert "train 8 GPUs: TP2 x PP2 x DP2, ZeRO-1" in eight and "train 4 GPUs: TP2 x PP2" in eight
    assert not any(n.startswith("train 8") for n in two)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A work directory holding what the plan's data steps make, and the checkpoint directory --load reads."""
    work = tmp_path_factory.mktemp("gpu_check")
    steps = _plan(1, work)
    env = {**os.environ, "PYTHONPATH": ROOT}
    for name in ("data: Python's pydoc topics as JSONL", "data: tools/preprocess_data.py, ByteTokenizer"):
        run = subprocess.run(steps[name], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        assert run.returncode == 0, (name, run.stderr[-2000:])
    (work / "checkpoints").mkdir()
    return work


@pytest.mark.parametrize("ngpus", [1, 2, 8])
def test_every_flag_the_plan_passes_is_accepted_by_the_real_parsers(work, ngpus):
    """pretrain_gpt.py commands through megatron_zero.arguments.parse_args (world size = their ranks), with the data
    the plan's own data steps make; ds_to_universal.py and bench_gpu.py through their parsers."""
    steps = _plan(ngpus, work)
    pretrains = [c for c in steps.values() if any(a.endswith("pretrain_gpt.py") for a in c)]
    assert len(pretrains) == {1: 6, 2: 12, 8: 14}[ngpus]
    for cmd in pretrains:
        nproc, flags = _pretrain_argv(cmd)
        args = parse_args(flags, world_size=nproc)
        assert args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.data_parallel_size == nproc
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import ds_to_universal
        for cmd in (c for c in steps.values() if c[1].endswith("ds_to_universal.py")):
            ds_to_universal.parse_arguments(cmd[2:])
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    bench = next(c for c in steps.values() if c[1].endswith("bench_gpu.py"))
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import bench_gpu
        parsed = bench_gpu.build_parser().parse_args(bench[2:])
        assert parsed.sizes == "llama3-8b" and parsed.compile and parsed.fp8 in (None, "tensorwise")
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))


def test_report_records_each_steps_result_and_numbers(tmp_path, monkeypatch):
    gc = _module(monkeypatch)
    line = (" [2026-01-01 00:00:00] iteration       20/      20 | throughput per GPU (TFLOP/s/GPU): 312.5 | "
            "lm loss: 2.500000E+00 | MFU: 31.60% |")
    py = sys.executable
    fake = [gc.Step("environment", [py, "-c", "print('torch 2.x CUDA 12.4 [\"NVIDIA H100\"]')"]),
            gc.Step("train 1 GPU: fake", [py, "-c", f"print({line!r})"], kind="train"),
            gc.Step("train 1 GPU: no training line", [py, "-c", "print('nothing')"], kind="train"),
            gc.Step("tests: fake -m gpu", [py, "-c", "import sys; print('== 3 passed, 1 failed in 2s =='); sys.exit(1)"],
                    kind="pytest")]
    monkeypatch.setattr(gc, "plan", lambda ngpus, work: fake)
    monkeypatch.setattr(gc, "cuda_devices", lambda: 1)
    monkeypatch.setenv("GPU_CHECK_WORKDIR", str(tmp_path / "work"))
    report = tmp_path / "REPORT.md"
    assert gc.main([str(report)]) == 1
    text = report.read_text()
    assert text.startswith("# GPU acceptance report (2/4 steps passed, 2 failed)")
    rows = {r.split(" | ")[1]: r for r in text.splitlines() if r.startswith("| ") and " | " in r}
    assert "| PASS |" in rows["train 1 GPU: fake"] and "| 31.60 | 312.5 | 2.500 |" in rows["train 1 GPU: fake"]
    assert "| FAIL |" in rows["train 1 GPU: no training line"]  # exit 0 but it never trained
    assert "| FAIL |" in rows["tests: fake -m gpu"] and "3 passed, 1 failed" in rows["tests: fake -m gpu"]
    assert "## Failures" in text and "### train 1 GPU: no training line" in text and "nothing" in text
    assert len(os.listdir(tmp_path / "work" / "logs")) == 4


def test_a_budget_cuts_the_running_step_and_reports_the_rest_as_not_run(tmp_path, monkeypatch, capsys):
    """--budget 4: a quick step passes, a step that would take a minute is killed when the budget ends (its
    timeout cut from 900 s), the steps after it are listed as not run; the report holds every step of the plan
    from the start, and the run ends with the report's path and a one-line summary (exit 1: a step failed)."""
    gc = _module(monkeypatch)
    fake = [gc.Step("environment", ["true"]), gc.Step("train: a minute long", ["sleep", "60"], kind="train"),
            gc.Step("bench: never reached", ["true"], kind="bench"),
            gc.Step("tests: never reached -m gpu", ["true"], kind="pytest")]
    seen = []
    write = gc.write_report
    monkeypatch.setattr(gc, "write_report", lambda path, outcomes, *a: seen.append([o.ran for o in outcomes])
                        or write(path, outcomes, *a))
    monkeypatch.setattr(gc, "plan", lambda ngpus, work: fake)
    monkeypatch.setattr(gc, "cuda_devices", lambda: 1)
    monkeypatch.setenv("GPU_CHECK_WORKDIR", str(tmp_path / "work"))
    report = tmp_path / "REPORT.md"
    assert gc.main(["--budget", "4", str(report)]) == 1
    text = report.read_text()
    assert text.startswith("# GPU acceptance report (1/4 steps passed, 1 failed, 2 not run)"), text
    assert "budget 4 s" in text
    rows = {r.split(" | ")[1]: r for r in text.splitlines() if r.startswith("| ") and " | " in r}
    assert "| PASS |" in rows["environment"]
    assert "| FAIL |" in rows["train: a minute long"] and "end of the budget" in rows["train: a minute long"]
    for name in ("bench: never reached", "tests: never reached -m gpu"):
        assert "| NOT RUN |" in rows[name] and "not run: the budget of 4 s was spent" in rows[name]
    assert seen[0] == [False] * 4 and all(len(s) == 4 for s in seen)  # the whole plan listed before anything ran
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"gpu_check: 1/4 steps passed, 1 failed, 2 not run within a budget of 4 s; report: {report}"


def test_budget_usage_errors_are_one_sentence(tmp_path):
    for argv in (["--budget", "soon", "R.md"], ["--budget", "0", "R.md"], ["--budget"], ["R.md", "S.md"]):
        run = _sh(*argv)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stdout == "", (argv, run.stderr)


def test_wheels_carried_under_whl_are_installed_offline_and_give_the_fp8_row(tmp_path, monkeypatch):
    gc = _module(monkeypatch)
    monkeypatch.setattr(gc, "WHEELS", str(tmp_path))
    assert gc.wheel_steps() == []  # nothing carried: no step
    for name in ("torchao-0.14.0-py3-none-any.whl", "crc32c-2.7-cp312-cp312-linux_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    (step,) = gc.wheel_steps()
    assert step.argv[1:7] == ["-m", "pip", "install", "--no-index", "--no-deps", "--find-links"]
    assert sorted(os.path.basename(a) for a in step.argv if a.endswith(".whl")) == sorted(os.listdir(tmp_path))
    bench = gc.bench_step(str(tmp_path)).argv
    assert bench[bench.index("--fp8") + 1] == "tensorwise" and "--compile" in bench

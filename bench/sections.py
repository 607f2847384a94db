"""The CPU sections of BENCHMARKS.md: each one's bench commands (its recorded arguments), the code it measures, and
its record line, the line under the section's heading that bench/run_all.py rewrites with each run:

    Run `mds`: 2026-11-28 07:55 UTC, load 3.10-2.90, code at `abc1234`. **Current**.
    Run `mds`: 2026-11-24, load 1-3, code at `cb1d364`. **Stale**: what changed since.

tests/test_benchmarks_current.py holds every section recorded **Current** to it: none of its files may differ from
the recorded commit's but for comments and docstrings (their ASTs, docstrings stripped, compared).
"""
from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")
RECORD = re.compile(r"^Run `(?P<name>[\w-]+)`: (?P<date>[^,]+), load (?P<load>[^,]+), code at `(?P<commit>[0-9a-f]{7,40})`"
                    r"\. \*\*(?P<status>Current|Stale)\*\*(?:\.|: (?P<why>.*)\.)$")
PEER = ("--mds-dir", "DIR", "--mds-python", "PY")  # Megatron-DeepSpeed's checkout and python (bench/peers/)
CORE = ("megatron_zero/training/trainer.py", "megatron_zero/model", "megatron_zero/tensor_parallel", "megatron_zero/pipeline",
        "megatron_zero/zero", "megatron_zero/ops", "megatron_zero/distributed/shm_comm.py", "csrc/cpu_ops")


@dataclass(frozen=True)
class Section:
    name: str  # run_all.py --section NAME
    heading: str  # its "## " heading in BENCHMARKS.md
    commands: Tuple[Tuple[str, ...], ...]  # each: bench/<script> and its arguments (PEER: the peer's paths)
    files: Tuple[str, ...]  # the code it measures: files or folders, from the repository root
    timing: bool = True  # its numbers are times (a quiet machine); False: bytes, counts, peak memory
    printed: str = "tables"  # what replaces the section's body: "tables" (its `|` tables in order), "block" (```)
    keep: Optional[Tuple[int, ...]] = None  # "tables": which printed tables the section shows (None: all)
    env: Tuple[Tuple[str, str], ...] = field(default_factory=tuple)


SECTIONS = (
    Section("mds", "Training throughput against Megatron-DeepSpeed",
            (("bench_vs_megatron_deepspeed.py",) + PEER + ("--reps", "2", "--iters", "10", "--warmup", "2"),
             ("bench_vs_megatron_deepspeed.py",) + PEER + ("--layouts", "dp2moe,dp2", "--reps", "3", "--iters", "4",
                                                            "--warmup", "1")),
            CORE + ("megatron_zero/moe",)),
    Section("vs-commit", "Training throughput against an earlier commit",
            (("bench_vs_commit.py", "--commit", "26f7e54", "--reps", "2", "--iters", "15", "--warmup", "5"),),
            CORE + ("megatron_zero/moe",)),
    Section("output-loss", "Output layer + loss at a 128K vocabulary", (("bench_output_loss.py",),),
            ("megatron_zero/tensor_parallel/output_loss.py", "megatron_zero/tensor_parallel/cross_entropy.py")),
    Section("zero-memory", "ZeRO memory per stage", (("bench_zero_memory.py",),),
            ("megatron_zero/zero/optimizer.py", "megatron_zero/zero/stage12.py", "megatron_zero/zero/grad_buckets.py",
             "megatron_zero/zero/stage3.py", "megatron_zero/zero/stage3_gather.py",
             "megatron_zero/zero/stage3_storage.py"), timing=False, keep=(1,)),
    Section("zeropp", "ZeRO++: quantized weights and gradients", (("bench_zeropp.py", "--steps", "12"),),
            ("megatron_zero/zero/stage3.py", "megatron_zero/zero/stage3_zeropp.py", "megatron_zero/zero/quantize.py",
             "megatron_zero/zero/stage3_gather.py"), timing=False),
    Section("host-reads", "One host read per training step",
            (("bench_step_host_reads.py", "--baseline", "e0c29b0", "--rounds", "2", "--iters", "24", "--configs",
              "dp2-zero1-h64"),), CORE, printed="none"),
    Section("shm", "Shared-memory collectives on one host", (("bench_shm_all_reduce.py", "--reps", "3", "--calls",
                                                               "50"),),
            ("megatron_zero/distributed/shm_comm.py", "megatron_zero/pipeline/shm_p2p.py")),
    Section("sp-copies", "Sequence parallelism: activation copies", (("bench_sp_copies.py",),),
            ("megatron_zero/tensor_parallel/mappings.py",), printed="none"),
    Section("activation-memory", "Activation memory: recomputation, attention backends, sequence parallelism",
            (("bench_activation_memory.py", "--seqs", "2048"),), ("megatron_zero/model", "megatron_zero/ops",
                                                                  "csrc/cpu_ops"), timing=False),
    Section("cp", "Context parallelism: longest sequence per rank's memory, tokens/s, ring overlap",
            (("bench_context_parallel.py",),), ("megatron_zero/context_parallel", "megatron_zero/model")),
    Section("cp-memory", "Context parallelism: ring attention's peak memory, flash kernel against query pieces",
            (("bench_cp_attention_memory.py", "--seqs", "4096", "8192"),), ("megatron_zero/context_parallel",
                                                                            "csrc/cpu_ops")),
    Section("moe", "MoE: against the dense model of equal active parameters, dispatch cost by E and top-k, memory by EP",
            (("bench_moe.py", "--tables", "b,c"),), ("megatron_zero/moe", "megatron_zero/zero")),
    Section("moe-grouped", "MoE grouped GEMM: expert weight bytes copied a forward", (("bench_moe.py", "--tables",
                                                                                      "d"),),
            ("megatron_zero/moe/grouped_mlp.py", "megatron_zero/moe/stacked_weights.py",
             "megatron_zero/zero/stage3_storage.py", "megatron_zero/zero/stage3_gather.py"), timing=False),
    Section("cpu-kernels", "Fused fp32 CPU kernels", (("bench_cpu_kernels.py", "--reps", "30"),),
            ("csrc/cpu_ops", "megatron_zero/ops"), env=(("OMP_NUM_THREADS", "1"),)),
    Section("cpu-adam", "Optimizer step on the CPU: C++ AdamW against torch and DeepSpeed",
            (("bench_cpu_adam.py", "--reps", "21"),), ("csrc/cpu", "megatron_zero/ops/cpu_adam.py",
                                                       "megatron_zero/zero/offload.py")),
    Section("checkpoint-save", "Checkpoint save", (("bench_checkpoint_save.py", "--reps", "3", "--no-torch-save"),),
            ("megatron_zero/checkpoint/save.py", "megatron_zero/checkpoint/storage")),
    Section("checkpoint-convert", "Checkpoint conversion against `dcp_to_torch_save`",
            (("bench_checkpoint_convert.py",),
             ("bench_checkpoint_convert.py", "--layers", "22", "--hidden", "2048", "--ffn", "5632", "--query-groups",
              "4", "--vocab", "32000")),
            ("megatron_zero/checkpoint/reshape", "megatron_zero/checkpoint/interop", "tools/convert_checkpoint.py"),
            printed="none"),
    Section("data", "Data: preprocessing, tokenizing, the start-up token check",
            (("bench_preprocess.py",), ("bench_gpt2_bpe.py",), ("bench_token_range.py", "--reps", "3")),
            ("tools/preprocess_data.py", "megatron_zero/data"), printed="block"),
)


def section(name: str) -> Section:
    for s in SECTIONS:
        if s.name == name:
            return s
    raise KeyError(f"no section {name!r}; the sections: {', '.join(s.name for s in SECTIONS)}")


def records(text: str) -> dict:
    """{name: the record line's fields} of BENCHMARKS.md's text."""
    return {m["name"]: m.groupdict() for m in map(RECORD.match, text.splitlines()) if m}


def _git(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *argv], capture_output=True, text=True)


def _code(source: str):
    """The AST of a Python source with its docstrings removed (comments are not in it) and its imports' module
    paths (the names imported stay: a module moved to another package is the same code), as text."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            node.module, node.level = None, 0
        elif isinstance(node, ast.Import):
            node.names = [ast.alias(name=a.asname or a.name.rsplit(".", 1)[-1]) for a in node.names]
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.lru_cache(maxsize=None)
def _renamed(commit: str) -> dict:
    """{path today: its path at `commit`} for the files git finds moved since (a module regrouped into a package)."""
    out = {}
    for line in _git("diff", "-M", "--name-status", commit).stdout.splitlines():
        fields = line.split("\t")
        if fields[0].startswith("R") and len(fields) == 3:
            out[fields[2]] = fields[1]
    return out


def changed_since(commit: str, paths) -> Optional[List[str]]:
    """The files under `paths` whose code differs between `commit` and the working tree (a Python file: by its
    AST without docstrings; any other: by its bytes); None when `commit` is not in this clone's history."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None
    diff = _git("diff", "--name-only", commit, "--", *paths).stdout.split()
    diff += _git("ls-files", "--others", "--exclude-standard", "--", *paths).stdout.split()
    changed = []
    for path in sorted(set(diff)):
        if not path.endswith(".py"):
            changed.append(path)
            continue
        before = _git("show", f"{commit}:{_renamed(commit).get(path, path)}")
        now = os.path.join(ROOT, path)
        if before.returncode != 0 or not os.path.exists(now):
            changed.append(path)  # added or removed since
            continue
        with open(now) as f:
            if _code(before.stdout) != _code(f.read()):
                changed.append(path)
    return changed

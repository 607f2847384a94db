"""bench/bench_gpu.py on the CPU at its tiny size (the script's logic; its numbers mean nothing here): every
side a row, the in-process sides timed in alternating blocks, and the pretrain_gpt.py row's flags taken by the
real parser as the Llama-3-8B shape at vocabulary 128256, seq 8192, 8 micro-batches a step."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_gpu  # noqa: E402

from megatron_zero.arguments import parse_args  # noqa: E402
from megatron_zero.data.tokenizers import NullTokenizer  # noqa: E402

TINY = ["--tiny", "--device", "cpu", "--micro-batches", "2", "--warmup", "1", "--no-offload", "--no-pretrain"]


@pytest.fixture
def one_thread():
    """A model this small runs fastest on one thread (on a loaded machine, many times faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_run_gives_every_side_a_row_timed_in_alternating_blocks(tmp_path, monkeypatch, one_thread):
    """4 timed steps in blocks of 2: after each side's warm-up, the sides take turns, the order reversed in the
    second round, each side's steps are 2 micro-batches each (forward-backward twice, one optimizer step)."""
    turns, timed = [], bench_gpu.timed

    def recording(step, batches, n, device):
        turns.append((step, n, len(batches)))
        return timed(step, batches, n, device)

    monkeypatch.setattr(bench_gpu, "timed", recording)
    rows = bench_gpu.main(TINY + ["--steps", "4", "--block", "2", "--json", str(tmp_path / "rows.json")])
    sides = ["baseline", "ours"]
    assert [r["side"] for r in rows] == sides and all(r["schedule"] == "interleaved" for r in rows)
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["micro_batches"] == 2 for r in rows), rows
    steps = [s for s, _, _ in turns[:2]]  # the warm-ups, in build order: one step function per side
    assert len(set(map(id, steps))) == 2 and all(n == 1 for _, n, _ in turns[:2])
    order = [steps.index(s) for s, _, _ in turns[2:]]
    assert order == [0, 1, 1, 0] and all(n == 2 and m == 2 for _, n, m in turns[2:]), turns
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert saved["micro_batches"] == 2 and [r["side"] for r in saved["rows"]] == sides


def test_sides_that_do_not_fit_together_run_one_after_the_other(monkeypatch, one_thread):
    """An out-of-memory while the sides are built together: everything is freed and each side runs alone."""
    calls = []

    def ours_once_short_of_memory(*x):
        calls.append(1)
        if len(calls) == 1:  # the first build, beside the baseline
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return bench_gpu.ours_step(*x)

    monkeypatch.setattr(bench_gpu, "SIDES", [bench_gpu.SIDES[0], ("ours", ours_once_short_of_memory, lambda s, a: True)])
    rows = bench_gpu.main(TINY + ["--steps", "1", "--block", "1"])
    assert [(r["side"], r["schedule"]) for r in rows] == [("baseline", "sequential"), ("ours", "sequential")]
    assert all(r["step_s"] > 0 for r in rows) and len(calls) == 2


def test_pretrain_row_flags_are_the_llama3_8b_shape_at_the_real_vocabulary():
    cfg = bench_gpu.config("llama3-8b", 8192, torch.bfloat16)
    flags = bench_gpu.pretrain_flags(cfg, 1, 8, 10, torch.device("cpu"))
    args = parse_args(flags, world_size=1)
    assert (args.seq_length, args.micro_batch_size, args.global_batch_size, args.hidden_size) == (8192, 1, 8, 4096)
    assert (args.num_layers, args.ffn_hidden_size, args.num_query_groups, args.rotary_base) == (32, 14336, 8, 500000)
    assert args.mock_data and args.swiglu and not args.add_bias_linear and args.untie_embeddings_and_output_weights
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "rope" and args.bf16
    assert args.tokenizer_type == "NullTokenizer" and NullTokenizer(args.vocab_size).vocab_size == 128256
    gpt = bench_gpu.pretrain_flags(bench_gpu.config("1.3B", 2048, torch.bfloat16), 4, 8, 10, torch.device("cpu"))
    args = parse_args(gpt, world_size=1)
    assert args.normalization == "LayerNorm" and args.add_bias_linear and NullTokenizer(args.vocab_size).vocab_size == 50304


# the default tier's tests above cover the rows and the flags; this one runs pretrain_gpt.py as the row does
@pytest.mark.slow
def test_tiny_run_times_pretrain_gpt_py_on_mock_data(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_gpu.py"), *TINY[:-1], "--steps", "1",
                          "--json", str(tmp_path / "rows.json")], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["side"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert list(rows) == ["pretrain_gpt.py", "baseline", "ours"]
    assert "error" not in rows["pretrain_gpt.py"] and rows["pretrain_gpt.py"]["step_s"] > 0, rows
    assert rows["pretrain_gpt.py"]["schedule"] == "own process"


@pytest.mark.slow
def test_compile_adds_the_compiled_row(one_thread):
    """--compile: a row for ours with each transformer layer compiled (inductor compiles in the warm-up)."""
    rows = bench_gpu.main(TINY + ["--steps", "1", "--block", "1", "--compile"])
    assert [r["side"] for r in rows] == ["baseline", "ours", "compiled"]
    assert all(r["step_s"] > 0 for r in rows), rows

"""The planner's time model beyond the GPU's work (megatron_zero/planning/time_model.py, host_step.py) and
docs/planning.md's scaling tables (megatron_zero/planning/scaling.py): an offloaded layout's step grows by the
modelled host step (our measured CPU AdamW per core, PCIe both ways); tools/plan.py's 6B one-GPU search ranks
the offload layouts by it; the page's tables are the module's output."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron_zero.planning.memory import Plan
from megatron_zero.planning.time_model import BUS_EFFICIENCY, Cluster, step_time
from megatron_zero.testing.tiny_gpt import tiny_gpt_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# GPT-J-sized (tests/test_plan.py's GPTJ_6B): 28 blocks of hidden 4096, seq 2048
GPTJ = tiny_gpt_config(28, hidden_size=4096, num_attention_heads=16, ffn_hidden_size=16384, seq_length=2048,
                       max_position_embeddings=2048, vocab_size=50400, position_embedding_type="rope")
PARAMETERS = 6_050_000_000


def _by_hand(partition, cores, gpus_per_node, micro_batches, compute, zero):
    """host_step.py's model written out from BENCHMARKS.md's figures: 79.9 ms per 100M parameters on one core,
    30 bytes a parameter over 80 % of 614.4 GB/s shared by the node's GPUs; PCIe 64 GB/s at the bus efficiency."""
    adam = partition * max(79.9e-3 / 100e6 / (cores // gpus_per_node), 30 / (0.8 * 614.4e9 / gpus_per_node))
    pcie = 64e9 * BUS_EFFICIENCY
    once = partition * 4 / pcie
    down = micro_batches * max(0.0, once - 2 / 3 * compute / micro_batches) if zero >= 2 else once
    return down + max(adam, partition * 2 / pcie)


@pytest.mark.parametrize("cores", [4, 112])
def test_offloaded_step_grows_by_the_modelled_host_step(cores):
    """One GPU, ZeRO-2, 4 micro-batches: the same layout with --cpu-optimizer takes the GPU's step plus the host's
    (the gradients down where backward does not hide them, then max(AdamW, the weights up)); 4 cores are bound
    by the per-core cost, 112 by the memory bus."""
    plan = Plan(GPTJ, zero_stage=2, micro_batch=1, global_batch=4)
    cluster = Cluster(gpus=1, gpus_per_node=1, host_cores=cores)
    gpu = step_time(plan, cluster, PARAMETERS)
    offloaded = step_time(dataclasses.replace(plan, offload="cpu"), cluster, PARAMETERS)
    want = _by_hand(PARAMETERS, cores, 1, 4, gpu.compute, 2)
    assert gpu.host == 0.0 and offloaded.host == pytest.approx(want, rel=1e-12)
    assert offloaded.seconds == pytest.approx(gpu.seconds + want, rel=1e-12)
    assert offloaded.tokens_per_second == pytest.approx(4 * 2048 / offloaded.seconds)
    assert offloaded.mfu < gpu.mfu
    # ZeRO-1 reduces once, at the step: its copy down is exposed in full; 8 GPUs a node share the cores and the bus
    one = step_time(dataclasses.replace(plan, offload="cpu", zero_stage=1), cluster, PARAMETERS)
    assert one.host == pytest.approx(_by_hand(PARAMETERS, cores, 1, 4, gpu.compute, 1), rel=1e-12)
    # what the search ranks by: at ZeRO-2 each micro-batch sends the partition down, so one micro-batch of 4
    # beats four of 1 once offloaded (on the GPU alone they tie)
    four = step_time(dataclasses.replace(plan, offload="cpu", micro_batch=4), cluster, PARAMETERS)
    assert four.tokens_per_second > offloaded.tokens_per_second
    assert step_time(dataclasses.replace(plan, micro_batch=4), cluster, PARAMETERS).seconds == gpu.seconds
    node = Cluster(gpus=8, gpus_per_node=8, host_cores=cores)
    eight = step_time(dataclasses.replace(plan, offload="cpu", dp=8, global_batch=32), node, PARAMETERS)
    assert eight.host == pytest.approx(_by_hand(-(-PARAMETERS // 8), max(cores, 8), 8, 4, eight.compute, 2),
                                       rel=1e-12)


GPTJ_6B = ("--num-layers 28 --hidden-size 4096 --num-attention-heads 16 --ffn-hidden-size 16384 --seq-length 2048 "
           "--max-position-embeddings 2048 --position-embedding-type rope --rotary-percent 0.25 "
           "--untie-embeddings-and-output-weights --vocab-size 50400 --train-iters 10 --lr 1e-5 --bf16 "
           "--micro-batch-size 1 --global-batch-size 4").split()


@pytest.mark.slow  # a 6B search, 20 s on a loaded 2-core machine; the default tier: the ranking's rule in
# test_offloaded_step_grows_by_the_modelled_host_step, the 6B search in test_plan.py's 24 GiB one
def test_plan_cli_6b_search_ranks_offload_layouts_by_the_host_step():
    """tools/plan.py --search, a GPT-J-sized 6B (global batch 4) on one 104 GiB GPU with 256 GiB of host memory
    and 8 host cores: the few device-only layouts that fit rank first; the offloaded ones follow, each slower
    by its host step (over half a second at 6e9 parameters), and at ZeRO-2 fewer, larger micro-batches rank higher (each
    micro-batch sends the fp32 gradient partition down over PCIe)."""
    argv = [*GPTJ_6B, "--gpus", "1", "--gpus-per-node", "1", "--gpu-memory", "104", "--host-memory", "256",
            "--host-cores", "8", "--search", "--json"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *argv], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    layouts = json.loads(out.stdout)["layouts"]
    speeds = [c["tokens_per_second"] for c in layouts]
    assert speeds == sorted(speeds, reverse=True)
    offloaded = [c for c in layouts if "--cpu-optimizer" in c["flags"]]
    on_device = [c for c in layouts if "--cpu-optimizer" not in c["flags"]]
    assert offloaded and on_device and layouts == on_device + offloaded, [c["layout"] for c in layouts]
    assert all(c["host_optimizer_seconds"] == 0 for c in on_device)
    adam = 6.0e9 * 79.9e-3 / 100e6 / 8  # BENCHMARKS.md's 0.8 ns a parameter on one core, over 8 cores: 0.6 s
    assert all(c["host_optimizer_seconds"] >= adam for c in offloaded)
    for c in offloaded:
        gpu_part = c["step_seconds"] - c["host_optimizer_seconds"]
        assert c["tokens_per_second"] == pytest.approx(4 * 2048 / (gpu_part + c["host_optimizer_seconds"]))
    zero2 = {c["layout"]: c["tokens_per_second"] for c in offloaded if "ZeRO-2" in c["layout"]}
    for recompute in ("none", "full"):
        ranked = [zero2[k] for mb in (4, 2, 1) if (k := f"TP1 PP1 CP1 EP1 DP1 ZeRO-2 mb{mb} recompute {recompute} "
                                                         "offload cpu") in zero2]
        assert ranked == sorted(ranked, reverse=True) and len(set(ranked)) == len(ranked), zero2


def test_plan_cli_refuses_a_host_without_cores_in_one_sentence(capsys):
    from megatron_zero.planning.cli import main
    assert main([*GPTJ_6B, "--host-cores", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host-cores 0" in err, err


def _page_tables() -> list:
    """docs/planning.md's tables under "## Scaling", in order."""
    with open(os.path.join(ROOT, "docs", "planning.md")) as f:
        section = f.read().split("\n## Scaling", 1)[1].split("\n## ", 1)[0]
    tables, rows = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            tables.append("\n".join(rows))
            rows = []
    return tables


def test_scaling_page_is_the_modules_output():
    """`python -m megatron_zero.planning.scaling` prints docs/planning.md's three scaling tables exactly."""
    from megatron_zero.planning import scaling
    assert _page_tables() == scaling.tables().split("\n\n")

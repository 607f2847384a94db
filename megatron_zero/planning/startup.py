"""pretrain_gpt.py's check before it builds the model on a GPU: will the predicted peak fit the device?

    problem = memory_plan_problem(plan, device_bytes, gpus_per_node)   # None, or one sentence
    check_device_memory(plan, device, gpus_per_node)                    # rank 0 plans, every rank refuses

The planner builds fake stages in a fake process group, which cannot live beside the run's real one:
check_device_memory runs it in a subprocess (`python -m megatron_zero.planning.startup`, the Plan pickled
through its stdin, the sentence or nothing on its stdout). --no-memory-plan-check turns the check off.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
from typing import Optional

import torch

from .memory import GIB, Plan, size
from .search import evaluate, search
from .time_model import Cluster

NEAREST = 3  # layouts that fit, named in the sentence


def memory_plan_problem(plan: Plan, device_bytes: int, gpus_per_node: int) -> Optional[str]:
    """None when the plan's predicted peak fits `device_bytes`; else one sentence: the peak, its largest
    parts, and the fastest layouts that fit, nearest first: the run's own TP x PP x CP x EP with another
    micro-batch, recomputation, ZeRO stage or offload, else any layout of the same GPUs."""
    cluster = Cluster(gpus=plan.gpus, gpus_per_node=gpus_per_node, gpu_memory_gib=device_bytes / GIB)
    cand = evaluate(plan, plan.config.recompute_granularity or "none", cluster)
    if cand.peak <= device_bytes:
        return None
    worst = max(cand.ranks, key=lambda r: r.peak)
    fitting = (search(plan, cluster, offload=plan.offload != "none", limit=NEAREST, fits_host=False, near=True)
               or search(plan, cluster, offload=plan.offload != "none", limit=NEAREST, fits_host=False))
    nearest = "; ".join(f"{c.flags()} ({size(c.peak)})" for c in fitting) or "none on these GPUs"
    return (f"this layout needs about {size(cand.peak)} on its {worst.kind} rank but the GPU has "
            f"{size(device_bytes)} (largest: {', '.join(worst.largest_parts())}); the fastest that fit: "
            f"{nearest} (tools/plan.py explains; --no-memory-plan-check skips this check)")


def check_device_memory(plan: Plan, device: torch.device, gpus_per_node: int) -> None:
    """On a CUDA device: rank 0 plans in a subprocess, every rank raises ArgumentError with its sentence
    when the run will not fit. Elsewhere nothing."""
    import torch.distributed as dist

    from ..config.errors import ArgumentError
    if device.type != "cuda":
        return
    problem = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        total = torch.cuda.get_device_properties(device).total_memory
        out = subprocess.run([sys.executable, "-m", "megatron_zero.planning.startup", str(total), str(gpus_per_node)],
                             input=pickle.dumps(plan), capture_output=True, timeout=600)
        problem[0] = out.stdout.decode().strip() or None if out.returncode == 0 else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ArgumentError(problem[0])


if __name__ == "__main__":
    found = memory_plan_problem(pickle.loads(sys.stdin.buffer.read()), int(sys.argv[1]), int(sys.argv[2]))
    print(found or "")

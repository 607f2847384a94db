"""tools/plan.py's output: the plan of one layout (table or JSON) and the search's ranking."""
from __future__ import annotations

import json
from typing import List

from .memory import GIB, RankMemory, host_bytes_per_node
from .search import Candidate
from .time_model import Cluster

PARTS = ("weights", "gradients", "optimizer", "activations", "buffers", "fp8")


def as_json(cand: Candidate, cluster: Cluster, host: dict, parameters: int, layouts: List[Candidate] = ()) -> str:
    ranks = {r.kind: r.as_dict() for r in cand.ranks}
    out = dict(parameters=parameters, layout=cand.describe(), per_rank_bytes=ranks,
               peak=cand.peak, fits=cand.peak <= cluster.gpu_memory_gib * GIB, host_bytes_per_node=host,
               step_seconds=cand.time.seconds, compute_seconds=cand.time.compute,
               exposed_comm_seconds=cand.time.exposed_comm, bubble_seconds=cand.time.bubble,
               host_optimizer_seconds=cand.time.host, mfu=cand.time.mfu,
               tokens_per_second=cand.time.tokens_per_second,
               tokens_per_second_per_gpu=cand.time.tokens_per_second / cand.plan.gpus, constants=cluster.named())
    if layouts:
        out["layouts"] = [dict(layout=c.describe(), flags=c.flags(), peak=c.peak, mfu=c.time.mfu,
                               step_seconds=c.time.seconds, host_optimizer_seconds=c.time.host,
                               tokens_per_second=c.time.tokens_per_second,
                               host_bytes_per_node=host_bytes_per_node(c.plan, list(c.ranks), cluster.gpus_per_node))
                          for c in layouts]
    return json.dumps(out, indent=1)


def as_table(cand: Candidate, cluster: Cluster, host: dict, parameters: int) -> str:
    gib = cluster.gpu_memory_gib * GIB
    lines = [f"model: {parameters / 1e9:.2f}e9 parameters; layout {cand.describe()} on {cand.plan.gpus} GPUs",
             f"{'rank kind':<14}" + "".join(f"{k:>12}" for k in (*PARTS, "peak")) + "  (GiB)"]
    for r in cand.ranks:
        lines.append(f"{r.kind:<14}" + "".join(f"{getattr(r, k) / GIB:>12.2f}" for k in PARTS)
                     + f"{r.peak / GIB:>12.2f}")
    verdict = "fits" if cand.peak <= gib else "does NOT fit"
    lines.append(f"peak {cand.peak / GIB:.1f} GiB of {cluster.gpu_memory_gib:g} GiB per GPU: {verdict}")
    lines.append("host per node (GiB): " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in host.items())
                 + f" of {cluster.host_memory_gib:g}")
    nvme = max(r.nvme_optimizer for r in cand.ranks)
    if nvme:
        lines.append(f"NVMe per rank: {nvme / GIB:.1f} GiB")
    t = cand.time
    host_step = f" + host optimizer {t.host:.3f}" if t.host else ""
    lines.append(f"step {t.seconds:.3f} s = compute {t.compute:.3f} + exposed communication {t.exposed_comm:.3f} "
                 f"+ bubble {t.bubble:.3f}{host_step}; MFU {100 * t.mfu:.1f} %; {t.tokens_per_second:,.0f} tokens/s "
                 f"({t.tokens_per_second / cand.plan.gpus:,.0f} per GPU)")
    lines.append("constants: " + ", ".join(f"{k}={v}" for k, v in cluster.named().items()))
    return "\n".join(lines)


def ranking(found: List[Candidate]) -> str:
    if not found:
        return "no layout fits"
    lines = [f"{'#':>2} {'layout':<62}{'peak GiB':>9}{'MFU %':>7}{'tokens/s/GPU':>13}"]
    for i, c in enumerate(found, 1):
        lines.append(f"{i:>2} {c.describe():<62}{c.peak / GIB:>9.1f}{100 * c.time.mfu:>7.1f}"
                     f"{c.time.tokens_per_second / c.plan.gpus:>13,.0f}")
    return "\n".join(lines)


def largest(ranks: List[RankMemory]) -> str:
    worst = max(ranks, key=lambda r: r.peak)
    return ", ".join(worst.largest_parts())

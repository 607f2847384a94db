"""The host's part of an offloaded step (--cpu-optimizer, NVMe offload): the gradients coming down over PCIe,
the C++ AdamW over this rank's partition on its share of the node's cores, the new weights going up.

    down     the fp32 gradient partition, 4 bytes an element, device -> host (zero/host_grads.py): ZeRO 2/3
             send each micro-batch's reduced buckets as they land, behind that micro-batch's backward
             (exposed: what exceeds the backward, BACKWARD_SHARE of its compute); ZeRO 0/1 reduce once, at
             the step, and the copy follows the reduce: exposed in full
    adam     partition x max(CPU_ADAM_CORE_SECONDS / threads, CPU_ADAM_BYTES / the rank's share of the
             host's memory bandwidth): per core it costs what we measured, and no more cores than the
             memory bus feeds; threads = the node's cores over its GPUs (ops/cpu_adam.py's
             default_offload_threads: this rank's share)
    up       the new weights in the model dtype, host -> device, chunk by chunk while the CPU steps the next
             chunk (zero/offload.py): the step takes max(adam, up)
The step is the GPU's work plus all of this: nothing of the host step overlaps the next forward (as
DeepSpeed's ZeRO-Offload without its delayed parameter update). NVMe offload's paging of the states
in and out of files is not modelled (its step is timed as --cpu-optimizer's).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import flag, section

# bench/bench_cpu_adam.py (BENCHMARKS.md, "Optimizer step on the CPU", run 2026-11-28 at d4c6970): our C++ AdamW
# with the bf16 copy-out, one thread, one 100M-parameter partition: 79.9 ms median (10M: 8.2 ms, the same per
# parameter); 2 threads ran 1.37x faster on that loaded 2-core machine, which is why the bus is modelled too
CPU_ADAM_CORE_SECONDS = 79.9e-3 / 100e6
# one pass a parameter: master, gradient and two moments read (16 bytes), master and moments written (12),
# the bf16 weight written (2)
CPU_ADAM_BYTES = 30
HOST_CORES = 112            # a DGX H100 node: two 56-core Xeon Platinum 8480C (NVIDIA's DGX H100 user guide)
HOST_MEMORY_GBPS = 0.8 * 614.4  # the same node's 16 channels of DDR5-4800 (614.4 GB/s) at STREAM's typical 80 %
PCIE_GBPS = 64.0            # PCIe Gen5 x16 per direction, each H100 SXM's link to its host
BACKWARD_SHARE = 2 / 3      # backward's share of a micro-batch's compute (twice the forward's FLOPs)


@section("the host of an offloaded optimizer (tools/plan.py)")
class HostConfig:
    """The host side of --cpu-optimizer layouts: how many cores step the offloaded AdamW, how fast PCIe moves."""
    host_cores: int = flag("CPU cores per node that step an offloaded optimizer (--cpu-optimizer), shared by the "
                           "node's GPUs (default: a DGX H100 node's 112)", HOST_CORES)
    pcie_bandwidth: float = flag("GB/s per direction between each GPU and host memory (default: PCIe Gen5 x16, 64)",
                                 PCIE_GBPS)


@dataclass(frozen=True)
class HostStep:
    down: float      # the gradients' copy not hidden behind backward
    adam: float
    up: float

    @property
    def seconds(self) -> float:
        return self.down + max(self.adam, self.up)


def host_step(partition: int, weight_bytes: int, zero_stage: int, micro_batches: int, compute_seconds: float,
              cluster, bus_efficiency: float) -> HostStep:
    """The host step of one rank holding `partition` elements of fp32 master (its ZeRO share), whose weights are
    `weight_bytes` an element on the GPU and whose GPU work computes for `compute_seconds` a step."""
    ranks = max(1, min(cluster.gpus_per_node, cluster.gpus))
    threads = max(1, cluster.host_cores // ranks)
    pcie = cluster.pcie_gbps * 1e9 * bus_efficiency
    per_element = max(CPU_ADAM_CORE_SECONDS / threads, CPU_ADAM_BYTES / (HOST_MEMORY_GBPS * 1e9 / ranks))
    down_once = partition * 4 / pcie
    if zero_stage >= 2:
        backward = BACKWARD_SHARE * compute_seconds / micro_batches
        down = micro_batches * max(0.0, down_once - backward)
    else:
        down = down_once
    return HostStep(down, partition * per_element, partition * weight_bytes / pcie)

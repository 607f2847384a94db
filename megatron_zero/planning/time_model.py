"""Step time of a layout: compute at a calibrated efficiency, the communication that is not hidden, the
pipeline bubble; MFU and tokens/s. Every constant is named and printed beside the prediction.

    compute    = model FLOPs x (4/3 under full recomputation) / (GPUs x peak x COMPUTE_EFFICIENCY)
    TP         = 4 all-reduces (2 forward, 2 backward) of [mb, s/cp, h] per layer and micro-batch over the
                 TP group, at the intra-node bandwidth when TP fits a node; exposed: all of it (no async TP)
    CP         = the K/V ring, 2 x [mb, s/cp, kv] per layer, forward and backward: hidden behind attention
                 up to CP_OVERLAP
    DP (ZeRO)  = one reduce-scatter of the gradients and one all-gather of the weights per step (ZeRO-3:
                 the all-gather again in backward), ring bytes 2 (d-1)/d x the stage's bytes, at the
                 inter-node bandwidth when DP spans nodes; exposed: DP_EXPOSED of it
    EP         = the tokens' all-to-all, twice per MoE layer forward and backward, exposed
    bubble     = (pp - 1) / (micro-batches x virtual stages) of the compute (1F1B; interleaved with
                 --num-layers-per-virtual-pipeline-stage, Megatron's bubble over the virtual stages)
    host       under --cpu-optimizer: the gradients down, the CPU's AdamW, the weights up (host_step.py)
MFU = model FLOPs / (step time x GPUs x peak), Megatron's definition (recomputation does not count).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..metrics.throughput import model_flops_per_iteration
from .host_step import (CPU_ADAM_BYTES, CPU_ADAM_CORE_SECONDS, HOST_CORES, HOST_MEMORY_GBPS, PCIE_GBPS,
                        host_step)

# fitted on our H200 run of GPT 1.3B, seq 2048, mb 4, GA 8, bf16, one GPU: 58.2k tokens/s (BENCHMARKS.md, the GPU
# section), 46.2 % MFU by model_flops_per_iteration's count (Megatron-LM's: attention over the causal half; the
# section's 49.8 % counted the whole s x s); checked against the same run's Llama-3-8B shape (16 layers, seq 4096, mb 1,
# GA 8): 20.5k tokens/s, 46.8 % by that count
COMPUTE_EFFICIENCY = 0.462
H100_BF16_TFLOPS = 989.0           # dense bf16 peak, H100 and H200 SXM (NVIDIA's data sheets)
FP8_SPEEDUP = 2.0                  # FP8 peak over bf16 (the data sheets); the matmuls' share only
FP8_MATMUL_SHARE = 0.8             # share of the step's compute in FP8-able matmuls
NVLINK_GBPS = 450.0                # NVLink 4 per direction per GPU (900 GB/s bidirectional)
IB_GBPS = 50.0                     # 400 Gb/s InfiniBand NDR per GPU
BUS_EFFICIENCY = 0.8               # achieved bus bandwidth over the link rate (nccl-tests' typical busbw)
DP_EXPOSED = 0.3                   # of the DP traffic not hidden behind backward (overlapped buckets)
CP_OVERLAP = 0.9                   # of the CP ring hidden behind attention


@dataclass(frozen=True)
class Cluster:
    gpus: int = 8
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    gpu_tflops: float = H100_BF16_TFLOPS
    intra_node_gbps: float = NVLINK_GBPS
    inter_node_gbps: float = IB_GBPS
    host_memory_gib: float = 2048.0
    compute_efficiency: float = COMPUTE_EFFICIENCY
    host_cores: int = HOST_CORES          # per node, stepping an offloaded optimizer
    pcie_gbps: float = PCIE_GBPS          # per GPU and direction, host <-> device

    def named(self) -> dict:
        return {**asdict(self), "bus_efficiency": BUS_EFFICIENCY, "dp_exposed": DP_EXPOSED,
                "cp_overlap": CP_OVERLAP, "fp8_speedup": FP8_SPEEDUP, "fp8_matmul_share": FP8_MATMUL_SHARE,
                "cpu_adam_core_seconds": CPU_ADAM_CORE_SECONDS, "cpu_adam_bytes": CPU_ADAM_BYTES,
                "host_memory_gbps": HOST_MEMORY_GBPS}


@dataclass(frozen=True)
class StepTime:
    compute: float
    exposed_comm: float
    bubble: float
    mfu: float
    tokens_per_second: float
    host: float = 0.0          # the offloaded optimizer's step where it is not overlapped (host_step.py)

    @property
    def seconds(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.host

    def as_dict(self) -> dict:
        return {**asdict(self), "step_seconds": self.seconds}


def _link(group_span: int, cluster: Cluster) -> float:
    """Bytes/s one GPU moves in a collective over `group_span` consecutive ranks."""
    gbps = cluster.intra_node_gbps if group_span <= cluster.gpus_per_node else cluster.inter_node_gbps
    return gbps * 1e9 * BUS_EFFICIENCY


def step_time(plan, cluster: Cluster, stage_parameters: int, recompute: str = None, fp8: bool = False,
              partition: int = None) -> StepTime:
    """`partition`: this rank's fp32 master elements (default: the stage's over DP x CP at ZeRO >= 1), which an
    offloaded optimizer steps on the host."""
    c = plan.config
    s, h, L = c.seq_length, c.hidden_size, c.num_layers
    flops = model_flops_per_iteration(c, plan.global_batch, plan.tp)
    hardware = flops * (4 / 3 if recompute == "full" else 1.0)
    peak = cluster.gpu_tflops * 1e12
    if fp8:
        peak = peak / (1 - FP8_MATMUL_SHARE + FP8_MATMUL_SHARE / FP8_SPEEDUP)
    compute = hardware / (plan.gpus * peak * cluster.compute_efficiency)
    wb = plan.dtype.itemsize
    micro = plan.num_micro_batches
    layers_here = L / plan.pp
    tp = 0.0
    if plan.tp > 1:
        msg = plan.micro_batch * (s // plan.cp) * h * wb
        tp = 4 * layers_here * micro * 2 * (plan.tp - 1) / plan.tp * msg / _link(plan.tp, cluster)
    cp = 0.0
    if plan.cp > 1:
        kv = 2 * plan.micro_batch * (s // plan.cp) * (c.qkv_size - h) // max(1, plan.tp) * wb
        cp = (1 - CP_OVERLAP) * 3 * layers_here * micro * (plan.cp - 1) * kv / _link(plan.tp * plan.cp, cluster)
    dp = 0.0
    ranks_dp = plan.dp * plan.cp
    if ranks_dp > 1:
        passes = 3 if plan.zero_stage == 3 else 2
        dp_bytes = passes * 2 * (ranks_dp - 1) / ranks_dp * stage_parameters * wb
        dp = DP_EXPOSED * dp_bytes / _link(plan.tp * ranks_dp * plan.pp, cluster)
    ep = 0.0
    if c.num_experts and plan.ep > 1:
        moe_layers = sum(map(c.is_moe_layer, range(L))) / plan.pp  # a pattern (first k dense) or every N-th
        tokens = plan.micro_batch * (s // plan.cp) * c.moe_router_topk
        ep = 4 * moe_layers * micro * (plan.ep - 1) / plan.ep * tokens * h * wb / _link(plan.tp * plan.ep, cluster)
    bubble = compute * (plan.pp - 1) / (micro * plan.virtual_stages) if plan.pp > 1 else 0.0
    host = 0.0
    if plan.offload != "none":
        if partition is None:
            partition = -(-stage_parameters // ranks_dp) if plan.zero_stage >= 1 else stage_parameters
        host = host_step(partition, wb, plan.zero_stage, micro, compute, cluster, BUS_EFFICIENCY).seconds
    seconds = compute + tp + cp + dp + ep + bubble + host
    tokens = plan.global_batch * s / seconds
    return StepTime(compute, tp + cp + dp + ep, bubble, flops / (seconds * plan.gpus * cluster.gpu_tflops * 1e12),
                    tokens, host)

"""ZeRO data parallelism: partitioned AdamW (stages 0-3), mixed precision, clipping, offload."""
from .loss_scaler import LossScaler, LossScalerConfig
from .optimizer import ZeroOptimizer
from .partition import (GroupPartition, fragment_address, group_paddings, param_slice_mappings,
                        partition_group, partition_groups, zero3_group_offsets, zero3_param_partition)

__all__ = ["ZeroOptimizer", "LossScaler", "LossScalerConfig", "GroupPartition", "fragment_address",
           "group_paddings", "param_slice_mappings", "partition_group", "partition_groups",
           "zero3_group_offsets", "zero3_param_partition"]

"""What an FP8 run asks for, as torchao's float8 training configuration.

`Float8Settings` holds Megatron-LM's FP8 choices that torchao can do: the format (e4m3 everywhere, or
hybrid: e4m3 forward, e5m2 for the output gradient), the scaling recipe (Transformer Engine's delayed
scaling, built here on torchao's tensorwise casts, fp8/delayed.py, with its amax history length and
compute algorithm; torchao's tensorwise, rowwise, rowwise_with_gw_hp), the margin (each scale divided by 2^margin, headroom below the FP8 maximum) and
emulation (the FP8 GEMMs done in fp32 on the FP8 values, for CPUs and GPUs without FP8 tensor cores).
`linear_config()` is torchao's Float8LinearConfig of the recipe with the format's dtypes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..distributed.device_error import DeviceError

if TYPE_CHECKING:  # torch loads when a device is asked about, not when the flags are checked
    import torch

FORMATS = ("e4m3", "hybrid")
RECIPES = ("delayed", "tensorwise", "rowwise", "rowwise_with_gw_hp")
DEFAULT_RECIPE = "delayed"  # Megatron-LM's
ALGOS = ("max", "most_recent")  # delayed scaling's amax compute algorithm (fp8/delayed.py)


class Float8Error(DeviceError):
    """FP8 asked for where it cannot run (one sentence)."""


def import_torchao_float8():
    """torchao's float8 package, or one sentence saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise Float8Error(f"--fp8-format needs torchao's float8 training ({err}); install it with "
                          "`pip install megatron_zero[fp8]` (docs/fp8.md)") from None
    return float8


@dataclass(frozen=True)
class Float8Settings:
    format: str = "hybrid"
    recipe: str = DEFAULT_RECIPE
    margin: int = 0
    emulate: bool = False
    amax_history_len: int = 1  # delayed scaling's (Megatron-LM's defaults)
    amax_compute_algo: str = "most_recent"
    param_gather: bool = False  # --fp8-param-gather: ZeRO all-gathers the weights in FP8 (param_gather.py)

    @classmethod
    def from_args(cls, args) -> "Float8Settings":
        """The flags (unset ones: the fields' defaults above, the one place they are written)."""
        return cls(args.fp8_format, args.fp8_recipe or cls.recipe, args.fp8_margin, args.fp8_emulate,
                   args.fp8_amax_history_len or cls.amax_history_len,
                   args.fp8_amax_compute_algo or cls.amax_compute_algo, args.fp8_param_gather)

    @property
    def delayed(self) -> bool:
        return self.recipe == "delayed"

    def linear_config(self):
        """torchao's Float8LinearConfig: the recipe's scaling, the format's FP8 dtypes, emulation."""
        float8 = import_torchao_float8()
        # delayed scaling casts tensorwise, with the scales of its amax histories
        config = float8.Float8LinearConfig.from_recipe_name("tensorwise" if self.delayed else self.recipe)
        e4m3, e5m2 = float8.config.e4m3_dtype, float8.config.e5m2_dtype  # the fnuz variants on ROCm
        grad = e5m2 if self.format == "hybrid" else e4m3

        def with_dtype(cast, dtype):
            return dataclasses.replace(cast, target_dtype=dtype)

        return dataclasses.replace(
            config, emulate=self.emulate,
            cast_config_input=with_dtype(config.cast_config_input, e4m3),
            cast_config_input_for_grad_weight=with_dtype(config.cast_config_input_for_grad_weight,
                                                         e4m3),
            cast_config_weight=with_dtype(config.cast_config_weight, e4m3),
            cast_config_weight_for_grad_input=with_dtype(config.cast_config_weight_for_grad_input,
                                                         e4m3),
            cast_config_grad_output=with_dtype(config.cast_config_grad_output, grad),
            cast_config_grad_output_for_grad_weight=with_dtype(config.cast_config_grad_output_for_grad_weight, grad))


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 8.9 (Ada) or later: the first with FP8 tensor cores."""
    import torch

    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def require_fp8_device(device: torch.device, emulate: bool) -> None:
    if emulate or has_fp8_tensor_cores(device):
        return
    import torch

    where = ("the CPU" if device.type != "cuda" else
             f"{torch.cuda.get_device_name(device)} (compute capability "
             f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})")
    raise Float8Error(f"--fp8-format needs FP8 tensor cores (an NVIDIA GPU of compute capability 8.9 or later: "
                      f"Ada, Hopper, Blackwell) and this rank trains on {where}; train in --bf16, or add "
                      "--fp8-emulate to run the FP8 GEMMs emulated in fp32 (slow; for tests)")

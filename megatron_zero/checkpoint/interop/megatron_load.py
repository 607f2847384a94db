"""`--load` of a Megatron-LM checkpoint (a save directory with latest_checkpointed_iteration.txt, or one
iter_XXXXXXX directory), at whatever TP x PP x DP and ZeRO stage this run has.

    client = load_megatron_checkpoint(path, state, model, optimizer, ckpt_format=None)  # None: not Megatron-LM's

`ckpt_format` is Megatron-LM's --ckpt-format: given, the checkpoint found must be in that format; absent,
the format is detected. Our own save directories (with `latest`) are not Megatron-LM's and give None.
"""
from __future__ import annotations

from typing import Optional

from ..errors import CheckpointError
from ..report import loaded_line
from ..reshape.universal_load import load_from
from .megatron_layout import LEGACY, TORCH_DIST, find_megatron_checkpoint
from .torch_dist import TorchDistFiles

FORMATS = (TORCH_DIST, LEGACY)


def load_megatron_checkpoint(path: str, state, model, optimizer, load_optimizer: bool = True,
                             ckpt_format: Optional[str] = None, log=print, check=None) -> Optional[dict]:
    found = find_megatron_checkpoint(path)
    if found is None:
        return None
    directory, kind = found
    if ckpt_format is not None and ckpt_format != kind:
        raise CheckpointError(f"--ckpt-format {ckpt_format} but --load {path} holds a Megatron-LM {kind} "
                              f"checkpoint ({directory}); pass --ckpt-format {kind} or leave it out")
    if kind == LEGACY:
        from .megatron_legacy import LegacyFiles
        files = LegacyFiles(directory, model.config)
    else:
        files = TorchDistFiles(directory, model.config)
    if check:
        check(directory)
    client = load_from(files, state, model, optimizer, load_optimizer)
    log(loaded_line(directory, f"Megatron-LM {kind}", client, f"{state.layout}, ZeRO-{optimizer.stage}"))
    return client

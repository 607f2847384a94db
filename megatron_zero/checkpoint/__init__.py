"""Checkpoints in DeepSpeed / Megatron-DeepSpeed's layout, written crash-safely, in parallel, streamed.

    save_checkpoint(save_dir, iteration, state, model, optimizer, client_state, async_save=False, keep_last_k=None)
    client_state = load_checkpoint(load_dir, state, model, optimizer, load_optimizer=True)
    finalize_async_saves()
"""
from .errors import CheckpointError
from .load import load_checkpoint
from .storage.reader import add_verify_flag, open_checkpoint
from .save import finalize_async_saves, save_checkpoint
from .storage.tensor_io import clone_tensors_for_torch_save

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "finalize_async_saves", "open_checkpoint",
           "add_verify_flag", "clone_tensors_for_torch_save"]

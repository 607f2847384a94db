"""Turn a list of GPT samples (seq_length+1 tokens each) into model inputs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch


def collate_gpt(samples: Sequence[np.ndarray]) -> Dict[str, "torch.Tensor"]:
    """{'tokens': int64 [b, s], 'labels': int64 [b, s]}: labels are tokens shifted left by one."""
    import torch  # here, so that data tools (preprocess, corpus) start without loading torch

    text = torch.from_numpy(np.stack([np.asarray(s, dtype=np.int64) for s in samples]))
    return {"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous()}

"""Sampling text from a (single-process) GPT: greedy, temperature, top-k and top-p."""
from __future__ import annotations

from typing import List, Optional

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set with mass >= top_p."""
    logits = logits.clone()
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches top_p
        sorted_logits[drop] = float("-inf")
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(model, prompt_ids: List[int], max_new_tokens: int, vocab_size: int, seq_length: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0, greedy: bool = False,
             eod: Optional[int] = None, seed: int = 0) -> List[int]:
    """Extend prompt_ids by up to max_new_tokens tokens (stops at eod)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids) or ([eod] if eod is not None else [0])
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-seq_length:]], dtype=torch.long)
        logits = model(context)[0, -1, :vocab_size].float()  # padded vocabulary rows never sampled
        if greedy or temperature <= 0:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        ids.append(token)
        if eod is not None and token == eod:
            break
    return ids

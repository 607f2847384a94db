import torch

from megatron_zero.generation import filter_logits, generate
from megatron_zero.model.config import GPTConfig
from megatron_zero.model.gpt import reference_model


def test_top_k_and_top_p_filters():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [True, False, False, True]
    probs = torch.softmax(logits, -1)  # ~[.03, .64, .24, .09]
    kept = ~torch.isinf(filter_logits(logits, top_p=0.8))
    assert kept.tolist() == [False, True, True, False] and probs[kept].sum() >= 0.8


def test_greedy_generation_is_deterministic_and_in_vocab():
    cfg = GPTConfig(vocab_size=50, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
                    max_position_embeddings=16, make_vocab_size_divisible_by=64)
    model = reference_model(cfg)
    a = generate(model, [1, 2, 3], 20, cfg.vocab_size, cfg.seq_length, greedy=True)
    b = generate(model, [1, 2, 3], 20, cfg.vocab_size, cfg.seq_length, greedy=True)
    assert a == b and len(a) == 23 and all(0 <= t < 50 for t in a)
    c = generate(model, [1, 2, 3], 20, cfg.vocab_size, cfg.seq_length, temperature=1.0, top_k=5, seed=3)
    assert all(0 <= t < 50 for t in c)

"""A small GPT pipeline stage with its ZeRO optimizer and one training step on random tokens: what the
checkpoint layout, fault-injection, safe-loading and offload tests save and load."""
import torch

from ..model.config import GPTConfig
from ..pipeline.gpt_stage import build_gpt_stage, make_forward_step, sync_tied_embedding_grads
from ..pipeline.p2p import P2P
from ..pipeline.schedule import forward_backward
from ..distributed.topology import build_parallel_state
from ..zero import ZeroOptimizer

CONFIG = dict(vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
              max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)


def build_stage(tp, pp, zero, hidden=32):
    """-> (parallel state, GPTConfig, this rank's pipeline stage, its ZeroOptimizer at `zero`, lr 1e-2)."""
    state = build_parallel_state(tp, pp)
    config = GPTConfig(**dict(CONFIG, hidden_size=hidden))
    model = build_gpt_stage(config, state)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=zero, lr=1e-2,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=model)
    return state, config, model, opt


def random_train_step(state, config, model, opt):
    """One 1F1B step on a micro-batch of random tokens (seeded by the DP rank) and the optimizer step."""
    g = torch.Generator().manual_seed(1 + state.dp_rank)
    micro = [{"tokens": torch.randint(0, 100, (2, 16), generator=g), "labels": torch.randint(0, 100, (2, 16),
                                                                                               generator=g)}]
    p2p = P2P(state.prev_rank, state.next_rank, (2, 16, config.hidden_size), torch.float32)
    forward_backward(make_forward_step(model, micro, state), 1, p2p, state.pp_rank, state.pp_size,
                     backward_loss=opt.backward)
    opt.impl.finish_backward()
    sync_tied_embedding_grads(model, state)
    opt.step()

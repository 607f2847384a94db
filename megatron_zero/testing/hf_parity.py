"""What the Hugging Face import/export tests compare: fixed token batches, our model's logits from a checkpoint,
an exported directory's tensors, and the first training loss after loading an import at TP x PP."""
import os

import torch
import torch.distributed as dist

from ..checkpoint.export.consolidate import get_fp32_state_dict
from ..checkpoint.reshape.universal_load import load_universal_checkpoint
from ..model.gpt import reference_model
from ..model.params import param_names
from ..model.sharding import shard_state_dict
from ..pipeline.gpt_stage import activation_shape, build_gpt_stage, make_forward_step
from ..pipeline.p2p import P2P
from ..pipeline.schedule import broadcast_loss, forward_backward
from ..distributed.topology import build_parallel_state
from ..training.trainer import param_groups
from ..zero import ZeroOptimizer

VOCAB, SEQ = 100, 8


def tokens(batch=3):
    """`batch` fixed random sequences of SEQ token ids below VOCAB."""
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))


def our_logits(ckpt, config, toks):
    """Our single-process model's logits on `toks` with the weights (and persistent buffers: the expert bias) of
    checkpoint `ckpt` (padding cut)."""
    model = reference_model(config)
    full, params = get_fp32_state_dict(ckpt), set(param_names(config))
    buffers = {n: t for n, t in full.items() if n not in params}  # whole at every layout
    model.load_state_dict({**shard_state_dict({n: t for n, t in full.items() if n in params}, config, 1, 0), **buffers})
    model.eval()
    with torch.no_grad():
        return model(toks)[..., :config.vocab_size]


def hf_tensors(path):
    """Every tensor of the safetensors files in HF directory `path`, by name."""
    import safetensors.torch as safetensors_torch

    files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        out.update(safetensors_torch.load_file(os.path.join(path, f)))
    return out


def first_loss(tp, pp, ckpt, config, ep=1):
    """Load the import at this layout (weights only; `ep`: expert-parallel, carved out of DP), run one training
    step; return the loss before it (every DP rank feeds the same micro-batches)."""
    state = build_parallel_state(tp=tp, pp=pp, ep=ep)
    model = build_gpt_stage(config, state)
    opt = ZeroOptimizer(param_groups(model, 0.0), dp_group=state.dp_group, stage=1, lr=1e-3,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=model,
                        expert_dp_group=state.expert_dp_group)
    client = load_universal_checkpoint(ckpt, state, model, opt)
    assert client["iteration"] == 0 and client["weights_only"]
    toks = tokens(4)
    micro = [{"tokens": toks[:, :-1][i:i + 2], "labels": toks[:, 1:][i:i + 2]} for i in (0, 2)]
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(2, config), torch.float32)
    out = forward_backward(make_forward_step(model, micro, state), 2, p2p, state.pp_rank, pp,
                           backward_loss=opt.backward)
    opt.impl.finish_backward()
    assert opt.step(lr=1e-3)[0]
    loss = broadcast_loss(out, state.is_last_stage, state.layout.pp_group(state.rank)[-1],
                          state.pp_group, state.dp_group)
    dist.barrier()
    return loss

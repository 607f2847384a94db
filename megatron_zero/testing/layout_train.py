"""A tiny GPT trained at one TP x PP x ZeRO-stage layout and micro-batch size on a fixed global batch of 8,
saving a checkpoint at an iteration or resuming from a universal or plain one, for the reshape tests."""
import torch
import torch.distributed as dist

from ..checkpoint import save_checkpoint
from ..checkpoint.reshape.universal_load import load_reshaped_checkpoint, load_universal_checkpoint
from ..model.sharding import gather_state_dicts
from ..pipeline.gpt_stage import activation_shape, build_gpt_stage, make_forward_step, sync_tied_embedding_grads
from ..pipeline.p2p import P2P
from ..pipeline.schedule import broadcast_loss, forward_backward
from ..distributed.topology import build_parallel_state
from ..training.trainer import param_groups
from ..zero import ZeroOptimizer
from .tiny_gpt import tiny_gpt_config

GBS, ITERS, SAVE_AT, LR = 8, 20, 10, 1e-2


def config():
    """The tiny GPT every run here trains (4 layers, hidden 32, vocabulary 100)."""
    return tiny_gpt_config()


def global_batch(it):
    g = torch.Generator().manual_seed(1000 + it)
    start = torch.randint(0, 100, (GBS, 1), generator=g)
    tokens = (start * 7 + 3 * torch.arange(9)) % 100  # a learnable sequence per sample
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def train(tp, pp, stage, mb, save_dir=None, load=None, load_kind="universal", iters=ITERS, save_at=SAVE_AT,
          cfg=None, muon=None):
    """Train to `iters` (from `load` if given); return coords, per-iteration losses, TP-form weights. `muon`
    (optimizer/muon.py's MuonSettings): the blocks' matrices step by Muon (the checkpoint's args say so)."""
    state = build_parallel_state(tp=tp, pp=pp)
    cfg = cfg or config()
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(param_groups(model, 0.01, muon=muon is not None), dp_group=state.dp_group, stage=stage,
                        lr=LR, weight_decay=0.01, mp_group=state.mp_group, tp_rank=state.tp_rank, module=model,
                        muon=muon, tp_group=state.tp_group)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(mb, cfg), torch.float32)
    start = 0
    if load is not None:
        loader = load_universal_checkpoint if load_kind == "universal" else load_reshaped_checkpoint
        client = loader(load, state, model, opt)
        start = client["iteration"]
        assert client["consumed_train_samples"] == start * GBS
    dp, r = state.dp_size, state.dp_rank
    m = GBS // (mb * dp)  # gradient accumulation steps, recomputed for this layout
    losses = {}
    for it in range(start, iters):
        tokens, labels = global_batch(it)
        micro = [{"tokens": tokens[j * mb * dp + r * mb:][:mb], "labels": labels[j * mb * dp + r * mb:][:mb]}
                 for j in range(m)]
        out = forward_backward(make_forward_step(model, micro, state), m, p2p, state.pp_rank, pp,
                               backward_loss=opt.backward)
        opt.impl.finish_backward()
        sync_tied_embedding_grads(model, state)
        updated, _ = opt.step(lr=LR)
        assert updated
        losses[it] = broadcast_loss(out, state.is_last_stage, state.layout.pp_group(state.rank)[-1],
                                    state.pp_group, state.dp_group)
        if save_dir is not None and it + 1 == save_at:
            save_checkpoint(save_dir, it + 1, state, model, opt,
                            {"iteration": it + 1, "consumed_train_samples": (it + 1) * GBS,
                             "args": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                      "global_batch_size": GBS, "micro_batch_size": mb,
                                      "optimizer": "muon" if muon is not None else "adamw"},
                             "lr_scheduler": {"num_steps": it + 1}})
    if stage == 3:
        with opt.impl.gathered():
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    dist.barrier()
    return state.layout.coords(state.rank), losses, weights


def full_weights(results, cfg=None):
    """Gather every stage's TP-form weights (DP rank 0) into one full-form state dict."""
    full = {}
    stages = sorted({c[0] for c, _, _ in results})
    for pp in stages:
        shards = [w for (p, d, t), _, w in sorted(results, key=lambda x: x[0][2]) if p == pp and d == 0]
        full.update(gather_state_dicts(shards, cfg or config()))
    return full


def check_resume(baseline: dict, results, bound: float = 1e-5) -> None:
    """A resumed run's losses (iterations SAVE_AT..ITERS - 1) and final weights against the baseline's
    ({"losses", "weights"}), each within `bound` relative (the QKV bias's key entries left out: without_key_bias)."""
    from .tiny_gpt import without_key_bias

    want = baseline["losses"]
    for _, losses, _ in results:
        assert sorted(losses) == list(range(SAVE_AT, ITERS))
        for it, loss in losses.items():
            assert abs(loss - want[it]) <= bound * abs(want[it]), (it, loss, want[it])
    got = full_weights(results)
    assert set(got) == set(baseline["weights"])
    for name, w in baseline["weights"].items():
        a, b = without_key_bias(name, got[name], config()), without_key_bias(name, w, config())
        diff = float((a - b).norm() / b.norm().clamp_min(1e-12))
        assert diff <= bound, (name, diff)

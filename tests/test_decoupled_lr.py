"""--decoupled-lr / --decoupled-min-lr: the word embedding and the output layer step at their own learning rate,
on the same warm-up and decay shape (Megatron's is_decoupled_lr param group and OptimizerParamScheduler).

Claims:
- the values per step are Megatron's formula (linear warm-up from 0 to the group's peak, cosine to its floor),
  the floor defaulting to --min-lr; the flags' bad values and combinations are refused in one sentence;
- the group holds the word embedding (both copies of a tied one: first and last pipeline stage) and the untied
  output layer, never the position embedding, and keeps weight decay; the other two groups are as before;
- DP2 ZeRO-1, ZeRO-3, TP2 ZeRO-2 with the optimizer offloaded to the CPU, and PP2 (tied GPT-2 and untied Llama)
  train as the single-process reference does with torch.optim.AdamW over the same three groups and their lrs
  (fp32: loss, gradient norm, final weights within the Adam-aware bounds of tests/test_model_llama_parity.py);
  the embedding's lr is 3x the others', so a run that stepped it at --lr misses the bound by far.
The command line (log, resume, universal resume) is tests/test_decoupled_lr_cli.py.
"""
import math
import os
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_zero.arguments import ArgumentError, parse_command_line, validate_args
from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.optimizer.lr_schedule import LRSchedule, decoupled_lr
from megatron_zero.model import reference_model
from megatron_zero.model.params import param_spec
from megatron_zero.model.sharding import gather_state_dicts, gather_tensor
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage
from megatron_zero.pipeline.p2p import P2P
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config
from megatron_zero.testing.tolerances import (AdamWeightBound, assert_losses_close, assert_within, global_norm_rtol,
                                              gpt_path_length, model_rtol)
from megatron_zero.testing.train_step import train_steps
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.training.trainer import param_groups
from megatron_zero.zero import ZeroOptimizer

LR, MIN_LR, DECOUPLED, DECOUPLED_MIN = 3e-3, 3e-4, 9e-3, 1e-3
WARMUP, DECAY = 1, 4


def megatron_lr(n, peak, floor):
    """Megatron's OptimizerParamScheduler.get_lr for a group (init_lr 0, cosine), written out."""
    if n <= WARMUP:
        return peak * n / WARMUP
    if n > DECAY:
        return floor
    ratio = (n - WARMUP) / (DECAY - WARMUP)
    return floor + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - floor)


def test_values_per_step_are_megatrons_formula():
    schedule = LRSchedule(LR, MIN_LR, WARMUP, DECAY, "cosine")
    args = SimpleNamespace(decoupled_lr=DECOUPLED, decoupled_min_lr=DECOUPLED_MIN, min_lr=MIN_LR)
    default_floor = SimpleNamespace(decoupled_lr=DECOUPLED, decoupled_min_lr=None, min_lr=MIN_LR)
    for n in range(DECAY + 3):
        schedule.num_steps = n
        assert schedule.lr() == pytest.approx(megatron_lr(n, LR, MIN_LR), rel=1e-15)
        assert decoupled_lr(schedule, args) == pytest.approx(megatron_lr(n, DECOUPLED, DECOUPLED_MIN), rel=1e-15)
        assert decoupled_lr(schedule, default_floor) == pytest.approx(megatron_lr(n, DECOUPLED, MIN_LR), rel=1e-15)
    assert decoupled_lr(schedule, SimpleNamespace(decoupled_lr=None)) is None


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "4", "--lr", "1e-3", "--min-lr", "1e-4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


@pytest.mark.parametrize("flags,words", [
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr 1e-05 is the floor of --decoupled-lr, which is not given"),
    (["--decoupled-lr", "0"], "--decoupled-lr 0.0 must be positive"),
    (["--decoupled-lr", "1e-5"], "--decoupled-min-lr 0.0001 must lie between 0 and --decoupled-lr 1e-05 (it "
                                 "defaults to --min-lr)"),
    (["--decoupled-lr", "1e-3", "--save-megatron-deepspeed-layout", "--save", "/tmp/x"],
     "Megatron-DeepSpeed's optimizer has no decoupled param group"),
])
def test_bad_flags_are_refused(flags, words):
    with pytest.raises(ArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate_args(parse_command_line(BASE + flags), 1)
    args = validate_args(parse_command_line(BASE + ["--decoupled-lr", "5e-4"]), 1)
    assert args.decoupled_lr == 5e-4 and args.decoupled_min_lr is None


def group_names(model, decoupled=True):
    return [sorted(n for n, _ in g["params"]) for g in param_groups(model, 0.1, decoupled)]


def test_the_group_holds_the_embedding_and_output_layer():
    llama = reference_model(tiny_llama_config(num_layers=2))
    decay, no_decay, own = param_groups(llama, 0.1, True)
    assert sorted(n for n, _ in own["params"]) == ["1.word_embeddings.weight", "5.lm_head.weight"]
    assert own["is_decoupled_lr"] and own["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    gpt2 = reference_model(tiny_gpt_config(num_layers=2))  # tied, learned positions: those stay at --lr
    assert group_names(gpt2)[2] == ["tied_modules.embed.word_embeddings.weight"]
    assert "tied_modules.embed.position_embeddings.weight" in group_names(gpt2)[0]
    without = group_names(llama, False)
    assert len(without) == 2 and without[0] == sorted(group_names(llama)[0] + group_names(llama)[2])


# ---- layouts against the reference ------------------------------------------------------------------------
STEPS, GLOBAL_BATCH, WORLD = 3, 8, 2
HP = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CLIP = 0.5
CONFIGS = {"gpt2": lambda: tiny_gpt_config(num_layers=2), "llama": lambda: tiny_llama_config(num_layers=2)}
# (model, tp, pp, zero stage, offload); DP = 2 / (tp * pp)
LAYOUTS = [("llama", 1, 1, 1, "none"), ("llama", 1, 1, 3, "none"), ("llama", 2, 1, 2, "cpu"),
           ("llama", 1, 2, 1, "none"), ("gpt2", 1, 2, 1, "none")]


def lrs(step):
    schedule = LRSchedule(LR, MIN_LR, WARMUP, DECAY, "cosine", num_steps=step + 1)  # warm-up's step 0 is lr 0
    return schedule.lr(), decoupled_lr(schedule, SimpleNamespace(decoupled_lr=DECOUPLED,
                                                                   decoupled_min_lr=DECOUPLED_MIN, min_lr=MIN_LR))


def batch(step):
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 100, (GLOBAL_BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def rtol(kind):
    return model_rtol(gpt_path_length(CONFIGS[kind](), GLOBAL_BATCH * 8))


def reference_run(kind):
    cfg = CONFIGS[kind]()
    model = reference_model(cfg)
    groups = param_groups(model, HP["weight_decay"], True)
    opt = torch.optim.AdamW([{"params": [p for _, p in g["params"]], "weight_decay": g["weight_decay"],
                              "decoupled": g.get("is_decoupled_lr", False)} for g in groups], lr=LR, **{
                                  k: v for k, v in HP.items() if k != "weight_decay"})
    bounds = {own: AdamWeightBound(rtol(kind), LR, HP["betas"], HP["eps"]) for own in (False, True)}
    losses, norms = [], []
    for step in range(STEPS):
        lr, own = lrs(step)
        for g in opt.param_groups:
            g["lr"] = own if g["decoupled"] else lr
        tokens, labels = batch(step)
        opt.zero_grad()
        loss = model(tokens, labels=labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        grads, weights = {n: p.grad for n, p in model.named_parameters()}, dict(model.named_parameters())
        for decoupled, bound in bounds.items():  # each parameter's bound at its own group's lr
            names = [n for g in groups if g.get("is_decoupled_lr", False) == decoupled for n, _ in g["params"]]
            bound.step({n: grads[n] for n in names}, {n: weights[n] for n in names}, lr=own if decoupled else lr)
        losses.append(loss.item())
    full = gather_state_dicts([{n: p.detach() for n, p in model.named_parameters()}], cfg)
    return losses, norms, full, gather_state_dicts([{**bounds[False].bounds(), **bounds[True].bounds()}], cfg)


def train_layout(kind, tp, pp, stage, offload):
    state = build_parallel_state(tp=tp, pp=pp)
    cfg = CONFIGS[kind]()
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(param_groups(model, HP["weight_decay"], True), dp_group=state.dp_group, stage=stage,
                        clip_grad=CLIP, mp_group=state.mp_group, tp_rank=state.tp_rank, module=model, lr=LR,
                        offload=offload, **HP)
    p2p = P2P(state.prev_rank, state.next_rank, activation_shape(1, cfg), torch.float32)
    losses, norms = train_steps(model, opt, state, p2p, batch, STEPS, GLOBAL_BATCH,
                                lambda step: dict(zip(("lr", "decoupled_lr"), lrs(step))))
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()} if stage < 3 else {}
    return state.layout.coords(state.rank), losses, norms, weights


def every_layout():
    out = [train_layout(*layout) for layout in LAYOUTS]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(every_layout, WORLD, timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize("index", range(len(LAYOUTS)),
                         ids=[f"{k}-tp{t}-pp{p}-zero{s}{'-offload' if o != 'none' else ''}"
                              for k, t, p, s, o in LAYOUTS])
def test_layout_matches_reference(runs, index):
    kind, tp, pp, stage, _ = LAYOUTS[index]
    ref_losses, ref_norms, ref_weights, ref_bounds = reference_run(kind)
    assert max(ref_norms) > CLIP  # clipping was active
    cfg = CONFIGS[kind]()
    norm_rtol = global_norm_rtol(rtol(kind), sum(p.numel() for p in reference_model(cfg).parameters()))
    results = [rank_results[index] for rank_results in runs]
    for _, losses, norms, _ in results:
        assert_losses_close(losses, ref_losses, rtol(kind), "loss")
        assert_losses_close(norms, ref_norms, norm_rtol, "gradient norm")
    if stage == 3:
        return
    for p in range(pp):
        shards = [r[3] for r in sorted(results, key=lambda r: r[0]) if r[0][0] == p and r[0][1] == 0]
        assert len(shards) == tp
        for name in shards[0]:
            full = gather_tensor([s[name] for s in shards], param_spec(name, cfg), cfg)
            assert_within(full, ref_weights[name], ref_bounds[name], name)


@pytest.mark.parametrize("decoupled", [None, 1e-3])
def test_megatron_legacy_optimizer_state_of_a_decoupled_run_is_refused(tmp_path, decoupled):
    """A Megatron-LM legacy file (TP1 PP1, written here in its layout) of a --decoupled-lr run: its optimizer
    state follows three param groups, which the reader does not map, so it is refused in one sentence; the
    weights still load. Without --decoupled-lr the same file's state is read."""
    from megatron_zero.checkpoint.interop.mcore_names import LAYERS, mcore_key
    from megatron_zero.checkpoint.interop.megatron_legacy import LegacyFiles, _param_order
    from megatron_zero.model.params import param_names

    cfg = tiny_llama_config(num_layers=2)
    weights = dict(reference_model(cfg).named_parameters())
    model = {}
    for name in param_names(cfg):
        key, layer = mcore_key(name, cfg)
        model[key if layer is None else f"{LAYERS}{layer}.{key[len(LAYERS):]}"] = weights[name].detach().clone()
    order = _param_order(model)
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.full_like(model[k], 0.5),
                 "exp_avg_sq": torch.ones_like(model[k])} for i, k in enumerate(order)}
    args = Namespace(num_layers=2, decoupled_lr=decoupled)
    os.makedirs(tmp_path / "mp_rank_00")
    torch.save({"args": args, "iteration": 1, "model": model,
                "optimizer": {"state": state, "param_groups": [{"params": list(range(len(order)))}]}},
               tmp_path / "mp_rank_00" / "model_optim_rng.pt")
    files = LegacyFiles(str(tmp_path), cfg)
    name = "1.word_embeddings.weight"
    assert torch.equal(files.full(name, "fp32")[0], weights[name].detach()[:cfg.vocab_size])
    if decoupled is None:
        assert files.full(name, "exp_avg")[0].eq(0.5).all()
        return
    with pytest.raises(CheckpointError, match="trained with --decoupled-lr, whose param group orders"):
        files.full(name, "exp_avg")

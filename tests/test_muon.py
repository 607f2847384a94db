"""Muon's pieces against their references: one matrix's step against Megatron-Core 0.16.1's TensorParallelMuon
(every scale mode, Nesterov or not, the QKV split, bf16 and fp32 Newton-Schulz) and torch.optim.Muon where the two
definitions coincide; TP duplicated and distributed against emerging-optimizers' newton_schulz_tp on 2 ranks; the
ownership balanced by FLOPs; the flags as Megatron-LM spells them (the Llama-3-8B launch with dist_muon)."""
import pytest
import torch

from megatron_zero.arguments import ArgumentError, parse_command_line, validate_args
from megatron_zero.optimizer.muon import MuonSettings, orthogonalized_update, takes_muon
from megatron_zero.optimizer.muon_ownership import assign_owners, loads
from megatron_zero.optimizer.newton_schulz import QUINTIC
from megatron_zero.testing import run_ranks
from megatron_zero.testing.launch_scripts import replace_flag, script_argv, scripts
from megatron_zero.testing.muon_reference import tensor_parallel_muon

QKV, PROJ = "2.self_attention.query_key_value.weight", "2.mlp.dense_4h_to_h.weight"
SPLIT = (32, 8, 8)  # 4 q heads of 8 per query group, its k and v


def _ours(weights, grads_by_step, s: MuonSettings, lr, wd, names):
    weights = [w.clone() for w in weights]
    momenta = [torch.zeros_like(w) for w in weights]
    for grads in grads_by_step:
        for i, (w, g) in enumerate(zip(weights, grads)):
            w.mul_(1 - lr * wd)
            momenta[i].lerp_(g, 1 - s.momentum)
            d = g.lerp(momenta[i], s.momentum) if s.nesterov else momenta[i]
            w.add_(orthogonalized_update(names[i], d, s), alpha=-lr)
    return weights


@pytest.mark.parametrize("prec", ["highest", "medium"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("mode", ["spectral", "unit_rms_norm", "shape_scaling"])
def test_step_matches_megatron_core_tensor_parallel_muon(prec, nesterov, mode):
    torch.manual_seed(0)
    weights = [torch.randn(2 * sum(SPLIT), 32), torch.randn(32, 80)]
    steps = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    params[0].is_qkv = True
    ref = tensor_parallel_muon()(params, lr=0.1, momentum_beta=0.9, use_nesterov=nesterov, weight_decay=0.01,
                                 split_qkv=True, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                                 qkv_split_shapes=SPLIT, fp32_matmul_prec=prec, num_ns_steps=5, scale_mode=mode,
                                 extra_scale_factor=0.7, mode="blockwise")
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        ref.step()
    s = MuonSettings(0.9, nesterov, True, mode, prec, 5, "blockwise", 0.7, SPLIT)
    for got, want in zip(_ours(weights, steps, s, 0.1, 0.01, [QKV, PROJ]), params):
        # fp32 roundoff of weights ~1 (the weight decay is applied as p - lr wd p there, p (1 - lr wd) here)
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=2e-6)


def test_step_matches_torch_muon_where_the_definitions_coincide():
    """torch.optim.Muon: Nesterov, shape scaling (its adjust_lr_fn 'original'), one (a, b, c) for every step, the
    iteration in bf16. With one step of the quintic set and --muon-fp32-matmul-prec medium they coincide, but for
    where the bf16 rounding falls (torch normalizes in bf16, here in fp32 before the cast): bf16's rtol."""
    torch.manual_seed(1)
    w = torch.randn(48, 32)
    steps = [[torch.randn_like(w)] for _ in range(3)]
    p = torch.nn.Parameter(w.clone())
    ref = torch.optim.Muon([p], lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, ns_coefficients=QUINTIC[0],
                           ns_steps=1, adjust_lr_fn="original")
    for (g,) in steps:
        p.grad = g.clone()
        ref.step()
    s = MuonSettings(0.9, True, False, "shape_scaling", "medium", 1, "blockwise", 1.0)
    (got,) = _ours([w], steps, s, 0.05, 0.1, [PROJ])
    update_got, update_want = got - w * (1 - 0.05 * 0.1) ** 3, p.detach() - w * (1 - 0.05 * 0.1) ** 3
    assert float((update_got - update_want).norm() / update_want.norm()) < 2 ** -7


def _tp_modes():
    import torch.distributed as dist

    from megatron_zero.optimizer.newton_schulz import matmul_precision
    from megatron_zero.testing.muon_reference import emerging_muon_utils
    newton_schulz_tp = emerging_muon_utils().newton_schulz_tp

    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    out = []
    for mode, name, full, dim in [(mode, *matrix) for mode in ("duplicated", "distributed") for matrix in
                                  ((PROJ, torch.randn(32, 96), 1), ("2.mlp.dense_h_to_4h.weight", torch.randn(96, 32), 0))]:
        shard = full.chunk(tp, dim=dim)[rank].contiguous()
        s = MuonSettings(0.9, False, False, "spectral", "highest", 5, mode, 1.0)
        got = orthogonalized_update(name, shard, s, dist.group.WORLD)
        with matmul_precision("highest"):
            want = newton_schulz_tp(shard, 5, "quintic", dist.group.WORLD, partition_dim=dim, tp_mode=mode)
        out.append(float((got / max(full.shape) ** 0.5 - want).abs().max()))
    return out


@pytest.mark.multirank
def test_tensor_parallel_modes_match_newton_schulz_tp():
    """duplicated (the whole matrix gathered) and distributed (the Gram matrices summed over TP), row- and
    column-parallel, against emerging-optimizers' newton_schulz_tp (its result is unscaled)."""
    for diffs in run_ranks(_tp_modes, 2):
        assert max(diffs) < 1e-6


def _cp_max_logit():
    import torch.distributed as dist

    from megatron_zero.model.transformer import local_positions
    from megatron_zero.optimizer.qk_clip import MaxLogit
    torch.manual_seed(4)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)  # 4 heads, 2 query groups, 16 tokens
    mine = local_positions(8, dist.group.WORLD, q.device)  # this CP rank's load-balanced chunks
    recorder = MaxLogit(4, 8 ** -0.5, q.device)
    recorder.record(q[:, :, mine], k[:, :, mine], dist.group.WORLD)
    return recorder.value


def test_max_logit_with_context_parallelism_is_the_whole_sequences():
    """Each CP rank's queries against every rank's keys, causally by their positions: the MAX over CP ranks is
    the whole sequence's per-head max of q k^T / sqrt(d)."""
    from megatron_zero.optimizer.qk_clip import MaxLogit
    torch.manual_seed(4)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 8 ** -0.5
    want = scores.masked_fill(torch.ones(16, 16).triu(1).bool(), float("-inf")).amax(dim=(0, 2, 3))
    whole = MaxLogit(4, 8 ** -0.5, q.device)
    whole.record(q, k)
    torch.testing.assert_close(whole.value, want)
    per_rank = run_ranks(_cp_max_logit, 2)
    torch.testing.assert_close(torch.maximum(*per_rank), want)
    assert not torch.equal(per_rank[0], per_rank[1])  # each rank saw other queries


def test_ownership_balances_newton_schulz_flops_not_parameter_count():
    costs = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]  # one large matrix, ten small ones
    owner = assign_owners(costs, 2)
    assert loads(costs, owner, 2) == [100, 100]  # a count would give 6 and 5 matrices: loads 150 and 50
    assert assign_owners(costs, 2) == owner  # the same on every rank
    assert max(loads([7, 6, 5, 4, 3, 2, 1], assign_owners([7, 6, 5, 4, 3, 2, 1], 3), 3)) <= 28 / 3 * 4 / 3


def test_which_parameters_take_muon():
    muon = ["2.self_attention.query_key_value.weight", "2.self_attention.dense.weight", "3.mlp.dense_h_to_4h.weight",
            "3.mlp.dense_4h_to_h.weight", "2.mlp.deepspeed_moe.experts.deepspeed_experts.5.dense_h_to_4h.weight",
            "2.mlp.shared_expert.dense_4h_to_h.weight"]
    adam = ["1.word_embeddings.weight", "tied_modules.embed.word_embeddings.weight",
            "tied_modules.embed.position_embeddings.weight", "7.lm_head.weight", "2.mlp.deepspeed_moe.gate.wg.weight",
            "2.mlp.shared_expert_gate.weight"]
    assert all(takes_muon(n, (4, 4)) for n in muon)
    assert not any(takes_muon(n, (4, 4)) for n in adam)
    assert not takes_muon("2.input_layernorm.weight", (4,)) and not takes_muon("2.mlp.dense_h_to_4h.bias", (4,))


MUON_FLAGS = ["--optimizer", "dist_muon", "--muon-momentum", "0.9", "--muon-use-nesterov", "--muon-no-split-qkv",
              "--muon-scale-mode", "unit_rms_norm", "--muon-fp32-matmul-prec", "high", "--muon-num-ns-steps", "6",
              "--muon-tp-mode", "duplicated", "--muon-extra-scale-factor", "0.2", "--qk-clip", "--qk-clip-alpha",
              "0.4", "--qk-clip-threshold", "50", "--log-max-attention-logit"]


def test_llama3_8b_launch_with_dist_muon_parses_whole(tmp_path):
    name = "megatron_lm_llama3_8b_fp8"
    paths = {n: str(tmp_path / n.lower()) for n in ("CKPT", "LOAD_CKPT", "TENSORBOARD", "DATA_PATH", "VOCAB_FILE",
                                                     "MERGE_FILE", "TOKENIZER_MODEL", "DATA_CACHE")}
    argv = script_argv(name, paths) + MUON_FLAGS
    args = validate_args(parse_command_line(argv), scripts()[name]["world_size"])
    assert (args.optimizer, args.muon_momentum, args.muon_use_nesterov, args.muon_split_qkv) == (
        "dist_muon", 0.9, True, False)
    assert (args.muon_scale_mode, args.muon_fp32_matmul_prec, args.muon_num_ns_steps, args.muon_tp_mode,
            args.muon_extra_scale_factor) == ("unit_rms_norm", "high", 6, "duplicated", 0.2)
    assert (args.qk_clip, args.qk_clip_alpha, args.qk_clip_threshold, args.log_max_attention_logit) == (
        True, 0.4, 50.0, True)
    defaults = validate_args(parse_command_line(script_argv(name, paths) + ["--optimizer", "muon"]),
                             scripts()[name]["world_size"])
    assert (defaults.muon_momentum, defaults.muon_use_nesterov, defaults.muon_split_qkv, defaults.muon_scale_mode,
            defaults.muon_fp32_matmul_prec, defaults.muon_num_ns_steps, defaults.muon_tp_mode,
            defaults.muon_extra_scale_factor) == (0.95, False, True, "spectral", "medium", 5, "blockwise", 1.0)
    with pytest.raises(ArgumentError, match="--muon-momentum, --muon-no-split-qkv, .* set Muon, which --optimizer adamw does not use"):
        validate_args(parse_command_line(replace_flag(argv, "--optimizer", "adamw")), scripts()[name]["world_size"])


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1"]


@pytest.mark.parametrize("extra, sentence", [
    (["--optimizer", "dist_muon", "--zero-stage", "0"], "--optimizer dist_muon shards Muon's state"),
    (["--optimizer", "muon", "--cpu-optimizer"], "it does not run with --cpu-optimizer"),
    (["--optimizer", "muon", "--muon-momentum", "1.0"], r"--muon-momentum 1.0 must lie in \[0, 1\)"),
    (["--optimizer", "sgd"], "--optimizer sgd is refused"),
    (["--optimizer", "muon", "--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups",
      "2"], "leaves no whole group on a rank; add --muon-no-split-qkv"),
])
def test_refusals_are_one_sentence(extra, sentence):
    with pytest.raises(ArgumentError, match=sentence) as err:
        validate_args(parse_command_line(BASE + extra), 4 if "4" in extra else 1)
    assert len(str(err.value).splitlines()) == 1

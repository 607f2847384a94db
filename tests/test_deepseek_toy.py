"""The DeepSeek-V3-shaped toy (megatron_zero/testing/deepseek_toy.py: MLA with its latent norms and YaRN, the
sigmoid router with expert bias, groups, scaling and the sequence-level aux loss, a shared expert, the first
layer dense, one MTP depth) at every layout, and its reshapes.

The MTP depth's block is built as the last block, here an MoE layer (Megatron-Core's MTP layer spec is the
decoder's last layer spec): its experts are named by the catalogue, spread over the expert-parallel ranks, saved
in DeepSpeed-MoE's expert files (the MoE layer after the blocks') and reshaped; its router's tokens per expert
join the bias update. Default tier: that in one process, and the toy's model at EP2 x DP2 for two steps against
the one-process model (losses and gradient norms, tolerances.model_rtol of the toy's path). Slow tier, through
pretrain_gpt.py: the logged LM and MTP losses match the one-process run within a step's roundoff and the saved
expert biases are bit for bit the one-process run's (integer token counts summed, the same sign steps) at DP2
ZeRO-3 with EP2 and without EP, and at EP2 x TP2 x PP2 on 8 ranks; a checkpoint resumes reshaped with the losses
continuing (the same tolerance, as the other MoE reshape tests, tests/test_moe_expert_bias_cli.py) and the biases
ending bit for bit as the uninterrupted run's: the ZeRO-3 EP2 save at EP1; the EP2 x TP2 x PP2 save from
tools/ds_to_universal.py (at EP1 x TP1 x PP1) and directly at EP1, EP4, TP1, PP1 and ZeRO-3 (at PP1: ZeRO-3 does
not pipeline).
"""
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_zero.model import reference_model
from megatron_zero.model.params import param_names, param_spec, with_expert
from megatron_zero.testing.cli import CliResume, logged_losses, mtp_losses, pretrain_cli, text_data
from megatron_zero.testing import run_ranks
from megatron_zero.testing.deepseek_toy import (MEGATRON_DEEPSEEK_R1, SEQ_AUX, deepseek_toy_config, deepseek_toy_flags,
                                                deepseek_toy_rtol, seq_aux_route)
from megatron_zero.testing.expert_bias_runs import saved_expert_biases
from megatron_zero.testing.moe_train import GBS, parallel_run, reference_run
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from megatron_zero.testing.tolerances import (assert_close_normwise, assert_losses_close, global_norm_rtol, model_rtol,
                                              mtp_path_length)

ITERS, SAVE_AT = 4, 2


def _mtp_moe_config():
    """Two blocks, the second MoE (4 experts, a shared one, expert bias), one MTP depth."""
    return tiny_llama_config(num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                             moe_layer_freq=2, moe_layer_offset=1, moe_shared_expert_intermediate_size=16,
                             moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                             moe_aux_loss_coeff=0.0, mtp_num_layers=1)


def test_mtp_depth_is_an_moe_layer_where_the_last_block_is():
    """The catalogue names the depth's router, experts and shared expert, the module has them, DeepSpeed-MoE's
    files and the reshape readers find its experts, and its router's load joins the expert-bias update."""
    from megatron_zero.checkpoint.expert_layout import expert_files, is_expert_param
    from megatron_zero.checkpoint.export.standalone_zero_to_fp32 import _EXPERT
    from megatron_zero.checkpoint.format import expert_file_name
    from megatron_zero.checkpoint.reshape.expert_source import LocalExpertNames, all_expert_shapes
    from megatron_zero.checkpoint.reshape.universal_info import gpt_rule
    from megatron_zero.moe.expert_bias import ExpertBiasUpdate

    cfg = _mtp_moe_config()
    model = reference_model(cfg).train()
    names = [n for n, _ in model.named_parameters()]
    assert names == param_names(cfg)
    depth = f"{cfg.num_layers + 4}.0.transformer_layer."
    expert = f"{depth}mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_h_to_4h.weight"
    assert {f"{depth}mlp.deepspeed_moe.gate.wg.weight", expert, f"{depth}mlp.shared_expert.dense_4h_to_h.weight"} \
        <= set(names) and f"{depth}mlp.dense_h_to_4h.weight" not in names
    spec = param_spec(expert, cfg)
    assert (spec.full_shape, spec.partition_dim, spec.sub_params) == ((32, cfg.hidden_size), 0, 2)
    assert gpt_rule(expert, None).cat_dim == 0 and gpt_rule(f"{depth}mlp.deepspeed_moe.gate.wg.weight",
                                                            None).cat_dim is None
    for prefix in ("3.", depth):  # the shared expert merges as the dense MLP (row-parallel output), its gate replicated
        assert gpt_rule(f"{prefix}mlp.shared_expert.dense_4h_to_h.weight", None).cat_dim == 1
        assert gpt_rule(f"{prefix}mlp.shared_expert.dense_h_to_4h.weight", None).cat_dim == 0
    assert is_expert_param(expert) and with_expert(expert, 1) == expert.replace("experts.3.", "experts.1.")
    assert _EXPERT.match(expert).group(2) == "3"
    # DeepSpeed-MoE's files: the depth's experts are the MoE layer after the blocks' one
    files = expert_files(model.state_dict(), cfg, 0)
    assert set(files) == {expert_file_name(m, e, 0) for m in (0, 1) for e in range(4)}
    assert expert in files[expert_file_name(1, 3, 0)]
    # the reshape readers: an EP rank's listed experts expanded to every id, and named locally per EP rank
    shapes = all_expert_shapes([{expert: torch.Size([32, 64])}], [0, 1, 2, 3], "test")
    assert list(shapes[0]) == [expert] + [with_expert(expert, e) for e in (0, 1, 2)]
    assert LocalExpertNames(4, 2, "test").on_rank(expert, 1) == with_expert(expert, 1)
    assert cfg.num_moe_layers() == 2  # the MoE log averages over the block's and the depth's
    # Megatron-Core's torch_dist names are not mapped for the depth's MoE layer: refused in one sentence
    from megatron_zero.checkpoint import CheckpointError
    from megatron_zero.checkpoint.interop.mcore_names import refuse_moe_mtp
    with pytest.raises(CheckpointError, match="MoE multi-token prediction layers"):
        refuse_moe_mtp(cfg, "the checkpoint")
    # the depth's router records its tokens per expert, and the bias update counts them
    update = ExpertBiasUpdate(model, rate=0.01)
    router = model.get_submodule(f"{depth}mlp.deepspeed_moe.gate")
    assert any(r is router for r in update.routers) and len(update.routers) == 2
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    assert float(router.tokens_per_expert.sum()) == tokens[:, 1:].numel() * cfg.moe_router_topk
    assert float(dict(model.named_parameters())[expert].grad.abs().sum()) > 0
    update.step()
    assert float(router.expert_bias.abs().sum()) > 0


def _ep2_steps_and_sequence_parallel_routing(cfg):
    return parallel_run(cfg, 1, 1, 2, 1, 2, 2), seq_aux_route(True)


@pytest.mark.multirank
def test_ep2_steps_match_one_process():
    """The toy's model at EP2 x DP2 ZeRO-1 (each rank half the experts of both MoE layers, the depth's too, and half
    the micro-batches): two steps' losses and gradient norms against the one-process model's. On the same two
    ranks as a TP group with sequence parallelism, the toy's sequence-level aux loss: a rank's rows are its share
    of the batch-major tokens, here crossing a sequence; the ranks' losses sum to the one-process loss and their
    gradients are its rows' (roundoff of sums of a few terms)."""
    cfg = deepseek_toy_config(100, **{"seq-length": 8})
    ref_losses, ref_norms = reference_run(cfg, 2, 2, steps=2)
    results = run_ranks(_ep2_steps_and_sequence_parallel_routing, 2, cfg, timeout=600)
    rtol = model_rtol(mtp_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for (losses, norms), _ in results:
        assert_losses_close(losses, ref_losses, rtol, "EP2 x DP2 loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), "EP2 x DP2 grad norm")
    want_loss, want_grad = seq_aux_route(False)
    terms = SEQ_AUX["batch"] * SEQ_AUX["seq"] * SEQ_AUX["experts"]  # the most terms any value sums
    assert_close_normwise(sum(loss for _, (loss, _) in results), want_loss, model_rtol(terms), "seq aux loss")
    assert_close_normwise(torch.cat([grad for _, (_, grad) in results]), want_grad, model_rtol(terms), "its gradient")


# ---- pretrain_gpt.py ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The corpus, and the one-process run (saved at the end, for its expert biases)."""
    root = tmp_path_factory.mktemp("deepseek_toy")
    data = text_data(root / "text")
    run = pretrain_cli(1, deepseek_toy_flags(data, str(root / "cache"), {"train-iters": ITERS, "save": root / "ref",
                                                                          "save-interval": ITERS}), timeout=600)
    return SimpleNamespace(data=data, cache=str(root / "cache"), run=run,
                           biases=saved_expert_biases(os.path.join(root, "ref", f"global_step{ITERS}")))


def _in_order(losses):
    return [losses[i] for i in sorted(losses)]


def _assert_matches_reference(reference, stdout: str, biases: dict, what: str):
    rtol = deepseek_toy_rtol()
    log = SimpleNamespace(stdout=stdout)
    for read in (logged_losses, mtp_losses):
        got, want = read(log), read(reference.run)
        assert sorted(got) == sorted(want) == list(range(1, ITERS + 1)), (what, got, want)
        assert_losses_close(_in_order(got), _in_order(want), rtol, f"{what}: {read.__name__}")
    # two biases (the block's, the depth's), moved, and bit for bit the one-process run's
    assert len(reference.biases) == 2 and all(float(b.abs().max()) > 0 for b in reference.biases.values())
    assert biases.keys() == reference.biases.keys(), (what, biases.keys())
    assert all(torch.equal(biases[n], reference.biases[n]) for n in biases), (what, biases, reference.biases)


def _saved_run(reference, root, layout: dict, nproc: int) -> CliResume:
    return CliResume(str(root), lambda *changes: deepseek_toy_flags(reference.data, reference.cache, *changes),
                     layout, nproc=nproc, iters=ITERS, save_at=SAVE_AT)


def _final_biases(run: CliResume) -> dict:
    return saved_expert_biases(os.path.join(run.save, f"global_step{run.iters}"))


def _assert_resumes(run: CliResume, how: str, layout: dict, nproc: int, out):
    """Resumed `how` at `layout` on `nproc` ranks: the losses continue within a step's roundoff and the biases end
    bit for bit as the uninterrupted run's (restored, reshaped, and updated as before)."""
    load = {"load": run.universal, "universal-checkpoint": True} if how == "universal" else {"load": run.checkpoint}
    resumed = pretrain_cli(nproc, run.flags({"train-iters": run.iters}, run.layout, load, layout,
                                            {"save": out, "save-interval": run.iters}), timeout=900)
    run.assert_matches(logged_losses(resumed), deepseek_toy_rtol())
    ended, final = saved_expert_biases(os.path.join(out, f"global_step{run.iters}")), _final_biases(run)
    assert ended.keys() == final.keys() and all(torch.equal(ended[n], final[n]) for n in final), (ended, final)


@pytest.mark.slow  # default tier: test_ep2_steps_match_one_process, test_mtp_depth_is_an_moe_layer_where_the_last_block_is
@pytest.mark.multirank
def test_zero3_ep2_matches_one_process_and_resumes_at_ep1(reference, tmp_path):
    """DP2 ZeRO-3 with the experts (the depth's too) over EP2, against one process; its save resumed at EP1."""
    run = _saved_run(reference, tmp_path / "saved", {"zero-stage": 3, "expert-model-parallel-size": 2}, 2)
    _assert_matches_reference(reference, run.stdout, _final_biases(run), "ZeRO-3 x EP2")
    _assert_resumes(run, "reshaped", {"expert-model-parallel-size": 1}, 2, tmp_path / "ep1")


@pytest.mark.slow  # default tier: test_zero3_ep2_matches_one_process_and_resumes_at_ep1 (DP2 ZeRO-3 with EP2)
@pytest.mark.multirank
def test_dp2_zero3_matches_one_process(reference, tmp_path):
    run = pretrain_cli(2, deepseek_toy_flags(reference.data, reference.cache,
                                             {"train-iters": ITERS, "zero-stage": 3, "save": tmp_path / "run",
                                              "save-interval": ITERS}), timeout=900)
    _assert_matches_reference(reference, run.stdout,
                              saved_expert_biases(os.path.join(tmp_path, "run", f"global_step{ITERS}")), "DP2 ZeRO-3")


EP2_TP2_PP2 = {"expert-model-parallel-size": 2, "tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2}


@pytest.fixture(scope="module")
def saved_at_ep2_tp2_pp2(reference, tmp_path_factory):
    return _saved_run(reference, tmp_path_factory.mktemp("ep2_tp2_pp2"), EP2_TP2_PP2, 8)


@pytest.mark.slow  # 8 ranks; default tier: test_zero3_ep2_matches_one_process_and_resumes_at_ep1
@pytest.mark.multirank
def test_ep2_tp2_pp2_matches_one_process(reference, saved_at_ep2_tp2_pp2):
    run = saved_at_ep2_tp2_pp2
    _assert_matches_reference(reference, run.stdout, _final_biases(run), "EP2 x TP2 x PP2")


@pytest.mark.slow  # an 8-rank save; default tier: test_zero3_ep2_matches_one_process_and_resumes_at_ep1
@pytest.mark.multirank
@pytest.mark.parametrize("how,layout,nproc", [
    ("universal", {"expert-model-parallel-size": 1, "tensor-model-parallel-size": 1,
                   "pipeline-model-parallel-size": 1}, 2),
    ("reshaped", {"expert-model-parallel-size": 1}, 8),
    ("reshaped", {"expert-model-parallel-size": 4, "pipeline-model-parallel-size": 1}, 8),
    ("reshaped", {"tensor-model-parallel-size": 1}, 4),
    ("reshaped", {"pipeline-model-parallel-size": 1}, 4),
    ("reshaped", {"zero-stage": 3, "pipeline-model-parallel-size": 1}, 4),  # (ZeRO-3 runs without pipelining)
], ids=["universal-ep1-tp1-pp1", "ep1", "ep4-pp1", "tp1", "pp1", "zero3-pp1"])
def test_ep2_tp2_pp2_save_resumes(saved_at_ep2_tp2_pp2, tmp_path, how, layout, nproc):
    _assert_resumes(saved_at_ep2_tp2_pp2, how, layout, nproc, tmp_path / "resumed")


@pytest.mark.slow  # 4 ranks, bf16; default tier: test_ep2_steps_match_one_process (the same pieces in fp32)
@pytest.mark.multirank
def test_megatron_lm_deepseek_r1_flags_train(tmp_path):
    """Megatron-LM's own DeepSeek-R1 model flags (testing/deepseek_toy.py: its script's, toy sizes) with one MTP
    depth train at TP2 (sequence parallel, the sequence-level aux loss over the TP ranks' tokens) x EP2 x DP2."""
    import math

    from megatron_zero.testing.launch import flags_argv

    data = text_data(tmp_path / "text")
    run = pretrain_cli(4, MEGATRON_DEEPSEEK_R1 + flags_argv({
        "data-path": data, "data-cache-path": tmp_path / "cache", "split": "100,0,0", "save": tmp_path / "ckpt",
        "train-iters": 3, "global-batch-size": 4, "lr": 1e-3, "log-interval": 1, "eval-iters": 0,
        "mtp-num-layers": 1, "tensor-model-parallel-size": 2, "expert-model-parallel-size": 2}), timeout=900)
    lm, mtp = logged_losses(run), mtp_losses(run)
    assert sorted(lm) == sorted(mtp) == [1, 2, 3], run.stdout[-3000:]
    assert all(math.isfinite(v) for v in [*lm.values(), *mtp.values()])
    assert "seq_load_balancing_loss" in run.stdout

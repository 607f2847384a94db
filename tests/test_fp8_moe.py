"""FP8 MoE experts (torchao's float8, emulated on the CPU; docs/fp8.md's "MoE experts").

One rank: every expert's GEMMs are torchao's own. The MoE Llama with its blocks' linear layers, each
expert's among them, as nn.Linear converted by torchao's convert_to_float8_training (one Float8Linear per
expert, on the rows routed to it) gives bit-identical loss and gradients to ours, through the experts'
own layers and through --moe-grouped-gemm's path (per-expert FP8 matmuls), for every recipe. The router
stays in fp32 and the shared expert is FP8 as a dense MLP. An expert with no rows casts (amax 0), joins its
group's reductions and skips its GEMMs.

Multi-rank: each step's loss and gradient norm equal the one-process FP8 reference's within
fp8_same_scale_rtol (megatron_zero/testing/tolerances.py) at DP2 x EP2 (grouped GEMM in the default tier;
the experts' own layers, delayed scaling and the all-gather dispatcher under `slow`), TP2 + SP with expert TP2, DP2 with expert-DP 2
at ZeRO-3 and CP2 x EP2; each fails with the experts' amaxes reduced over the wrong group (the blocks' DP
group, whose ranks hold other experts) or not reduced (over expert TP, over expert-DP). The reference
takes both DP ranks' micro-batches together (an expert's scale is that of every token of the micro-batch
routed to it) with the blocks' other layers cast per sample (testing/fp8_layouts.py). The multi-rank
references run the experts' own layers, the path the one-rank test holds to torchao's. The rowwise
recipes are held at one rank only: with power-of-2 scales a broken token reduction changes no FP8 value
away from the subnormals, so no multi-rank check of it could fail.
"""
import pytest
import torch

from megatron_zero.fp8.convert import Float8Converter
from megatron_zero.fp8.delayed import AmaxHistory
from megatron_zero.fp8.matmul import Float8Matmul
from megatron_zero.fp8.settings import RECIPES, Float8Settings
from megatron_zero.model import reference_model
from megatron_zero.testing import run_ranks
from megatron_zero.testing.cli import CliResume, cli_flags, logged_losses, text_data
from megatron_zero.testing.fp8_layouts import (GLOBAL_BATCH, delayed_settings, fp8_layout_run, moe_config,
                                               reference_run)
from megatron_zero.testing.fp8_torchao import torchao_reference
from megatron_zero.testing.tolerances import assert_losses_close, fp8_same_scale_rtol

pytest.importorskip("torchao.float8")
CPU = torch.device("cpu")


def _step(model, tokens):
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]  # the same parameters, in the same order


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow),
                                    pytest.param("rowwise_with_gw_hp", marks=pytest.mark.slow)])
def test_one_rank_moe_step_is_torchaos(recipe):
    cfg = moe_config(moe_shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    plain = reference_model(cfg)
    settings = Float8Settings("hybrid", recipe, emulate=True)
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(1))
    theirs = reference_model(cfg)
    theirs.load_state_dict(plain.state_dict())
    want_loss, want = _step(torchao_reference(theirs, settings), tokens)
    plain_loss, _ = _step(plain, tokens)
    assert want_loss != plain_loss  # the GEMMs did run in FP8
    for grouped in (False, True):
        ours = reference_model(moe_config(moe_shared_expert_intermediate_size=32, moe_grouped_gemm=grouped))
        ours.load_state_dict(plain.state_dict())
        line = Float8Converter(settings, CPU)(ours)
        # per block (2) QKV, projection, the shared expert's two, the four experts' two each
        assert "24 linear layers of this stage's blocks (16 of them the MoE experts" in line, line
        loss, grads = _step(ours, tokens)
        assert torch.equal(loss, want_loss), grouped
        assert len(grads) == len(want)
        assert all(torch.equal(g, w) for g, w in zip(grads, want)), grouped


@pytest.mark.parametrize("recipe", RECIPES)
def test_expert_without_rows_casts_and_skips_its_gemms(recipe):
    """An expert no token was routed to: its FP8 matmul takes an empty input (torchao's amax of an empty tensor
    raises), casts with amax 0, and gives an empty output and a zero weight gradient."""
    mm = Float8Matmul(Float8Settings("hybrid", recipe, emulate=True).linear_config(), "column",
                      delayed=AmaxHistory(1, "most_recent", 0, CPU) if recipe == "delayed" else None)
    weight = torch.randn(8, 16, requires_grad=True)
    x = torch.zeros(0, 16, requires_grad=True)
    y = mm(x, weight)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 16) and torch.equal(weight.grad, torch.zeros(8, 16))


def _empty_on_rank0(recipe):
    """One expert's FP8 matmul on two expert-DP ranks, rank 0 with no rows: its casts still join rank 1's
    reductions (no hang), and rank 1 gets one process's result on its rows (their amax is the global one)."""
    import torch.distributed as dist

    def mm():
        history = AmaxHistory(1, "most_recent", 0, CPU) if recipe == "delayed" else None
        return Float8Matmul(Float8Settings("hybrid", recipe, emulate=True).linear_config(), "column",
                            delayed=history)

    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    x = torch.randn(5 * dist.get_rank(), 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = []
    for matmul, group in ((mm(), dist.group.WORLD), (mm(), None)):
        if group is None and dist.get_rank() == 0:
            break
        matmul.cp_group = group
        for _ in range(2):  # delayed: the second step casts with the first one's amaxes
            weight.grad = x.grad = None
            y = matmul(x, weight)
            (y * y).sum().backward()
        out.append((y.detach(), x.grad, weight.grad))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_expert_without_rows_joins_the_reductions(recipe):
    (empty,), (two_ranks, alone) = run_ranks(_empty_on_rank0, 2, recipe=recipe)
    assert empty[0].shape == (0, 8) and not empty[2].any()
    assert all(torch.equal(a, b) for a, b in zip(two_ranks, alone))


def _check(run, reference, moe):
    """The layout's losses and gradient norms against the reference (AssertionError past the bound)."""
    rtol = fp8_same_scale_rtol(moe_config(**moe), GLOBAL_BATCH * moe_config().seq_length)
    assert_losses_close(run["losses"], reference[0], rtol, "loss")
    assert_losses_close(run["norms"], reference[1], rtol, "gradient norm")


def _layout_and_broken(broken, **layout):
    return fp8_layout_run(**layout), fp8_layout_run(broken=broken, **layout)


def _assert_layout(world, broken=True, moe=None, **layout):
    moe = {} if moe is None else moe
    runs = run_ranks(_layout_and_broken, world, timeout=600, broken=broken, moe=moe, **layout)
    recipe = layout.get("recipe", "tensorwise")
    settings = delayed_settings() if recipe == "delayed" else Float8Settings("hybrid", recipe, emulate=True)
    # the reference's experts through their own layers (the path the one-rank test holds to torchao's)
    reference = reference_run(settings, world // (layout.get("tp", 1) * layout.get("cp", 1)), layout.get("cp", 1),
                              moe={k: v for k, v in moe.items() if k != "moe_grouped_gemm"})
    for good, bad in runs:
        _check(good, reference, moe)
        with pytest.raises(AssertionError):
            _check(bad, reference, moe)


def test_ep2_grouped_gemm_matches_one_process():
    """DP2 x EP2 with --moe-grouped-gemm: each rank holds two experts and receives every token routed to them
    from both ranks, each expert's FP8 matmul on its rows; the broken run reduces the experts' amaxes over the
    blocks' DP group (whose other rank holds other experts)."""
    _assert_layout(2, broken="block_groups", ep=2, moe=dict(moe_grouped_gemm=True))


@pytest.mark.slow
@pytest.mark.parametrize("moe, recipe", [({}, "tensorwise"), ({}, "delayed"), (dict(moe_grouped_gemm=True), "delayed"),
                                         (dict(moe_token_dispatcher_type="allgather"), "tensorwise")])
def test_ep2_matches_one_process(moe, recipe):
    """The same through the experts' own layers, under delayed scaling (the experts' amax histories), and with
    Megatron-Core's all-gather dispatcher."""
    _assert_layout(2, broken="block_groups", ep=2, recipe=recipe, moe=moe)


@pytest.mark.slow
@pytest.mark.parametrize("grouped", [False, True])
def test_expert_tp2_matches_one_process(grouped):
    """TP2 with sequence parallelism, ETP = TP: each TP rank routes its chunk of the sequence, the experts'
    rows are all-gathered over ETP and each expert's weight split over it (moe/expert_tp.py): the weight's
    and its output gradient's amaxes reduced over ETP (the broken run does not)."""
    _assert_layout(2, tp=2, sequence_parallel=True, moe=dict(moe_grouped_gemm=grouped))


@pytest.mark.slow
def test_dp2_expert_dp2_matches_one_process():
    """DP2 without EP at ZeRO-3: every expert on both ranks (expert-DP 2), each with its own sample's tokens;
    the amaxes reduced over expert-DP make an expert's scale that of both samples' tokens routed to it (the
    broken run keeps each rank's own)."""
    _assert_layout(2, stage=3)


@pytest.mark.slow
def test_cp2_ep2_matches_one_process():
    """CP2 x EP2: each rank routes its chunks of the sequence, the EP exchange brings an expert both ranks'
    tokens (EP spans the CP ranks); the broken run reduces the experts' amaxes over the blocks' DP x CP group."""
    _assert_layout(2, broken="block_groups", cp=2, ep=2)


@pytest.mark.slow
@pytest.mark.multirank
def test_pretrain_gpt_moe_fp8_trains_and_resumes(tmp_path):
    """pretrain_gpt.py with --num-experts 4 --fp8-format hybrid --fp8-emulate (delayed scaling, Megatron-LM's
    default, history 4) at EP2 with --moe-grouped-gemm: every expert's GEMMs in FP8 and the loss falls; resumed
    as saved it is bit-identical, every expert's amax history restored (each EP rank holds other experts)."""
    data = text_data(tmp_path / "text")
    flags = {"num-experts": 4, "moe-router-topk": 2, "expert-model-parallel-size": 2, "moe-grouped-gemm": True,
             "fp8-format": "hybrid", "fp8-emulate": True, "fp8-amax-history-len": 4, "fp8-amax-compute-algo": "max"}
    run = CliResume(str(tmp_path), lambda *c: cli_flags(data, str(tmp_path / "cache"), "llama", flags, *c), {},
                    iters=8, save_at=4)
    assert "(8 of them the MoE experts, each scaled on its own rows)" in run.stdout, run.stdout[-2000:]
    losses = run.losses
    assert max(losses[i] for i in (6, 7, 8)) < min(losses[1], losses[2]), losses  # it learns
    resumed = run.resume_run("as saved")
    assert "start fresh" not in resumed.stdout, resumed.stdout[-2000:]
    run.assert_matches(logged_losses(resumed), 0.0)

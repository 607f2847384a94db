"""--expert-tensor-parallel-size and --sequence-parallel with MoE layers.

The expert groups (expert-TP, EP, expert-DP) against Megatron-Core's own expert RankGenerator (order
tp-ep-dp-pp) at layouts with ETP = TP, ETP < TP and ETP > TP; the layout rules refused in one sentence; then
parity with the single-process reference (fp32, dropless, aux and z losses on, clipping active), each
step's loss and global gradient norm to model_rtol of one step's path: EP2 x TP2 with sequence parallelism
(ETP = TP, each TP rank routing its sequence chunk, the experts' rows gathered and reduce-scattered over
TP), EP4 x DP4 with ETP 1 under TP2 (8 ranks, GeLU experts with biases), and Llama at TP2 x DP2 with ETP 1,
EP 1 on ZeRO-2 with a gated shared expert (every expert whole on every rank, reduced over expert-DP 4), and
TP2 x DP2 with sequence parallelism on ZeRO-3 (no EP)."""
import pytest

from megatron_zero.model.gpt import reference_model
from megatron_zero.testing import run_ranks
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol
from megatron_zero.distributed.topology import Layout, TopologyError

GROUP_LAYOUTS = [  # tp, pp, dp, ep, etp
    (2, 1, 4, 4, 1), (2, 1, 4, 2, 1), (2, 2, 2, 2, 2), (4, 1, 2, 2, 2), (1, 1, 8, 2, 2), (2, 1, 2, 2, 2),
    (4, 2, 2, 4, 1), (1, 2, 8, 2, 4),
]


@pytest.mark.parametrize("tp,pp,dp,ep,etp", GROUP_LAYOUTS)
def test_expert_groups_are_megatron_cores(tp, pp, dp, ep, etp):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    edp = tp * dp // (etp * ep)
    theirs = parallel_state.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    layout = Layout(tp=tp, pp=pp, dp=dp)
    layout.check_expert_parallel(ep, etp)
    for kind, name in (("expert_tp", "tp"), ("ep", "ep"), ("expert_dp", "dp")):
        assert sorted(layout.all_groups(kind, ep, etp)) == sorted(theirs.get_ranks(name)), kind
    if etp == tp:  # the carving of the EP-out-of-DP layouts is unchanged
        for r in range(layout.world_size):
            assert layout.expert_tp_group(r, ep, etp) == layout.tp_group(r)


@pytest.mark.parametrize("tp,pp,dp,cp,ep", [(1, 1, 1, 2, 2), (1, 1, 2, 2, 2), (1, 1, 2, 2, 4), (2, 2, 1, 2, 2),
                                          (2, 1, 2, 4, 8), (1, 2, 3, 2, 3)])
def test_expert_groups_with_context_parallelism_are_megatron_cores(tp, pp, dp, cp, ep):
    """With CP the expert groups are carved out of TP x CP x DP (ETP = TP): Megatron-Core's expert
    RankGenerator has no CP dimension, its data-parallel size world / (ETP x EP x PP); its dense one the CP."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp)
    dense = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    assert sorted(layout.all_groups("cp")) == sorted(dense.get_ranks("cp"))
    assert sorted(layout.all_groups("dp")) == sorted(dense.get_ranks("dp-cp"))
    theirs = parallel_state.RankGenerator(tp=tp, ep=ep, dp=layout.world_size // (tp * ep * pp), pp=pp, cp=1,
                                          order="tp-cp-ep-dp-pp")
    layout.check_expert_parallel(ep)
    for kind, name in (("expert_tp", "tp"), ("ep", "ep"), ("expert_dp", "dp")):
        assert sorted(layout.all_groups(kind, ep)) == sorted(theirs.get_ranks(name)), kind


def test_expert_layout_rules_refused():
    with pytest.raises(TopologyError, match="must divide TP x DP = 4"):
        Layout(tp=2, dp=2).check_expert_parallel(1, 3)
    with pytest.raises(TopologyError, match="must divide the data-parallel size 2"):
        Layout(tp=2, dp=2).check_expert_parallel(4)
    with pytest.raises(TopologyError, match="--context-parallel-size 2"):
        Layout(tp=2, dp=2, cp=2).check_expert_parallel(1, 1)
    with pytest.raises(TopologyError, match="must divide the data-parallel x context-parallel size 4"):
        Layout(dp=2, cp=2).check_expert_parallel(8)


MOE = {"num_experts": 4, "tensor_model_parallel_size": 2}


@pytest.mark.parametrize("changes,world,message", [
    ({**MOE, "expert_tensor_parallel_size": 1}, 4, "needs --sequence-parallel"),
    ({"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1}, 2, "give --num-experts"),
    ({**MOE, "sequence_parallel": True, "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 4}, 2,
     "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 4 must divide TP x DP = 2"),
    ({**MOE, "sequence_parallel": True, "expert_tensor_parallel_size": 4, "moe_ffn_hidden_size": 6}, 4,
     "--moe-ffn-hidden-size 6 is not a positive multiple of --expert-tensor-parallel-size 4"),
    ({**MOE, "sequence_parallel": True, "moe_expert_capacity_factor": 1.0}, 2, "expert capacity"),
    ({**MOE, "sequence_parallel": True, "expert_tensor_parallel_size": 1, "load": "/tmp/x",
      "universal_checkpoint": True}, 2, "with --universal-checkpoint is not available"),
    ({**MOE, "sequence_parallel": True, "expert_tensor_parallel_size": 1, "zero_stage": 3}, 2,
     "runs with --zero-stage 0, 1 or 2"),
    ({"num_experts": 4, "context_parallel_size": 2, "expert_model_parallel_size": 4}, 2,
     "--expert-model-parallel-size 4 must divide the data-parallel size 1 x --context-parallel-size 2 (= 2)"),
    ({**MOE, "sequence_parallel": True, "context_parallel_size": 2, "expert_tensor_parallel_size": 1}, 4,
     "other than TP with --context-parallel-size 2 is not available"),
])
def test_expert_tensor_parallel_flags_refused(changes, world, message, capsys):
    assert message in refused(with_flags(BASE, **changes), world, capsys)


def test_sequence_parallel_and_expert_tensor_parallel_accepted():
    from megatron_zero.arguments import parse_args

    args = parse_args(with_flags(BASE, **MOE, sequence_parallel=True, expert_tensor_parallel_size=1,
                                 expert_model_parallel_size=2), world_size=4)
    assert (args.expert_tensor_parallel_size, args.expert_model_parallel_size) == (1, 2)
    assert parse_args(with_flags(BASE, **MOE), world_size=2).expert_tensor_parallel_size == 2  # default: TP
    ep_cp = parse_args(with_flags(BASE, num_experts=4, context_parallel_size=2, expert_model_parallel_size=2),
                       world_size=2)  # EP carved out of DP x CP
    assert (ep_cp.expert_model_parallel_size, ep_cp.context_parallel_size, ep_cp.data_parallel_size) == (2, 2, 1)


SLOW = pytest.mark.slow
LAYOUTS = {  # name: (tp, dp, ep, etp, zero stage, micro-batch, llama, config overrides)
    "ep2_tp2_sp_zero1": (2, 2, 2, 2, 1, 2, False, {}),
    "ep4_dp4_etp1_tp2_sp_zero1": (2, 4, 4, 1, 1, 1, False, {}),
    "etp1_tp2_dp2_sp_zero2_llama_shared_gate": (2, 2, 1, 1, 2, 2, True, dict(
        moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True)),
    "tp2_dp2_sp_zero3": (2, 2, 1, 2, 3, 2, False, {}),  # ZeRO-3 gathers the experts the ETP path reads directly
    # the sequence-level aux loss: each sequence's tokens per expert summed over the TP ranks' rows (router.py;
    # default tier: tests/test_deepseek_toy.py::test_ep2_steps_match_one_process, its sequence-parallel routing)
    "ep2_tp2_sp_zero1_seq_aux": (2, 2, 2, 2, 1, 2, False, dict(moe_router_load_balancing_type="seq_aux_loss")),
}
DEFAULT_TIER = {"ep2_tp2_sp_zero1"}  # ~15 s on 4 ranks; the others 25 s and more
STEPS = 3


@pytest.mark.multirank
@pytest.mark.parametrize("name", [n if n in DEFAULT_TIER else pytest.param(n, marks=SLOW) for n in LAYOUTS])
def test_moe_sequence_parallel_expert_tp_matches_reference(name):
    tp, dp, ep, etp, stage, mb, llama, overrides = LAYOUTS[name]
    cfg = moe_config(llama, sequence_parallel=True, **overrides)
    ref_losses, ref_norms = reference_run(cfg, dp, mb, STEPS)
    results = run_ranks(parallel_run, tp * dp, cfg, tp, 1, ep, stage, mb, STEPS, etp=etp, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())  # the squares the global norm sums
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), f"{name} grad norm")

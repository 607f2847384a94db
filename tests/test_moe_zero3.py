"""ZeRO-3 with expert parallelism (zero/expert_stage3.py) against the single-process reference (fp32, dropless,
aux and z losses on, clipping active): each step's loss and global gradient norm to model_rtol of one step's path
(megatron_zero/testing/tolerances.py) at EP2 x DP2 (expert-DP 1) and EP2 x DP4 (expert-DP 2: the experts
partitioned, gathered and reduce-scattered over two ranks), GPT and Llama, with and without prefetching, EP2 x TP2,
EP2 x PP2, full recompute; the
weight matrices are gathered per unit (moe_train's ZERO3_PERSIST). With the optimizer offloaded (CPU, NVMe) at
ZeRO-3 and ZeRO-1, EP2 x DP4."""
import pytest

from megatron_zero.model.gpt import reference_model
from megatron_zero.testing import run_ranks
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol

STEPS = 4
LAYOUTS = {  # name: (tp, pp, dp, llama, prefetch, zero stage, optimizer offload); EP 2 throughout
    "ep2_dp2_zero3": (1, 1, 2, False, True, 3, "none"),
    "ep2_dp4_zero3": (1, 1, 4, False, True, 3, "none"),
    "ep2_dp4_zero3_llama_no_prefetch": (1, 1, 4, True, False, 3, "none"),
    "ep2_tp2_dp2_zero3_llama": (2, 1, 2, True, True, 3, "none"),
    "ep2_pp2_dp2_zero3_llama": (1, 2, 2, True, True, 3, "none"),
    "ep2_dp4_zero3_llama_full_recompute": (1, 1, 4, True, True, 3, "none"),
    "ep2_dp4_zero3_cpu_offload": (1, 1, 4, False, True, 3, "cpu"),
    "ep2_dp4_zero3_nvme_offload": (1, 1, 4, False, True, 3, "nvme"),
    "ep2_dp4_zero1_cpu_offload": (1, 1, 4, False, True, 1, "cpu"),
}


@pytest.mark.multirank
@pytest.mark.slow  # each > 30 s on 2 to 4 ranks
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_zero3_expert_parallel_matches_reference(name, tmp_path):
    tp, pp, dp, llama, prefetch, stage, offload = LAYOUTS[name]
    mb = 1 if pp > 1 else 2
    cfg = moe_config(llama, **({"recompute_granularity": "full", "recompute_method": "uniform"}
                               if "recompute" in name else {}))
    ref_losses, ref_norms = reference_run(cfg, dp, mb, STEPS)
    results = run_ranks(parallel_run, tp * pp * dp, cfg, tp, pp, 2, stage, mb, STEPS, prefetch=prefetch,
                        offload=offload, nvme_path=str(tmp_path), timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())  # the squares the global norm sums
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), f"{name} grad norm")


def test_expert_parallel_stage3_implements_the_protocol():
    import torch

    from megatron_zero.distributed.device import HOST
    from megatron_zero.zero.expert_stage import split_expert_groups
    from megatron_zero.zero.expert_stage3 import ExpertParallelStage3
    from megatron_zero.zero.stage_interface import ZeroStage

    model = reference_model(moe_config())
    dense, _, expert, _ = split_expert_groups([list(model.named_parameters())], [{}])
    stage = ExpertParallelStage3(dense, expert, None, None, torch.float32, 4000, model, HOST, persistence_threshold=0)
    assert isinstance(stage, ZeroStage)
    assert len(stage.initial_masters) == 2 and stage.group_partition_counts() == [1, 1]
    assert all(p.ds_owner is stage.expert for _, p in expert[0]) and stage.expert._storage is stage.dense._storage
    names = [[n for n, _ in g] for g in dense + expert]
    assert set(stage.slice_mappings(names)[1]) == set(names[1])
    stage.remove_hooks()


def test_zero3_and_offload_with_expert_parallelism_parse(capsys):
    from megatron_zero.arguments import parse_args
    from megatron_zero.testing.flag_checks import BASE, refused, with_flags

    moe = {"num_experts": 4, "expert_model_parallel_size": 2}
    args = parse_args(with_flags(BASE, **moe, zero_stage=3, save_16bit_model=True), world_size=2)
    assert (args.zero_stage, args.expert_model_parallel_size, args.save_16bit_model) == (3, 2, True)
    assert parse_args(with_flags(BASE, **moe, zero_stage=2, cpu_optimizer=True), world_size=2).offload == "cpu"
    for zeropp in ({"zero_quantized_gradients": True}, {"zero_hpz_partition_size": 2}):
        assert "runs without ZeRO++" in refused(with_flags(BASE, **moe, zero_stage=3, **zeropp), 2, capsys)

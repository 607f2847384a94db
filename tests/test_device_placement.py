"""Placement discipline: a Trainer given a device object creates every tensor of a step there.

How it is proved without a GPU. A tensor can land on the wrong device only where it is *made*
from nothing: a factory call (torch.zeros, empty, tensor, arange, ...). Every other op puts its
result beside its inputs (or fails on a device mismatch), and `*_like` / `Tensor.new_*` inherit
their input's device. A factory call that names no device goes to torch's default device, which
is the CPU whatever the trainer was given: on a GPU that is a CPU tensor in the step (a device
mismatch, or a silent host round trip). So on the CPU, where such a bug computes correctly, it
is still visible at the call: the factory reaches torch with no `device`.

The test runs each rank under a TorchFunctionMode that sees every factory call made by
megatron_zero code (the calling frame's module is in the package; torch's own internals are
not ours to place) while the Trainer is built with an explicit `torch.device` and while it
trains two iterations, and records each call that arrives without a device. A factory inside
`with torch.device(d):` (how build_gpt_stage makes the modules) arrives with `device=d` filled
in by torch's device context, so it counts as placed; host memory chosen on purpose (the
layout-independent initial weights, pinned staging buffers) names `HOST` explicitly. The test
asserts that no call went unplaced, that placed calls were seen at all (the mode is not
looking at nothing), and, after the two steps, that the parameters, ZeRO flat buffers, gradient
partitions, fp32 masters and Adam moments are on the trainer's device (host memory only for
the masters, moments and gradient partitions of --cpu-optimizer). Layouts: PP2 (p2p buffers,
tied-embedding sync), DP2 ZeRO-3 (gathers, saved-tensor hooks), DP2 ZeRO-2 with --cpu-optimizer, TP2 with
--sequence-parallel (the tensor-parallel mappings and cross-entropy); dropout on (the RNG tracker).

The second iteration is a logged one with --timing-log-level 2 --log-params-norm (the timers' gather,
the parameter norm's all-reduce over host masters with --cpu-optimizer). The same mode tells host
tensors from device tensors (testing/placement.py: a factory given device.HOST, pinned or given no
device makes a host tensor, and ops on host tensors only make host tensors), and every collective and
point-to-point call is watched: a host tensor handed to one is what NCCL refuses ("no GPU device"),
so the test asserts none was.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.testing.launch import model_flags
from megatron_zero.testing.multirank import run_ranks
from megatron_zero.testing.placement import PlacementTracker, watch_collectives


def _two_iterations(argv, tp, pp):
    from megatron_zero.arguments import parse_args
    from megatron_zero.config import from_args
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.training import Trainer

    device = torch.device("cpu")  # not device.HOST: the tracker tells the two apart by identity
    args = parse_args(argv, world_size=dist.get_world_size())
    tracker = PlacementTracker()
    with tracker, watch_collectives(tracker):
        trainer = Trainer(from_args(args), build_parallel_state(tp, pp), device)
        trainer.train()  # --train-iters 2, the second logged
    opt = trainer.optimizer
    home = torch.device("cpu") if opt.offload != "none" else device
    where = {
        "parameters": {p.device for p in trainer.model.parameters()},
        "grad partitions": {g.device for g in opt.impl.grad_partitions()},
        "masters": {p.device for p in opt.optimizer.params},
        "moments": {t.device for st in opt.optimizer.opt.state.values() for k, t in st.items() if k != "step"},
    }
    if hasattr(opt.impl, "flat"):
        where["flat buffers"] = {f.device for f in opt.impl.flat}
    else:
        where["shards"] = {p.ds_shard.device for g in opt.impl.groups for p in g}
    expected = {name: {home if name in ("masters", "moments", "grad partitions") else device} for name in where}
    masters_on_host = all(tracker.is_host(p) for p in opt.optimizer.params)
    # --cpu-optimizer: the reduced gradients are brought to the host as they land (zero/host_grads.py)
    grads_on_host = all(tracker.is_host(g) for g in opt.impl.grad_partitions())
    return (tracker.placed, tracker.unplaced, where, expected, tracker.host_in_collective, masters_on_host,
            grads_on_host)


# tp2_muon_qk_clip (slow: the tier has tp2_sequence_parallel's path): Muon's gathers and reduce-scatter, its TP
# gather (duplicated) and QK-clip's reductions take device tensors too
@pytest.mark.parametrize("layout", ["pp2", "dp2_zero3", "dp2_zero2_cpu_optimizer", "tp2_sequence_parallel",
                                    pytest.param("tp2_muon_qk_clip", marks=pytest.mark.slow)])
def test_trainer_makes_every_tensor_on_its_device(builtin_corpus, tmp_path, layout):
    data, tok = builtin_corpus
    tp, pp = (2 if layout.startswith("tp2") else 1), (2 if layout == "pp2" else 1)
    flags = {"pipeline-model-parallel-size": pp, "tensor-model-parallel-size": tp,
             "sequence-parallel": layout.startswith("tp2"),
             "zero-stage": {"pp2": 1, "dp2_zero3": 3, "dp2_zero2_cpu_optimizer": 2, "tp2_sequence_parallel": 1,
                            "tp2_muon_qk_clip": 1}[layout],
             "cpu-optimizer": layout.endswith("cpu_optimizer"), "device": "cpu",
             "num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 32,
             "micro-batch-size": 1, "global-batch-size": 4, "train-iters": 2, "eval-iters": 0,
             "log-interval": 2, "timing-log-level": 2, "log-params-norm": True,
             "hidden-dropout": 0.1, "attention-dropout": 0.1,
             "zero-param-persistence-threshold": 0, "data-cache-path": tmp_path / "cache"}
    if layout.endswith("muon_qk_clip"):
        flags.update({"optimizer": "muon", "muon-tp-mode": "duplicated", "qk-clip": True})
    results = run_ranks(_two_iterations, 2, model_flags(data, tok, **flags), tp, pp, timeout=300)
    for rank, (placed, unplaced, where, expected, host_in_collective, masters_on_host, grads_on_host) in enumerate(
            results):
        assert not unplaced, f"rank {rank}: factory calls without a device: {unplaced}"
        assert placed > 10, f"rank {rank}: only {placed} factory calls seen; the recorder is not looking"
        assert where == expected, f"rank {rank}: {where} != {expected}"
        # the tracker sees the offloaded masters as host memory (else the collective check would look at nothing)
        assert masters_on_host == layout.endswith("cpu_optimizer"), f"rank {rank}: masters on host: {masters_on_host}"
        assert grads_on_host == layout.endswith("cpu_optimizer"), f"rank {rank}: gradients on host: {grads_on_host}"
        assert not host_in_collective, f"rank {rank}: host tensors handed to collectives: {host_in_collective}"

"""Host reads of device tensors per training iteration: between log lines, only the step's one.

On a GPU every `.item()`, `.tolist()`, `bool()` / `float()` of a device tensor, `.cpu()` or print makes
the host wait for all the work queued so far, so the next iteration cannot be queued while this one
runs. Megatron reads the device once per step: the global gradient norm its clip (and the fp16 skip)
needs on the host. megatron_zero reads the same there (zero/clip_grad.norm_and_overflow: the norm, the
overflow test and the exit votes in one read) and nothing else until a log line; the loss is read at
--log-interval, the exit signal and time limit ride in that norm's all-reduce.

The Trainer trains 6 iterations at --log-interval 3 under testing/placement.py's tracker, which
records each host read of a non-host tensor with the megatron_zero line that made it (a host tensor:
made by device.HOST factories or from host tensors only; on the CPU the rest stands for the GPU's
device memory). Iterations 2, 4 and 5 must show exactly that one read (the first sets up each group's
shared memory at its first use, with object collectives). --exit-signal-handler and
--exit-duration-in-mins are on, so the exit votes are exercised; PP2 (the loss crosses the pipeline)
and DP2 ZeRO-2, also with a global batch that grows at iteration 4 (--step-batch-size-schedule); PP2 with
--rerun-mode validate_results and every check on (the step's loss copies ride in the norm's all-reduce: still
the one read).
"""
import pytest
import torch.distributed as dist

from megatron_zero.testing.launch import model_flags
from megatron_zero.testing.multirank import run_ranks
from megatron_zero.testing.placement import PlacementTracker

STEP_READ = "zero/clip_grad.py"  # norm_and_overflow: the one read of a step (Megatron's clip has it too)


def _syncs_per_iteration(argv, tp, pp):
    import torch

    from megatron_zero.arguments import parse_args
    from megatron_zero.config import from_args
    from megatron_zero.distributed.topology import build_parallel_state
    from megatron_zero.training import Trainer

    args = parse_args(argv, world_size=dist.get_world_size())
    tracker = PlacementTracker()
    starts = []
    with tracker:
        trainer = Trainer(from_args(args), build_parallel_state(tp, pp), torch.device("cpu"))
        step = trainer.train_step

        def marked_step(*a, **k):
            starts.append(len(tracker.syncs))
            return step(*a, **k)

        trainer.train_step = marked_step
        trainer.train()
    ends = starts[1:] + [len(tracker.syncs)]
    return [tracker.syncs[a:b] for a, b in zip(starts, ends)]  # from one step's start to the next's


# dp2_zero1_muon_qk_clip (slow: the tier has dp2_zero2's path): Muon's step and QK-clip read nothing either;
# pp2_validate_results (slow: pp2 holds the step's one read, which the checks' riders join)
@pytest.mark.parametrize("layout", ["pp2", "dp2_zero2", "dp2_zero2_growing_batch",
                                    pytest.param("pp2_validate_results", marks=pytest.mark.slow),
                                    pytest.param("dp2_zero1_muon_qk_clip", marks=pytest.mark.slow)])
def test_no_host_read_between_log_lines_but_the_steps_one(builtin_corpus, tmp_path, layout):
    data, tok = builtin_corpus
    pp = 2 if layout.startswith("pp2") else 1
    flags = {"pipeline-model-parallel-size": pp, "zero-stage": 1 if pp == 2 else 2, "device": "cpu",
             "num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 32,
             "micro-batch-size": 1, "global-batch-size": 4, "train-iters": 6, "eval-iters": 0,
             "log-interval": 3, "exit-signal-handler": True, "exit-duration-in-mins": 1000,
             "data-cache-path": tmp_path / "cache"}
    if layout.endswith("growing_batch"):  # batch 2 for 3 iterations (6 samples = 192 tokens), then 4
        flags.update({"global-batch-size": None, "step-batch-size-schedule": "0:2 192:4"})
    if layout.endswith("validate_results"):  # the checks read the loss copies riding in the norm's all-reduce
        flags.update({"rerun-mode": "validate_results", "check-for-spiky-loss": True, "check-for-large-grads": True,
                      "result-window": 2})
    if layout.endswith("muon_qk_clip"):  # the max logit is read at the log line only
        flags.update({"zero-stage": 1, "optimizer": "dist_muon", "muon-use-nesterov": True, "qk-clip": True})
    results = run_ranks(_syncs_per_iteration, 2, model_flags(data, tok, **flags), 1, pp, timeout=300)
    for rank, per_iteration in enumerate(results):
        assert len(per_iteration) == 6, f"rank {rank}: {len(per_iteration)} iterations"
        for iteration, syncs in enumerate(per_iteration, start=1):
            if iteration % 3 == 0 or iteration == 1:
                continue  # a log line reads the interval's losses; the first use of a group sets it up
            assert len(syncs) == 1 and syncs[0].startswith(STEP_READ), \
                f"rank {rank}, iteration {iteration}: host reads {syncs}; want the step's one in {STEP_READ}"

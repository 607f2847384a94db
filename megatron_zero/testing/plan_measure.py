"""A real one-rank training step of pretrain_gpt.py's flags, its live-tensor bytes measured from before the
model is built, beside the planner's prediction for the same flags (tests/test_plan.py):

    python -m megatron_zero.testing.plan_measure < RUNS.json  # a list of flag lists in; a list of these out
    torchrun --nproc_per_node N -m megatron_zero.testing.plan_measure RUNS.json   # N ranks (TP, CP, DP)
        {"measured_states": after the step (weights, gradients, optimizer state),
         "predicted_states": weights + gradients + optimizer + fp8 of planning/memory.py,
         "measured_peak": the second step's peak, "predicted_peak": the plan's peak,
         "predicted_host": under offload, what the plan puts in host memory (the offloaded optimizer state and
                           gradients: on the CPU the same memory the measurement counts),
         "bucket_size": the optimizer's reduce bucket (elements), "predicted_bucket_size": the plan's}

Each run in a gloo world of one rank in this process, or of torchrun's ranks (rank 0 measures and prints; the
planner's fake world is made and gone before the real one); the model converted as the trainer converts it
(FP8: --fp8-emulate on the CPU); the compiled kernels off, as the planner's trace takes PyTorch's path
(planning/fake_rank.py). Without a pipeline: a rank's one stage takes each micro-batch,
its share of the sequence under CP.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def measure(argv) -> dict:
    from ..arguments import parse_args
    from ..config import from_args
    from ..fp8.delayed import histories
    from ..model.architecture import gpt_config
    from ..model_converters import model_converters
    from ..ops.fusion_flags import set_fusion_flags
    from ..zero.build import build_optimizer
    from ..pipeline.gpt_stage import build_gpt_stage
    from ..planning.cli import plan_from
    from ..planning.fake_rank import UNFUSED
    from ..planning.live_bytes import LiveBytes
    from ..planning.memory import plan_memory
    from ..tensor_parallel.random import model_parallel_seed
    from ..distributed.topology import build_parallel_state

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    args = parse_args(argv, world_size=world)
    sections = from_args(args)
    config = gpt_config(args, args.vocab_size)
    plan = plan_from(sections, config, world)
    (predicted,) = plan_memory(plan)
    set_fusion_flags(**UNFUSED)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # one rank of its own (torchrun sets it): a port no other run holds
        from .multirank import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = build_parallel_state(**sections.parallel.degrees())
    model_parallel_seed(config.seed)
    mb = sections.parallel.micro_batch_size
    tokens = torch.randint(0, config.vocab_size, (mb, config.seq_length // state.cp_size))
    with LiveBytes() as live:
        model = build_gpt_stage(config, state, device=torch.device("cpu"))
        if sections.optimizer.bf16:
            model = model.to(torch.bfloat16)
        converters = model_converters(sections, state, torch.device("cpu"))  # FP8, the output loss: as the trainer
        converters.convert(model)
        optimizer = build_optimizer(model, sections.optimizer, state, torch.device("cpu"), muon=sections.muon,
                                    converters=converters)
        for step in range(2):  # the second step's peak: the optimizer's state exists from the first step on
            live.peak = live.current
            loss = model(tokens, labels=tokens)
            optimizer.backward(loss)
            del loss
            optimizer.step(lr=sections.optimizer.lr)
            converters.post_optimizer_hook(model)
        list(histories(model))  # FP8 delayed scaling's amaxes waiting to be reduced together (4 bytes each), recorded
        states = live.current
    dist.destroy_process_group()
    return dict(measured_states=states,
                predicted_states=predicted.weights + predicted.gradients + predicted.optimizer + predicted.fp8,
                measured_peak=live.peak, predicted_peak=predicted.peak,
                predicted_host=predicted.host_optimizer + predicted.host_gradients,
                bucket_size=getattr(optimizer.impl, "bucket_size", None), predicted_bucket_size=plan.bucket_elements)


if __name__ == "__main__":
    runs = json.load(open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin)
    measured = [measure(argv) for argv in runs]
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(measured))

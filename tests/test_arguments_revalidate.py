"""Validation is idempotent: a parsed and validated namespace validated again (as a caller that checks what it was
handed does) gives what validating its command line once gives, for command lines whose checks turn flags into
other forms (--pipeline-partition to a list, --moe-layer-freq's list or interval to a pattern and offset, a
DeepSpeed JSON's values, MoE and sample-schedule defaults, the virtual stages, the recompute granularity)."""
import json

import pytest

from megatron_zero.arguments import parse_args, validate_args
from megatron_zero.testing.flag_checks import BASE, with_flags

MOE = dict(num_experts=4, expert_model_parallel_size=2)
# (id, flag changes, world size)
LINES = [
    ("pipeline-partition", dict(pipeline_model_parallel_size=2, pipeline_partition="1,3"), 4),
    ("moe-layer-freq-list", dict(moe_layer_freq="[1,0,1,0]", **MOE), 2),
    ("moe-layer-freq-expression", dict(moe_layer_freq="[0]*2+[1]*2", **MOE), 2),
    ("moe-layer-freq-interval", dict(moe_layer_freq=2, **MOE), 2),
    ("moe-deepspeed-spelling", dict(num_experts=4, moe_expert_parallel_size=2), 2),
    ("virtual-pipeline", dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1), 2),
    ("context-parallel", dict(context_parallel_size=2, cp_comm_type="a2a"), 2),
    ("rampup-batch-size", dict(rampup_batch_size=[4, 4, 40], train_iters=None, train_samples=400), 2),
    ("sample-schedule", dict(train_iters=None, train_samples=400, lr_decay_samples=300, lr_warmup_samples=32), 1),
    ("recompute-and-gqa", dict(recompute_activations=True, group_query_attention=True, num_query_groups=2), 1),
    ("decoupled-lr-fp16", dict(decoupled_lr=1e-4, fp16=True), 1),
    ("deepspeed-json", dict(deepspeed_config="DS_JSON"), 2),
]


def _argv(tmp_path, changes):
    if changes.get("deepspeed_config") == "DS_JSON":
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5,
                                    "bf16": {"enabled": True}}))
        changes = {**changes, "deepspeed_config": str(path)}
    argv = with_flags(BASE, **{k: v for k, v in changes.items() if v is not None})
    for dropped in [k for k, v in changes.items() if v is None]:  # a flag of BASE the line replaces
        i = argv.index("--" + dropped.replace("_", "-"))
        del argv[i:i + 2]
    return argv


@pytest.mark.parametrize("changes,world", [pytest.param(c, w, id=i) for i, c, w in LINES])
def test_a_validated_namespace_validated_again_is_unchanged(tmp_path, changes, world):
    argv = _argv(tmp_path, changes)
    once = vars(parse_args(argv, world_size=world)).copy()
    again = parse_args(argv, world_size=world)
    for _ in range(2):
        assert vars(validate_args(again, world)) == once

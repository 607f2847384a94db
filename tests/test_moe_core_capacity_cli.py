"""Megatron-Core's router flags through pretrain_gpt.py, as users run them: EP2 on 2 ranks, 4 experts top-2,
capacity factor 0.5 (each expert keeps a quarter of a micro-batch's tokens) with the position drop policy and
padding to capacity, the sequence-level aux loss, the sigmoid score function and a top-k scaling factor.
The run trains and logs `seq_load_balancing_loss`; its losses differ from the dropless run's from the first
iteration (tokens were dropped)."""
import re

import pytest

from megatron_zero.testing.cli import cli_flags, logged_losses, pretrain_cli, text_data

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROUTER = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2, "expert-model-parallel-size": 2,
          "moe-router-load-balancing-type": "seq_aux_loss", "moe-router-score-function": "sigmoid",
          "moe-router-topk-scaling-factor": 2.0, "zero-stage": 1, "train-iters": 3}
CAPACITY = {"moe-expert-capacity-factor": 0.5, "moe-token-drop-policy": "position",
            "moe-pad-expert-input-to-capacity": True}


def test_core_router_flags_train_through_pretrain_gpt(tmp_path):
    data = text_data(tmp_path / "text")
    runs = {name: pretrain_cli(2, cli_flags(data, str(tmp_path / "cache"), "gpt2", ROUTER, extra))
            for name, extra in (("capacity", CAPACITY), ("dropless", {}))}
    losses = {name: logged_losses(run) for name, run in runs.items()}
    assert sorted(losses["capacity"]) == [1, 2, 3], runs["capacity"].stdout[-2000:]
    assert losses["capacity"][1] != losses["dropless"][1]
    values = re.findall(r"seq_load_balancing_loss: ([0-9.E+-]+) \|", runs["capacity"].stdout)
    assert len(values) == 3 and all(0.5 < float(v) < 4.0 for v in values), runs["capacity"].stdout[-2000:]

"""--moe-token-dispatcher-type allgather and --moe-router-load-balancing-type sinkhorn through pretrain_gpt.py,
as users run them: EP2 on 2 ranks, 4 experts, ZeRO-1. Sinkhorn top-1 with the all-gather dispatcher trains and
its losses equal, to model_rtol of a step's path, those of the same run with the all-to-all (the two
dispatchers compute the same sums in another order); Sinkhorn's losses differ from the aux-loss router's."""
import pytest

from megatron_zero.model.config import GPTConfig
from megatron_zero.testing.cli import TINY, cli_flags, logged_losses, pretrain_cli, text_data
from megatron_zero.testing.tolerances import assert_losses_close, gpt_path_length, model_rtol

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

MOE = {"num-experts": 4, "moe-router-topk": 1, "expert-model-parallel-size": 2, "zero-stage": 1, "train-iters": 3}
SINKHORN = {"moe-router-load-balancing-type": "sinkhorn", "moe-z-loss-coeff": 1e-3}


def test_allgather_and_sinkhorn_train_through_pretrain_gpt(tmp_path):
    data = text_data(tmp_path / "text")
    runs = {name: pretrain_cli(2, cli_flags(data, str(tmp_path / "cache"), "gpt2", MOE, extra))
            for name, extra in (("allgather", {**SINKHORN, "moe-token-dispatcher-type": "allgather"}),
                                ("alltoall", SINKHORN), ("aux_loss", {"moe-aux-loss-coeff": 1e-2}))}
    losses = {name: logged_losses(run) for name, run in runs.items()}
    for name, run in runs.items():
        assert sorted(losses[name]) == [1, 2, 3], run.stdout[-2000:]
    steps = sorted(losses["allgather"])
    config = GPTConfig(vocab_size=512, hidden_size=TINY["hidden-size"], num_layers=TINY["num-layers"],
                       num_attention_heads=TINY["num-attention-heads"], seq_length=TINY["seq-length"],
                       max_position_embeddings=TINY["seq-length"])
    rtol = model_rtol(gpt_path_length(config, TINY["global-batch-size"] * TINY["seq-length"]))
    assert_losses_close([losses["allgather"][s] for s in steps], [losses["alltoall"][s] for s in steps], rtol,
                        "allgather against alltoall")
    assert losses["aux_loss"][2] != losses["alltoall"][2]

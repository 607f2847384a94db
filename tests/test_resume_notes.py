"""What a resume says that a newcomer would otherwise not know, from pretrain_gpt.py: a reshaped resume of a run with
dropout says in one line that dropout's random streams start fresh (none is said with dropout 0), and each save to
the node-local tier logs a line as --save's do."""
import pytest

from megatron_zero.testing.launch import byte_data, pretrain, tiny_flags, torchrun

DROPOUT_LINE = "its random streams start fresh"


@pytest.mark.parametrize("dropout", ["0.1", pytest.param("0.0", marks=pytest.mark.slow)])  # default tier: 0.1
def test_reshaped_resume_with_dropout_says_its_streams_start_fresh(tmp_path, dropout):
    data = byte_data(str(tmp_path / "bytes"))
    for dropout, expected in ((dropout, dropout != "0.0"),):
        where = tmp_path / f"dropout{dropout}"
        where.mkdir()
        flags = {"hidden-dropout": dropout, "attention-dropout": dropout, "save-interval": 2}
        first = pretrain(where, data, **flags)
        assert first.returncode == 0, first.stderr[-2000:]
        resumed = torchrun(2, tiny_flags(where, data, **flags, **{"train-iters": 3, "load": where / "ckpt",
                                                                  "override-opt_param-scheduler": True}))
        out = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, out[-2000:]
        lines = [line for line in out.splitlines() if DROPOUT_LINE in line]
        assert len(lines) == int(expected), lines
        if expected:
            assert "--hidden-dropout 0.1" in lines[0] and "another layout" in lines[0]


def test_local_tier_saves_are_logged(tmp_path):
    run = pretrain(tmp_path, byte_data(str(tmp_path / "bytes")),
                   **{"train-iters": 4, "non-persistent-save-interval": 2, "non-persistent-ckpt-type": "local",
                      "non-persistent-local-ckpt-dir": tmp_path / "local"})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-2000:]
    assert [line for line in out.splitlines() if line.startswith("local tier: saved checkpoint")], out[-2000:]

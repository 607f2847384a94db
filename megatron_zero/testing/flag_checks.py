"""Flag-validation test helpers: a small valid argv, the same with flags changed, and the check that parse_args
refuses an argv with one line (exit 2, no traceback)."""
from ..arguments import parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3", "--train-iters", "10"]


def with_flags(base, **changes):
    """`base` with each flag of `changes` (python_name=value) set or appended (True: a switch; a list: the
    values of an nargs flag, appended)."""
    argv = list(base)
    for key, value in changes.items():
        flag = "--" + key.replace("_", "-")
        if flag in argv:
            i = argv.index(flag)
            argv[i + 1] = str(value)
        else:
            values = [] if value is True else [str(v) for v in value] if isinstance(value, list) else [str(value)]
            argv += [flag] + values
    return argv


def refused(argv, world_size, capsys):
    """parse_args refuses `argv` with exit 2 and one line on stderr, no traceback; -> that line."""
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=world_size)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err  # one line
    return err

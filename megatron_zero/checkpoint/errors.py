"""The one exception type checkpoint code raises for bad or mismatched checkpoints."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message is one sentence naming the file or value."""


# Crash points for the crash-safety tests: when MEGATRON_ZERO_CKPT_CRASH_AT names a point,
# the process SIGKILLs itself there (nothing is flushed, nothing cleaned up: a real crash).
CRASH_ENV = "MEGATRON_ZERO_CKPT_CRASH_AT"
CRASH_RANK_ENV = "MEGATRON_ZERO_CKPT_CRASH_RANK"


def crash_point(name: str, rank: int = 0) -> None:
    import os
    import signal

    if os.environ.get(CRASH_ENV) == name and int(os.environ.get(CRASH_RANK_ENV, rank)) == rank:
        os.kill(os.getpid(), signal.SIGKILL)

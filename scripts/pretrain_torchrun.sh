#!/usr/bin/env bash
# torchrun <args>, with SIGTERM (what SLURM and `kill` send) passed to the workers instead of torchrun:
#   bash scripts/pretrain_torchrun.sh --nproc_per_node 4 ... pretrain_gpt.py --exit-signal-handler <flags>
# torchrun answers SIGTERM by killing its workers after 30 s and exiting 1 with a traceback. Here the
# workers get it: with --exit-signal-handler they stop after the current iteration, save and exit 0,
# and then so does torchrun. A worker that exits 2 has printed its one sentence (bad input): torchrun's
# report of the workers' ends (its "closing signal SIGTERM" / "failed (exitcode: 2)" lines and the
# ChildFailedError traceback) is left out then and the job exits 2; any other failure keeps all of it,
# preceded by one line naming the rank that failed first (megatron_zero.distributed.initialize.first_failure: a rank
# that only lost contact with it is not the cause).
# Ctrl-C (SIGINT, to this script's process group from a terminal) goes to the workers too, and torchrun leaves
# it alone (it would stop the workers 30 s later and print a SignalException traceback): the first stops every
# rank after the current iteration, saved, exit 0, the second at once, one line, exit 130 (torchrun's report of
# the workers' ends left out, as for bad input). A worker that exits 17 has named a rank that computes wrong
# results (--rerun-mode validate_results, docs/reliability.md): the job exits 17, its report left out too.
# pretrain_gpt.py's flags are checked before torchrun starts (megatron_zero/elastic/flag_precheck.py: torchrun imports
# torch, seconds): a bad flag is refused at once, in the one sentence rank 0 would print, exit 2.
# OMP_NUM_THREADS defaults to 1 here (what torchrun sets, without its four-line warning about it).
# Used by pretrain_local.sh, torchrun_node.sh and pretrain_slurm.sbatch (LAUNCHER=torchrun).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-$root/.venv/bin/python}" -c '
import logging
import signal
import sys
from megatron_zero.elastic.flag_precheck import check_before_launch
check_before_launch(sys.argv[1:])  # a bad pretrain_gpt.py flag: one sentence, exit 2, before torch loads
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


class HoldBack(logging.Filter):
    """Holds the records of how the workers ended until it is known whether a worker refused bad input."""

    def __init__(self):
        super().__init__()
        self.held, self.release = [], False

    def filter(self, record):
        if not self.release:
            self.held.append(record)
        return self.release

    def flush(self):
        self.release = True
        for record in self.held:
            logging.getLogger(record.name).handle(record)


ends = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
hold = HoldBack()
ends.addFilter(hold)
# Ctrl-C: the script passes it on to the workers. torchrun (2.4 to 2.13) installs, for SIGINT among others,
# the handler that raises its SignalException; the one it installs here passes SIGINT over and raises for
# the rest (a handler, not an ignored signal, which the workers would inherit).
import torch.distributed.elastic.multiprocessing.api as torchrun_signals
raise_on_signal = getattr(torchrun_signals, "_terminate_process_handler", None)


def leave_ctrl_c_to_the_workers(signum, frame):
    if signum != signal.SIGINT:
        raise_on_signal(signum, frame)


if raise_on_signal is not None:  # another torch: its own handling (the workers still save; it adds a traceback)
    torchrun_signals._terminate_process_handler = leave_ctrl_c_to_the_workers
    signal.signal(signal.SIGINT, leave_ctrl_c_to_the_workers)
try:
    run(parse_args(sys.argv[1:]))
except ChildFailedError as failed:
    codes = {f.exitcode for f in failed.failures.values()}
    if 130 in codes and codes <= {130, -signal.SIGTERM}:  # stopped at once by Ctrl-C: rank 0 has said so
        sys.exit(130)
    if 17 in codes:  # a rank computes wrong results (--rerun-mode): it has said which, on which host
        sys.exit(17)
    if all(f.exitcode != 2 for f in failed.failures.values()):
        from megatron_zero.distributed.initialize import first_failure
        print(f"pretrain_torchrun: {first_failure(failed.failures)}", file=sys.stderr, flush=True)
        hold.flush()
        raise
    sys.exit(2)
except BaseException:
    hold.flush()
    raise
hold.flush()
' "$@" &
launcher=$!
forward() {
    local workers
    workers=$(ps -o pid= --ppid "$launcher" 2>/dev/null | tr -s ' \n' ' ')
    echo "pretrain_torchrun: SIGTERM; telling the workers (${workers:-none}) to save and stop" >&2
    [ -n "$workers" ] && kill -TERM $workers 2>/dev/null
}
trap forward TERM
forward_ctrl_c() {
    local workers
    workers=$(ps -o pid= --ppid "$launcher" 2>/dev/null | tr -s ' \n' ' ')
    [ -n "$workers" ] && kill -INT $workers 2>/dev/null
}
trap forward_ctrl_c INT
code=0
while kill -0 "$launcher" 2>/dev/null; do
    wait "$launcher"
    code=$?
done
exit "$code"

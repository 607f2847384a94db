#!/usr/bin/env bash
# torchrun <args>, with SIGTERM (what SLURM and `kill` send) passed to the workers instead of torchrun:
#   bash scripts/pretrain_torchrun.sh --nproc_per_node 4 ... pretrain_gpt.py --exit-signal-handler <flags>
# torchrun answers SIGTERM by killing its workers after 30 s and exiting 1 with a traceback. Here the
# workers get it: with --exit-signal-handler they stop after the current iteration, save and exit 0,
# and then so does torchrun. A worker that exits 2 has printed its one sentence (bad input): torchrun's
# report of the workers' ends (its "closing signal SIGTERM" / "failed (exitcode: 2)" lines and the
# ChildFailedError traceback) is left out then and the job exits 2; any other failure keeps all of it,
# preceded by one line naming the rank that failed first (megatron_zero.distributed.first_failure: a rank
# that only lost contact with it is not the cause).
# OMP_NUM_THREADS defaults to 1 here (what torchrun sets, without its four-line warning about it).
# Used by pretrain_local.sh, torchrun_node.sh and pretrain_slurm.sbatch (LAUNCHER=torchrun).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-$root/.venv/bin/python}" -c '
import logging
import sys
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
try:
    run(parse_args(sys.argv[1:]))
except ChildFailedError as failed:
    if all(f.exitcode != 2 for f in failed.failures.values()):
        from megatron_zero.distributed import first_failure
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
code=0
while kill -0 "$launcher" 2>/dev/null; do
    wait "$launcher"
    code=$?
done
exit "$code"

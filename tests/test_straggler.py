"""The straggler report (--log-straggler) as a user runs it: two ranks under torchrun, one made slow on purpose in
its forward compute (megatron_zero/testing/slow_rank.py sleeps there from a given step on); the report names
that rank, with its host, at the log line after the slowdown, and no rank before it. Each rank's forward time
is its own (the wall time per step is the same on every rank: the all-reduces make them wait for each other).

The slowdown (0.1 s a forward step against the tiny model's few milliseconds) is far past --straggler-factor
4, which is itself far past what a contended shared CPU does to two equal ranks (up to about 2x seen here over
fewer iterations than the 7 averaged here): the test asserts which rank is named, never a time."""
import argparse
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from megatron_zero.arguments import parse_args
from megatron_zero.elastic.straggler import StragglerReport, straggler_line
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.launch import byte_data, tiny_flags
from megatron_zero.testing.multirank import free_port

SLOW_RANK = os.path.join(ROOT, "megatron_zero", "testing", "slow_rank.py")
REPORT = re.compile(r"straggler report \| .*")


@pytest.mark.slow  # the default tier: the report's wiring in tests/test_training_log.py's run, its logic below
def test_the_report_names_the_rank_made_slow_and_no_rank_before(tmp_path):
    data = byte_data(tmp_path / "bytes")
    flags = tiny_flags(tmp_path, data, **{"train-iters": 16, "log-interval": 8, "save": None, "log-straggler": True,
                                          "straggler-factor": 4})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), SLOW_RANK] + flags
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLOW_RANK": "1", "SLOW_SECONDS": "0.1", "SLOW_AFTER": "8"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = REPORT.findall(run.stdout)
    assert len(reports) == 2, run.stdout[-3000:]
    host = socket.gethostname()
    assert reports[0].endswith("no rank over 4x the median"), reports  # iterations 2-8 (the first is left out): no slowdown
    assert re.search(rf"slowest rank 1 \({re.escape(host)}\) .*over 4x the median: rank 1 \({re.escape(host)}\) "
                     r"[0-9.]+x$", reports[1]), reports


def test_straggler_flags_need_log_straggler_and_sensible_values(capsys):
    assert "no effect without --log-straggler" in refused(with_flags(BASE, straggler_factor=2), 1, capsys)
    assert "must be above 1" in refused(with_flags(BASE, log_straggler=True, straggler_factor=1), 1, capsys)
    assert "never be turned on" in refused(with_flags(BASE, log_straggler=True, disable_straggler_on_startup=True),
                                           1, capsys)
    args = parse_args(with_flags(BASE, log_straggler=True, straggler_minmax_count=2))
    assert args.log_straggler and args.straggler_minmax_count == 2 and args.straggler_factor == 1.5


def test_the_line_names_the_n_slowest_and_fastest_and_compares_ranks_within_their_pipeline_stage():
    hosts = ["a", "b", "c", "d"]
    # the last stage's ranks (2, 3) take longer (the loss); only rank 1 is slow against its own stage's median
    line = straggler_line([0.010, 0.050, 0.030, 0.031], hosts, [0, 0, 1, 1], 2, 1.5)
    assert "slowest 2: rank 1 (b) 50.00, rank 3 (d) 31.00, fastest 2: rank 0 (a) 10.00, rank 2 (c) 30.00" in line
    assert line.endswith("over 1.5x the median: rank 1 (b) 5.00x")


def test_the_control_port_turns_the_report_off_and_on_at_the_next_log_line():
    port = free_port()
    elastic = argparse.Namespace(straggler_minmax_count=1, straggler_factor=1.5, disable_straggler_on_startup=True,
                                 straggler_ctrlr_port=port)
    report = StragglerReport(elastic, 0, 1, torch.device("cpu"), [0])
    report.timed(lambda: None)()
    assert report.line() is None  # off from the start: nothing timed, nothing said
    socket.create_connection(("127.0.0.1", port)).recv(1024)  # as `curl host:PORT`
    assert report.line() == " straggler report | on from the next iteration"
    report.timed(lambda: None)()
    assert "no rank over 1.5x the median" in report.line()
    socket.create_connection(("127.0.0.1", port)).recv(1024)
    assert report.line() == " straggler report | off from the next iteration"  # nothing timed since the last

"""bench/bench_max_seq_vs_mds.py's pure helpers: /proc status and log parsing, launch outcomes, the search."""
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from bench_max_seq_vs_mds import next_length, outcome, parse_log, summary, vmhwm_kib  # noqa: E402

STATUS = "Name:\tpython\nVmPeak:\t 9000000 kB\nVmHWM:\t  812345 kB\nVmRSS:\t  700000 kB\n"
LOG = """ iteration        1/       2 | consumed samples:            1 | elapsed time per iteration (ms): 1234.5 | \
learning rate: 1.000E-03 | lm loss: 7.654321E+00 | loss scale: 1.0 |
 iteration        2/       2 | consumed samples:            2 | elapsed time per iteration (ms): 987.6 | \
learning rate: 1.000E-03 | lm loss: nan | loss scale: 1.0 |
"""


def test_vmhwm_kib_reads_the_peak_line():
    assert vmhwm_kib(STATUS) == 812345
    assert vmhwm_kib("Name:\tkthreadd\n") == 0  # kernel threads have no VmHWM


def test_parse_log_reads_times_and_losses():
    iters = parse_log(LOG)
    assert sorted(iters) == [1, 2]
    assert iters[1] == (1234.5, 7.654321)
    assert iters[2][0] == 987.6 and math.isnan(iters[2][1])


def test_outcome_classifies_a_launch():
    ok = {1: (1.0, 7.0), 2: (1.0, 6.9)}
    assert outcome(0, 1000, ok, 2000) == "fit"
    assert outcome(0, 2001, ok, 2000) == "over"
    assert outcome(None, 2500, {}, 2000) == "over"  # killed at the budget
    assert outcome(None, 1500, ok, 2000) == "timeout"
    assert outcome(1, 1500, {}, 2000) == "failed: exit 1"
    assert outcome(0, 1500, {1: (1.0, 7.0)}, 2000) == "failed: 1 of 2 iteration lines"
    assert outcome(0, 1500, {1: (1.0, 7.0), 2: (1.0, math.nan)}, 2000) == "failed: loss not finite"


def test_next_length_doubles_until_a_miss():
    assert next_length({}, 1024, 65536, False) == 1024
    assert next_length({1024: "fit", 2048: "fit"}, 1024, 65536, False) == 4096
    assert next_length({1024: "fit", 2048: "fit"}, 1024, 2048, False) is None  # max length reached
    assert next_length({1024: "fit", 2048: "over"}, 1024, 65536, False) is None


def test_next_length_bisects_once_after_a_memory_miss():
    results = {1024: "fit", 2048: "fit", 4096: "over"}
    assert next_length(results, 1024, 65536, True) == 3072
    assert next_length({**results, 3072: "fit"}, 1024, 65536, True) is None  # one step only
    assert next_length({**results, 3072: "over"}, 1024, 65536, True) is None
    assert next_length({1024: "fit", 2048: "timeout"}, 1024, 65536, True) is None  # no memory result
    assert next_length({1024: "failed: exit 1"}, 1024, 65536, True) is None  # nothing fits
    assert next_length({1024: "fit", 2048: "fit", 4096: "failed: exit 1"}, 1024, 65536, True) == 3072
    assert next_length({1024: "fit", 1280: "over"}, 1024, 65536, True) is None  # halfway rounds to 1024


def test_summary_names_the_longest_fit_and_the_first_miss_after_it():
    assert summary({1024: "fit", 2048: "fit", 4096: "over", 3072: "fit"}) == (3072, 4096)
    assert summary({1024: "fit", 2048: "fit"}) == (2048, None)
    assert summary({1024: "over"}) == (None, 1024)

"""The re-run machine's parts without a run (megatron_zero/reliability/): the tracker file read by Megatron-LM's own
parser, the injection's determinism, the checks' thresholds, and the flags' refusals."""
import math

import pytest

from megatron_zero.arguments import ArgumentError, parse_command_line, validate_args
from megatron_zero.reliability import tracker
from megatron_zero.reliability.injection import ErrorInjector
from megatron_zero.reliability.validation import ResultChecks


def _lines(rank, iteration, *statuses, job="N/A"):
    return [tracker.tracker_line(rank, "cpu", iteration, s, float("nan"), "found NaN in the loss")
            .replace("jobID=N/A", f"jobID={job}") for s in statuses]


def _tracker(tmp_path) -> str:
    path = str(tmp_path / "tracker.txt")
    tracker.append_lines(path, _lines(0, 4, tracker.INITIAL_RUN, tracker.FIRST_RERUN_REPRODUCIBLE,
                                      tracker.SECOND_RERUN_REPRODUCIBLE)  # a genuine anomaly: skipped
                         + _lines(1, 6, tracker.INITIAL_RUN, tracker.FIRST_RERUN_NOT_REPRODUCIBLE)  # transient
                         + _lines(1, 7, tracker.FIRST_RERUN_REPRODUCIBLE, tracker.SECOND_RERUN_NOT_REPRODUCIBLE)
                         + _lines(0, 9, tracker.FIRST_RERUN_REPRODUCIBLE, tracker.SECOND_RERUN_REPRODUCIBLE)
                         + _lines(1, 9, tracker.FIRST_RERUN_REPRODUCIBLE))  # two ranks of one job: not skipped
    return path


def test_the_tracker_file_skips_what_one_rank_found_reproducible_twice(tmp_path):
    assert tracker.iterations_to_skip(_tracker(tmp_path)) == [4]
    assert tracker.iterations_to_skip(str(tmp_path / "absent.txt")) == []


@pytest.mark.slow  # importing megatron-core takes ~10 s here; the test above holds the rule's outcome
def test_the_tracker_file_is_read_as_megatron_lm_reads_it(tmp_path):
    rsm = pytest.importorskip("megatron.core.rerun_state_machine")
    path = _tracker(tmp_path)
    assert tracker.iterations_to_skip(path) == rsm.RerunStateMachine.get_skipped_iterations_from_tracker_file(path)


def test_injection_is_megatron_lm_s_rule_drawn_from_the_seed_and_the_iteration():
    injector = ErrorInjector(8, "transient_error", seed=11, world_size=2)
    drawn = [injector.injecting_ranks(i) for i in range(1, 200)]
    assert drawn == [ErrorInjector(8, "transient_error", 11, 2).injecting_ranks(i) for i in range(1, 200)]
    assert 0.15 < sum(map(len, drawn)) / len(drawn) < 0.35  # about one step in 8 per rank, 2 ranks
    hit = next(i for i in range(1, 200) if injector.injecting_ranks(i))
    (rank,) = injector.injecting_ranks(hit)
    assert injector.corrupts(hit, rank, 0) == "transient_error" and injector.corrupts(hit, rank, 1) is None
    assert injector.corrupts(hit, 1 - rank, 0) is None
    persistent, correct = (ErrorInjector(8, kind, 11, 2) for kind in ("persistent_error", "correct_result"))
    assert persistent.corrupts(hit, rank, 1) == "persistent_error" and persistent.corrupts(hit, 1 - rank, 1) is None
    assert correct.corrupts(hit, 1 - rank, 1) == "correct_result"  # the data: every rank, every run


def test_spikes_are_measured_against_the_window_of_accepted_steps():
    checks = ResultChecks(nan=True, spiky_loss=True, large_grads=True, loss_factor=10, grads_factor=10, window=3,
                          dynamic_loss_scale=False)
    for loss, norm in [(5.0, 1.0), (4.0, 2.0)]:
        assert checks.failure(loss * 100, norm * 100, False) is None  # the window is not full yet
        checks.accept(loss, norm)
    checks.accept(0.5, 0.5)
    assert checks.failure(49.9, 19.9, False) is None
    assert checks.failure(50.0, 1.0, False).startswith("spiky loss")
    assert checks.failure(1.0, 20.0, False).startswith("unexpectedly large gradients")
    checks.accept(0.4, 0.4)  # 5.0 and 1.0 leave the window: 4.0 and 2.0 lead it
    assert checks.failure(40.0, 1.0, False).startswith("spiky loss")
    assert checks.failure(math.nan, 1.0, False) == "found NaN in the loss"
    assert checks.failure(1.0, math.inf, True) == "found NaN or Inf in the gradients"
    dynamic = ResultChecks(True, False, False, 10, 10, 3, dynamic_loss_scale=True)
    assert dynamic.failure(1.0, math.inf, True) is None  # an fp16 overflow: the loss scaler skips the step


def parse_args(argv):
    return validate_args(parse_command_line(argv), 1)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2",
        "--tokenizer-type", "ByteTokenizer", "--mock-data"]


def test_the_flags_parse_and_bad_combinations_are_refused_in_one_sentence(tmp_path):
    args = parse_args(BASE + ["--rerun-mode", "validate_results", "--iterations-to-skip", "5", "3", "5",
                              "--error-injection-rate", "8", "--error-injection-type", "correct_result",
                              "--check-for-spiky-loss", "--check-for-large-grads",
                              "--result-rejected-tracker-filename", str(tmp_path / "t.txt")])
    assert (args.rerun_mode, args.iterations_to_skip, args.error_injection_type) == ("validate_results", (3, 5),
                                                                                     "correct_result")
    with pytest.raises(ArgumentError, match="--error-injection-rate 8 injects errors .* give --rerun-mode"):
        parse_args(BASE + ["--error-injection-rate", "8"])
    with pytest.raises(ArgumentError, match="--result-rejected-tracker-filename .*: its directory does not exist"):
        parse_args(BASE + ["--result-rejected-tracker-filename", str(tmp_path / "no" / "t.txt")])
    with pytest.raises(ArgumentError, match="--check-for-spiky-loss is checked by the re-run machine: give "
                                            "--rerun-mode validate_results"):
        parse_args(BASE + ["--check-for-spiky-loss", "--rerun-mode", "report_stats"])
    with pytest.raises(ArgumentError, match="iterations are counted from 1"):
        parse_args(BASE + ["--iterations-to-skip", "0"])
    with pytest.raises(ArgumentError, match="would count the tokens per expert twice"):
        parse_args(BASE + ["--rerun-mode", "validate_results", "--num-experts", "4", "--moe-router-score-function",
                           "sigmoid", "--moe-router-enable-expert-bias"])


def _machine(mode="validate_results"):
    import types

    import torch

    from megatron_zero.reliability.rerun import RerunMachine

    cfg = types.SimpleNamespace(rerun_mode=mode, check_for_spiky_loss=False, check_for_large_grads=False,
                                spiky_loss_factor=10.0, large_grads_factor=10.0, result_window=100,
                                result_rejected_tracker_filename=None, iterations_to_skip=(), error_injection_rate=0,
                                error_injection_type="transient_error")
    return RerunMachine(cfg, True, False, 1, 0, 2, torch.device("cpu"), ["host0", "host1"])


def _step(machine, *runs):
    """Run a step whose successive runs give these copies of the loss (rank 0's, rank 1's)."""
    given = iter(runs)

    def attempt(riders, gate):
        return gate(1.0, False, list(next(given)))

    return machine.run_step(3, attempt)


def test_a_failed_check_is_settled_by_the_re_run_and_the_other_ranks_copies():
    from megatron_zero.reliability.rerun import ResultFault

    nan = float("nan")
    machine = _machine()
    assert _step(machine, (5.0, 5.0)).result is True  # passes: applied at once
    assert _step(machine, (5.0, nan), (5.0, 5.0)).result is True  # differs on re-run: transient, re-run applied
    assert machine.transient_by_rank == {1: 1}
    assert _step(machine, (nan, nan), (nan, nan)).rejected == "found NaN in the loss"  # every rank: the data
    with pytest.raises(ResultFault, match=r"^rank 0 \(host0\) computed a wrong result at iteration 3 twice \(found "
                                          "NaN in the loss\\) where the other ranks did not"):
        _step(machine, (nan, 5.0), (nan, 5.0))  # the faulty rank named, though it is the first of two
    with pytest.raises(ResultFault, match=r"^rank 1 \(host1\) computed .* \(its copy of the loss differs"):
        _step(machine, (5.0, 6.0), (5.0, 6.0))  # a corrupted copy that passes the checks
    stats = _machine("report_stats")
    assert _step(stats, (5.0, 5.0), (5.0, 5.0)).result is True and stats.differences == [0.0]


def test_more_than_5_rejections_within_100_iterations_stop_the_run():
    from megatron_zero.reliability.rerun import TooManyRejected

    nan, machine = float("nan"), _machine()
    for _ in range(5):
        assert _step(machine, (nan, nan), (nan, nan)).rejected
    with pytest.raises(TooManyRejected, match="^6 steps were rejected within 100 iterations"):
        _step(machine, (nan, nan), (nan, nan))

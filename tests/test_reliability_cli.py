"""A run that heals itself, from the command line (megatron_zero/reliability/, docs/reliability.md).

With --rerun-mode validate_results every step's loss and gradient norm are checked; a failed check re-runs the
step from the same state. Injected transient errors (gone on re-run) leave every logged loss equal to a clean
run's; injected genuine anomalies (reproduced by every rank) and a real loss spike (a corpus whose batch k is
uniform random tokens, --check-for-spiky-loss) are rejected, and the run's losses equal a clean run given
--iterations-to-skip with the tracker file's iterations (or the tracker file itself, as a restart reads it); an
injected persistent error (reproduced on one rank only) stops the job with exit 17 naming the rank and host, no
checkpoint written after it; report_stats re-runs every step and finds no difference. The injection is drawn
from (--seed, iteration), so which iterations are hit is known: with --seed 11 on 2 ranks, rate 8 hits
iterations 4 and 5, rate 4 hits 1, 4, 5 and 9, rate 10 hits 7 (rank 1 each time).
"""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from megatron_zero.testing.cli import cli_flags, logged_losses, pretrain_cli, text_data
from megatron_zero.testing.launch import PRETRAIN
from megatron_zero.reliability.tracker import iterations_to_skip
from megatron_zero.testing.multirank import free_port

VALIDATE = {"rerun-mode": "validate_results"}
TP2_PP2 = {"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2}


def _flags(tmp_path, data, *changes):
    return cli_flags(data, str(tmp_path / "cache"), "gpt2", {"train-iters": 10}, *changes)


def _inject(kind, rate, tracker=None):
    return {**VALIDATE, "error-injection-type": kind, "error-injection-rate": rate,
            "result-rejected-tracker-filename": tracker}


def _summary(run):
    return re.search(r"result validation: .*", run.stdout).group(0)


def test_injected_transient_errors_heal_and_injected_anomalies_are_skipped_as_the_tracker_says(tmp_path):
    """DP2. Run A: genuine anomalies at iterations 4 and 5, rejected in-process and written to the tracker file.
    Run B reads that file at start-up (skipping 4 and 5, as a restart does) while transient errors hit iterations
    1 and 9: every loss B logs equals A's, bit for bit, so the re-runs changed nothing and the skips matched."""
    data, tracker = text_data(str(tmp_path / "text")), str(tmp_path / "rejected.txt")
    a = pretrain_cli(2, _flags(tmp_path, data, _inject("correct_result", 8, tracker)))
    for k in (4, 5):
        assert (f"iteration {k} rejected (found NaN in the loss, reproduced on re-run by every rank): its global "
                f"batch of 8 samples skipped, the state before it kept; recorded in {tracker}") in a.stdout
    assert _summary(a).startswith("result validation: 0 transient faults, 2 steps rejected as genuine anomalies")
    lines = open(tracker).read().splitlines()
    assert [re.search(r"iteration=(\d+) status=RerunValidationStatus\.(\w+)", x).groups() for x in lines] == [
        (k, s) for k in ("4", "5") for s in ("INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE")]
    b = pretrain_cli(2, _flags(tmp_path, data, _inject("transient_error", 4, tracker)))
    assert _summary(b).startswith("result validation: 2 transient faults (rank 1 (")
    assert "2 iterations skipped as asked" in _summary(b)
    losses = logged_losses(a)
    assert sorted(losses) == [1, 2, 3, 6, 7, 8, 9, 10] and logged_losses(b) == losses


def _saved(ckpt):
    return sorted(n for n in os.listdir(ckpt) if n.startswith("global_step"))


def _stopped_by_a_persistent_fault(tmp_path, nproc, flags, iteration, rank, saved):
    ckpt = tmp_path / "ckpt"
    run = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "pretrain_torchrun.sh"), "--nproc_per_node", str(nproc),
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), PRETRAIN]
        + flags + ["--save", str(ckpt), "--save-interval", "2"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                          "PYTHON": sys.executable})
    out = run.stdout + run.stderr
    assert run.returncode == 17 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert errors == [f"pretrain_gpt.py: error: rank {rank} ({os.uname()[1]}) computed a wrong result at iteration "
                      f"{iteration} twice (found NaN in the loss) where the other ranks did not: a persistent fault; "
                      "exclude that host and resume from the last checkpoint (exit 17)"], out[-3000:]
    assert _saved(ckpt) == saved and (ckpt / "latest").read_text() == saved[-1]


def test_an_injected_persistent_error_stops_with_exit_17_and_no_later_checkpoint(tmp_path):
    data = text_data(str(tmp_path / "text"))  # DP2: rank 1 injects at iteration 4, after the save of 2
    _stopped_by_a_persistent_fault(tmp_path, 2, _flags(tmp_path, data, _inject("persistent_error", 8)), 4, 1,
                                   ["global_step2"])


@pytest.mark.slow  # test_injected_transient_errors_heal_and_injected_anomalies_are_skipped_as_the_tracker_says
def test_injected_transient_errors_leave_every_loss_equal_to_a_clean_run(tmp_path):
    data = text_data(str(tmp_path / "text"))
    clean = pretrain_cli(2, _flags(tmp_path, data))
    healed = pretrain_cli(2, _flags(tmp_path, data, _inject("transient_error", 4)))
    assert _summary(healed).startswith("result validation: 4 transient faults")
    assert logged_losses(healed) == logged_losses(clean) and len(logged_losses(clean)) == 10


@pytest.mark.slow  # test_injected_transient_errors_heal_and_injected_anomalies_are_skipped_as_the_tracker_says
def test_injected_anomalies_leave_the_losses_of_a_clean_run_given_iterations_to_skip(tmp_path):
    data = text_data(str(tmp_path / "text"))
    healed = pretrain_cli(2, _flags(tmp_path, data, _inject("correct_result", 10, str(tmp_path / "t.txt"))))
    skip = iterations_to_skip(str(tmp_path / "t.txt"))
    assert skip == [7]
    clean = pretrain_cli(2, _flags(tmp_path, data, {"iterations-to-skip": skip}))
    assert "iteration 7 skipped as asked" in clean.stdout
    assert logged_losses(healed) == logged_losses(clean) and sorted(logged_losses(clean)) == [1, 2, 3, 4, 5, 6, 8, 9,
                                                                                              10]


def _spike_corpus(prefix: str, cache: str, k: int, iters: int, gbs: int = 8, seq: int = 16, seed: int = 11,
                  docs: int = 40, length: int = 120) -> str:
    """Documents of one repeated sentence, except that every token the global batch of iteration `k` reads is
    uniform random: the data order is the library's (the dataset built here as pretrain_gpt.py builds it)."""
    from megatron_zero.data import build_train_valid_test_datasets
    from megatron_zero.data.indexed_dataset import IndexedDatasetBuilder

    def write(texts):
        builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
        for t in texts:
            builder.add_document(t)
        builder.finalize()

    sentence = [ord(c) for c in "the cat sat. "]
    texts = [[sentence[(i + d) % len(sentence)] for i in range(length)] + [256] for d in range(docs)]
    write(texts)
    train, _, _ = build_train_valid_test_datasets([prefix], "100,0,0", seq, seed, [iters * gbs, 0, 0],
                                                  cache_dir=cache, vocab_size=257)
    rng = np.random.default_rng(0)
    for idx in range((k - 1) * gbs, k * gbs):
        i = int(train.shuffle_index[idx])
        (d0, o0), (d1, o1) = train.sample_index[i], train.sample_index[i + 1]
        for d in range(int(d0), int(d1) + 1):
            doc, lo, hi = int(train.document_index[d]), int(o0) if d == d0 else 0, int(o1) if d == d1 else length - 1
            texts[doc][lo:hi + 1] = rng.integers(0, 256, size=hi + 1 - lo).tolist()
    write(texts)  # the same document lengths: the same samples, now with batch k random
    shutil.rmtree(cache)
    return prefix


@pytest.mark.slow  # test_injected_transient_errors_heal_and_injected_anomalies_are_skipped_as_the_tracker_says
def test_a_real_loss_spike_is_rejected_and_skipped(tmp_path):
    k, cache = 10, str(tmp_path / "cache")
    data = _spike_corpus(str(tmp_path / "spike"), cache, k, iters=12)
    flags = {"train-iters": 12, "lr": 1e-2, "min-lr": 1e-3}
    spiky = {**VALIDATE, "check-for-spiky-loss": True, "spiky-loss-factor": 1.5, "result-window": 3,
             "result-rejected-tracker-filename": str(tmp_path / "t.txt")}
    unchecked = pretrain_cli(2, cli_flags(data, cache, "gpt2", flags))
    losses = logged_losses(unchecked)
    assert losses[k] > 1.5 * max(losses[i] for i in range(k - 3, k))  # batch k: a spike
    healed = pretrain_cli(2, cli_flags(data, cache, "gpt2", flags, spiky))
    assert f"iteration {k} rejected (spiky loss (at least 1.5x the largest of the last 3), reproduced" in healed.stdout
    assert _summary(healed).startswith("result validation: 0 transient faults, 1 steps rejected")
    clean = pretrain_cli(2, cli_flags(data, cache, "gpt2", flags, {"iterations-to-skip": [k]}))
    assert logged_losses(healed) == logged_losses(clean) and k not in logged_losses(clean)


@pytest.mark.slow  # test_injected_transient_errors_heal_and_injected_anomalies_are_skipped_as_the_tracker_says
def test_report_stats_reruns_every_step_and_finds_no_difference(tmp_path):
    data = text_data(str(tmp_path / "text"))
    run = pretrain_cli(2, _flags(tmp_path, data, {"rerun-mode": "report_stats"}))
    assert ("re-run statistics: 10 steps run twice; differences between the runs (loss and gradient norm): max "
            "0.000e+00, mean 0.000e+00, 0 nonzero") in run.stdout
    assert logged_losses(run) == logged_losses(pretrain_cli(2, _flags(tmp_path, data)))


@pytest.mark.slow  # the DP2 tests above hold the same claims in the default tier
def test_on_tp2_pp2_dp2_transients_heal_anomalies_skip_and_a_persistent_fault_stops(tmp_path):
    data = text_data(str(tmp_path / "text"))
    flags = lambda *c: _flags(tmp_path, data, TP2_PP2, {"train-iters": 6}, *c)  # noqa: E731
    clean = logged_losses(pretrain_cli(8, flags()))
    healed = pretrain_cli(8, flags(_inject("transient_error", 16)))  # ranks 3, 7, 2, 2 at iterations 1, 3, 4, 5
    assert _summary(healed).startswith("result validation: 4 transient faults") and logged_losses(healed) == clean
    rejected = pretrain_cli(8, flags(_inject("correct_result", 24, str(tmp_path / "t.txt"))))  # iteration 6
    skipped = pretrain_cli(8, flags({"iterations-to-skip": iterations_to_skip(str(tmp_path / "t.txt"))}))
    assert "iteration 6 rejected" in rejected.stdout and logged_losses(rejected) == logged_losses(skipped)
    assert sorted(logged_losses(skipped)) == [1, 2, 3, 4, 5]
    _stopped_by_a_persistent_fault(tmp_path, 8, flags(_inject("persistent_error", 24)), 6, 4,
                                   ["global_step2", "global_step4"])

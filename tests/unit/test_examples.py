"""The training example, ``python -m mpidist.examples.train_digits``: it learns, the same at any
number of ranks, resumes from its checkpoints, and explains every option.

Each run is a real ``mpiexec`` job (``tests/helpers/mpirun.py``); the whole file takes a few seconds.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from mpidist.examples import train_digits
from mpirun import run_mpi

TIMEOUT = 120
FINAL = re.compile(r"final held-out accuracy: (\d+\.\d+)%")


def _train(n, *args, tmp_path):
    argv = [sys.executable, "-m", "mpidist.examples.train_digits", "--checkpoint-dir", str(tmp_path / "ckpt"), *args]
    result = run_mpi(n, argv, timeout=TIMEOUT)
    assert result.returncode == 0, result.describe()
    finals = FINAL.findall(result.stdout)
    assert len(finals) == 1, result.describe()  # rank 0 only
    return float(finals[0]), result.stdout


def test_shipped_digits_are_scikit_learns():
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (the examples extra)")
    shipped = train_digits.load_digits("shipped")
    sklearn = train_digits.load_digits("sklearn")
    assert shipped[0].shape == (1797, 64) and shipped[1].shape == (1797,)
    np.testing.assert_array_equal(shipped[0], sklearn[0])
    np.testing.assert_array_equal(shipped[1], sklearn[1])


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_digits.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--epochs",
        "--global-batch-size",
        "--learning-rate",
        "--hidden",
        "--seed",
        "--test-fraction",
        "--checkpoint-dir",
        "--no-checkpoint",
        "--resume",
        "--regrow",
        "--progress",
        "--device",
        "--data",
        "--slow",
        "--min-accuracy",
    ):
        assert re.search(rf"^\s+{option}\b.*\n?.*\S", text, re.M), f"{option} is not explained"


@pytest.mark.parametrize(
    "args",
    [
        ["--epochs", "0"],
        ["--slow", "1"],
        ["--slow", "x:0.1"],
        ["--slow", "1:-2"],
        ["--regrow", "--no-checkpoint"],
        ["--learning-rate", "nan"],  # trained to chance accuracy and exited 0
        ["--learning-rate", "inf"],
        ["--seed", "-1"],  # a traceback from NumPy's generator
    ],
)
def test_bad_options_are_refused(args):
    with pytest.raises(SystemExit) as exit_info:
        train_digits.parse_args(args)
    assert exit_info.value.code == 2


def test_slow_names_a_rank_and_its_seconds_per_step():
    assert train_digits.parse_args(["--slow", "1:0.25"]).slow == (1, 0.25)
    assert train_digits.parse_args([]).slow is None


def test_accuracy_is_the_same_at_one_two_and_three_ranks(tmp_path):
    # 10 epochs instead of the default 20 keep this quick; the claim holds for any number.
    results = {n: _train(n, "--no-checkpoint", "--epochs", "10", tmp_path=tmp_path / str(n))[0] for n in (1, 2, 3)}
    assert min(results.values()) >= 95.0, results
    assert max(results.values()) - min(results.values()) <= 1.0, results


def test_resume_on_another_number_of_ranks(tmp_path):
    _, first = _train(2, "--epochs", "1", tmp_path=tmp_path)
    assert "epoch 1/1" in first and "saved ckpt-000001" in first
    _, second = _train(3, "--epochs", "2", "--resume", tmp_path=tmp_path)
    assert "after epoch 1" in second and "epoch 1/2" not in second and "epoch 2/2" in second, second
    _, done = _train(1, "--epochs", "2", "--resume", tmp_path=tmp_path)
    assert "after epoch 2" in done and "epoch 2/2" not in done, done  # nothing left to train


def test_a_global_batch_the_ranks_cannot_share_is_refused(tmp_path):
    argv = [sys.executable, "-m", "mpidist.examples.train_digits", "--no-checkpoint", "--global-batch-size", "61"]
    result = run_mpi(2, argv, timeout=TIMEOUT)
    assert result.returncode not in (0, None), result.describe()
    assert "not divisible by the 2 ranks" in result.stderr, result.describe()


def test_a_slow_rank_that_is_not_in_the_job_is_refused():
    # Before: no rank was slowed, silently.
    argv = [sys.executable, "-m", "mpidist.examples.train_digits", "--no-checkpoint", "--slow", "2:0.01"]
    result = run_mpi(2, argv, timeout=TIMEOUT)
    assert result.returncode == 2, result.describe()
    assert "error: --slow names rank 2, but the job has ranks 0 to 1" in result.stderr, result.describe()


def test_a_global_batch_larger_than_the_training_set_is_refused(tmp_path):
    # Before: no step per epoch, and a "final held-out accuracy" of an untrained network with exit status 0.
    argv = [sys.executable, "-m", "mpidist.examples.train_digits", "--no-checkpoint", "--global-batch-size", "5000"]
    result = run_mpi(2, argv, timeout=TIMEOUT)
    assert result.returncode == 2, result.describe()
    assert "--global-batch-size 5000 is larger than the 1438 training images" in result.stderr, result.describe()
    assert "final held-out accuracy" not in result.stdout, result.describe()


@pytest.mark.parametrize("resume", [False, True])
def test_an_unusable_checkpoint_directory_is_one_line_on_every_rank(tmp_path, resume):
    # Before: a traceback per rank (after an epoch of training, when saving).
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [sys.executable, "-m", "mpidist.examples.train_digits", "--epochs", "1", "--checkpoint-dir", str(blocker)]
    result = run_mpi(2, argv + ["--resume"] * resume, timeout=TIMEOUT)
    assert result.returncode not in (0, None), result.describe()
    what = "cannot --resume from" if resume else "cannot save a checkpoint in"
    assert result.stderr.count(f"error: {what} --checkpoint-dir {blocker}: rank ") == 2, result.describe()
    assert "Traceback" not in result.stderr, result.describe()

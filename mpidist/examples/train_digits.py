"""Data-parallel training of a small MLP on the handwritten digits data, one replica per MPI rank.

    python -m mpidist.examples.train_digits                            # one rank
    bash jobs/mpirun.sh -n 2 .venv/bin/python -m mpidist.examples.train_digits
    sbatch jobs/train.sbatch                                           # one rank per GPU

Every part of mpidist in one program:

- ``MPIStrategy``: one replica per rank; NumPy on CPUs, CuPy on each rank's GPU.
- Mirrored weights with ``MEAN`` aggregation: each rank computes the gradient of its share
  of the global batch and calls ``w.assign_sub(lr * grad)`` in replica context; the
  variable averages the ranks' updates (one allreduce) and applies the same update
  everywhere, so this is SGD on the whole global batch, whatever the number of ranks.
- Exact sync-on-read metrics (``Mean`` loss, ``Accuracy``): each rank accumulates its own
  samples; ``result()`` sums all ranks' exact accumulators, so the numbers do not depend
  on the number of ranks.
- The distributed array dataset: an ``ArrayDataset`` of global batches, shuffled per
  epoch by (seed, epoch), split over the ranks; the held-out set is read once exactly
  (its last batch padded and masked).
- A checkpoint every epoch (weights and the epoch counter); ``--resume`` continues from
  the newest one, on any number of ranks.
- Preemption: ``SIGUSR1`` or ``SIGTERM`` on any rank asks for a coordinated stop
  (``strategy.stop_on_signals``); every rank sees it after the same step
  (``strategy.should_stop()``), saves one checkpoint mid-epoch (with the metrics and the
  input position) and exits with status 0; ``--resume`` continues at that step and ends
  with the same weights as a run that was never stopped.
- Dead ranks (``MPIDIST_FAULT_TOLERANCE=1``, launched with Open MPI's ``mpiexec --with-ft ulfm``):
  the survivors recover to the start of the interrupted step and train on with the same global
  batch. With ``--regrow`` a job that shrank saves its checkpoint at the end of that epoch and
  exits with status 75 (``REGROW_STATUS``), for its batch script to requeue it at full size
  (``jobs/train.sbatch`` with ``MPIDIST_REGROW=1``); ``--resume`` continues from there.
- Progress on rank 0 only: a progress bar on a terminal, one plain line per epoch in a log.

For the same ``--global-batch-size`` (default 60, divisible by 1 to 6 ranks) the
training computes the same updates at any number of ranks, up to floating-point rounding
of the averaged gradients.

The data: the "Optical Recognition of Handwritten Digits" data set (E. Alpaydin and
C. Kaynak, 1998, UCI Machine Learning Repository, CC BY 4.0), 1797 8x8 images, as
scikit-learn distributes it (``sklearn.datasets.load_digits``, BSD-3-Clause). It is loaded
from scikit-learn when that is installed (``pip install 'mpidist[examples]'``), else from
the identical copy that ships with mpidist (``digits.npz`` next to this file), so no
download is ever needed.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional, TextIO

import numpy as np

import mpidist as md

if TYPE_CHECKING:
    from mpidist._typing import Array  # a NumPy or CuPy array

__all__ = ["REGROW_STATUS", "load_digits", "main", "parse_args", "split"]

DATA_FILE = Path(__file__).with_name("digits.npz")
# --regrow's exit status after ranks died and the checkpoint at the end of the epoch was saved:
# sysexits' EX_TEMPFAIL ("try again later"), for the batch script to requeue the job at full size.
REGROW_STATUS = 75
NUM_CLASSES = 10
# Launchers whose ranks see a terminal even when the job's output goes to a file or pipe.
_LAUNCHER_PROCESSES = (
    "prterun",
    "prted",
    "orterun",
    "orted",
    "mpiexec",
    "mpirun",
    "hydra_pmi_proxy",
    "mpiexec.hydra",
    "pmi_proxy",
)


# -- data -----------------------------------------------------------------------------------
def load_digits(source: str = "auto") -> tuple[np.ndarray, np.ndarray, str]:
    """``(images, labels, where from)``: 1797 x 64 pixel values 0..16 (uint8) and labels 0..9.

    ``source``: ``"sklearn"``, ``"shipped"`` (the copy in this package) or ``"auto"``
    (scikit-learn when installed, else the shipped copy). Both give identical arrays.
    """
    if source in ("auto", "sklearn"):
        try:
            from sklearn.datasets import load_digits as sklearn_load_digits
        except ImportError:
            if source == "sklearn":
                raise RuntimeError("--data sklearn needs scikit-learn: pip install 'mpidist[examples]'") from None
        else:
            bunch = sklearn_load_digits()
            return bunch.data.astype(np.uint8), bunch.target.astype(np.uint8), "scikit-learn"
    with np.load(DATA_FILE) as f:
        return f["data"], f["target"], "the copy shipped with mpidist"


def split(images: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int) -> tuple:
    """Scaled float32 ``(x_train, y_train, x_test, y_test)``: a fixed shuffle, then the last
    ``test_fraction`` of it held out. The same on every rank (no communication)."""
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = round(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    x = images.astype(np.float32) / 16.0
    y = labels.astype(np.int64)
    return x[train], y[train], x[test], y[test]


# -- the model: 64 -> hidden (tanh) -> 10, softmax cross-entropy ------------------------------
def _forward(xp: ModuleType, params: list, x: Array) -> tuple[Array, Array]:
    w1, b1, w2, b2 = params
    h = xp.tanh(x @ w1 + b1)
    return h, h @ w2 + b2


def _loss_and_grads(xp: ModuleType, params: list, x: Array, y: Array) -> tuple[Array, Array, list]:
    """Per-sample losses, logits, and the gradient of the mean loss over this rank's batch."""
    _w1, _b1, w2, _b2 = params
    h, logits = _forward(xp, params, x)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    rows = xp.arange(len(y))
    losses = -log_probs[rows, y]
    d_logits = xp.exp(log_probs)
    d_logits[rows, y] -= 1
    d_logits /= len(y)
    d_h = (d_logits @ w2.T) * (1 - h * h)
    grads = [x.T @ d_h, d_h.sum(axis=0), h.T @ d_logits, d_logits.sum(axis=0)]
    return losses, logits, grads


def _initial_params(hidden: int, seed: int) -> list[np.ndarray]:
    """Glorot-uniform weights, zero biases (rank 0's are broadcast when the variables are made)."""
    rng = np.random.default_rng(seed)

    def glorot(n_in: int, n_out: int) -> np.ndarray:
        limit = math.sqrt(6.0 / (n_in + n_out))
        return rng.uniform(-limit, limit, size=(n_in, n_out)).astype(np.float32)

    return [
        glorot(64, hidden),
        np.zeros(hidden, np.float32),
        glorot(hidden, NUM_CLASSES),
        np.zeros(NUM_CLASSES, np.float32),
    ]


# -- progress (rank 0) ---------------------------------------------------------------------------
def _is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` reaches a person's terminal.

    Open MPI's launcher gives the ranks a pseudo-terminal even when its own output goes to a
    file or a pipe (a batch job's log, CI): then the launcher's stdout decides.
    """
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    if os.environ.get("TERM") == "dumb" or ("SLURM_JOB_ID" in os.environ and "SLURM_PTY_PORT" not in os.environ):
        return False
    pid = os.getppid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            break
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        if name not in _LAUNCHER_PROCESSES:
            break
        try:
            target = os.readlink(f"/proc/{pid}/fd/1")
        except OSError:
            break
        if not target.startswith(("/dev/pts/", "/dev/tty")):
            return False
        pid = int(stat[stat.rfind(")") + 2 :].split()[1])
    return True


class Progress:
    """Rank 0's progress report: a bar redrawn in place on a terminal, else one line per epoch."""

    def __init__(self, mode: str, enabled: bool, steps: int, epochs: int) -> None:
        self.enabled = enabled
        self.bar = enabled and (mode == "bar" or (mode == "auto" and _is_terminal(sys.stdout)))
        self.quiet = mode == "none"
        self.steps, self.epochs = steps, epochs

    def step(self, epoch: int, step: int, started: float) -> None:
        if not (self.enabled and self.bar):
            return
        width = 30
        done = int(width * step / self.steps)
        rate = step / max(time.perf_counter() - started, 1e-9)
        sys.stdout.write(
            f"\repoch {epoch}/{self.epochs} [{'#' * done}{'.' * (width - done)}] "
            f"{step}/{self.steps} steps, {rate:.0f} steps/s "
        )
        sys.stdout.flush()

    def line(self, text: str, force: bool = False) -> None:
        if not self.enabled or (self.quiet and not force):
            return
        if self.bar:
            sys.stdout.write("\r\033[K")
        print(text, flush=True)


class _Position:
    """The training iterator's position, as a checkpoint item (``get_state`` / ``set_state``)."""

    def __init__(self) -> None:
        self.iterator: Any = None  # the epoch's iterator while training
        self.restored: Optional[dict] = None  # a position read by restore, until training continues from it

    def get_state(self) -> dict:
        return self.iterator.get_state() if self.iterator is not None else {}

    def set_state(self, state: dict) -> None:
        self.restored = state or None

    def step_in(self, epoch: int, global_batch_size: int) -> int:
        """Steps of ``epoch`` already done by the restored position (0: start the epoch afresh)."""
        state = self.restored
        if not state or state.get("epoch") != epoch:
            return 0
        return int(state.get("offset", 0)) // global_batch_size


# -- command line ----------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The example's options; ``--help`` explains each."""
    p = argparse.ArgumentParser(
        prog="python -m mpidist.examples.train_digits",
        description="Data-parallel training of a 64-H-10 MLP on the handwritten digits data (1797 8x8 images, "
        "10 classes), one replica per MPI rank. Start it with a launcher for more ranks: "
        "`bash jobs/mpirun.sh -n 2 .venv/bin/python -m mpidist.examples.train_digits`, or with "
        "`sbatch jobs/train.sbatch` on Slurm. For the same --global-batch-size the result is the "
        "same at any number of ranks that divides it.",
        epilog="Exit status: 0 after training (1 with --min-accuracy when the final held-out accuracy is below "
        "it; 2 for bad options). The data comes from scikit-learn when installed, else from the copy "
        "shipped with mpidist.",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=20,
        metavar="N",
        help="train until N epochs are done in total, counting epochs restored by --resume (default 20)",
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=60,
        metavar="B",
        help="samples per step over all ranks; each rank gets B/ranks, so B must be divisible by the "
        "number of ranks (default 60: 1 to 6 ranks)",
    )
    p.add_argument(
        "--learning-rate",
        type=float,
        default=0.5,
        metavar="LR",
        help="initial SGD step size, applied to the gradient averaged over the global batch; it decays "
        "to 0 along a cosine over the epochs (default 0.5)",
    )
    p.add_argument("--hidden", type=int, default=64, metavar="H", help="hidden units (default 64)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the initial weights, the train/held-out split and the per-epoch shuffle (default 0)",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        default=0.2,
        metavar="F",
        help="fraction of the data held out for evaluation (default 0.2: 359 images)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default="checkpoints/digits",
        metavar="DIR",
        help="save a checkpoint here after every epoch, keeping the newest two (default "
        "checkpoints/digits; it must be on a file system every rank sees)",
    )
    p.add_argument("--no-checkpoint", action="store_true", help="do not save checkpoints")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir, if there is one (it may have "
        "been saved by a different number of ranks); without one, start afresh",
    )
    p.add_argument(
        "--regrow",
        action="store_true",
        help="once ranks died and the survivors trained on (fault tolerance), save the checkpoint at the end "
        f"of the epoch and exit with status {REGROW_STATUS}, so that the job can start again at its full size "
        "and continue with --resume (jobs/train.sbatch: MPIDIST_REGROW=1 requeues it)",
    )
    p.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "none"),
        default="auto",
        help="rank 0's progress report: a bar on a terminal and one line per epoch otherwise (auto), "
        "always one of them, or only the final result (default auto)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default=None,
        help="NumPy on the CPU or CuPy on one GPU per rank (default: MPIDIST_DEVICE, else auto: "
        "a GPU when CuPy finds one)",
    )
    p.add_argument(
        "--data",
        choices=("auto", "sklearn", "shipped"),
        default="auto",
        help="where the digits come from: scikit-learn (the examples extra), the copy shipped with "
        "mpidist, or auto: scikit-learn when installed (default auto; both are identical)",
    )
    p.add_argument(
        "--slow",
        type=_slow_rank,
        default=None,
        metavar="RANK:SECONDS",
        help="make rank RANK sleep SECONDS in every training step, as a rank on a slower machine would be "
        "slower: run with MPIDIST_TIMELINE=DIR and `python -m mpidist timeline DIR` names it as the rank the "
        "others waited for (default: no rank is slowed)",
    )
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=None,
        metavar="PCT",
        help="exit with status 1 when the final held-out accuracy (in percent) is below PCT",
    )
    args = p.parse_args(argv)
    for name in ("epochs", "global_batch_size", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.test_fraction < 1:
        p.error(f"--test-fraction must be between 0 and 1, got {args.test_fraction}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        p.error(f"--learning-rate must be a finite number above 0, got {args.learning_rate}")
    if args.seed < 0:
        p.error(f"--seed must be at least 0, got {args.seed}")
    if args.regrow and args.no_checkpoint:
        p.error("--regrow continues from the checkpoint it saves: it cannot go with --no-checkpoint")
    return args


def _slow_rank(text: str) -> tuple[int, float]:
    """``--slow RANK:SECONDS`` as ``(rank, seconds)``."""
    rank, _, seconds = text.partition(":")
    try:
        slowed = (int(rank), float(seconds))
    except ValueError:
        slowed = (-1, -1.0)
    if slowed[0] < 0 or not slowed[1] >= 0:
        raise argparse.ArgumentTypeError(f"expected RANK:SECONDS, such as 1:0.01, got {text!r}")
    return slowed


# -- training ------------------------------------------------------------------------------------
def _save(checkpoint: md.Checkpoint, directory: str) -> str:
    """Collective: save into ``directory`` (keeping the newest two); the new save's name.

    A directory that cannot be written ends the job on every rank with one line (a save is
    collective: every rank raises when one cannot write).
    """
    try:
        return Path(checkpoint.save(directory, keep=2)).name
    except (OSError, md.CheckpointError) as exc:
        raise SystemExit(f"error: cannot save a checkpoint in --checkpoint-dir {directory}: {exc}") from exc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Train; rank 0 reports progress and the final held-out accuracy. Returns the exit status."""
    args = parse_args(argv)
    started = time.perf_counter()
    options = {} if args.device is None else {"device": args.device}
    strategy = md.MPIStrategy(**options)
    n, rank = strategy.num_replicas_in_sync, strategy.rank
    full_size = n  # the ranks the job started with; fewer once ranks died
    if args.global_batch_size % n:
        if rank == 0:
            print(
                f"error: --global-batch-size {args.global_batch_size} is not divisible by the {n} ranks; "
                f"pick a multiple of {n} (each rank gets an equal share of every step)",
                file=sys.stderr,
            )
        return 2
    if args.slow is not None and args.slow[0] >= n:
        if rank == 0:
            print(f"error: --slow names rank {args.slow[0]}, but the job has ranks 0 to {n - 1}", file=sys.stderr)
        return 2
    xp = strategy.backend.xp
    fault_tolerant = strategy.options.fault_tolerance  # MPIDIST_FAULT_TOLERANCE=1: survive dead ranks
    strategy.stop_on_signals(signal.SIGUSR1, signal.SIGTERM)  # a stop at the same step on every rank

    images, labels, source = load_digits(args.data)
    x_train, y_train, x_test, y_test = split(images, labels, args.test_fraction, args.seed)
    train = md.ArrayDataset((x_train, y_train), args.global_batch_size, shuffle=True, seed=args.seed)
    test = md.ArrayDataset((x_test, y_test), args.global_batch_size, remainder="mask")
    train_data = strategy.distribute_dataset(train)
    test_data = strategy.distribute_dataset(test)
    steps = len(train_data)
    if steps == 0:
        if rank == 0:
            print(
                f"error: --global-batch-size {args.global_batch_size} is larger than the {len(y_train)} training "
                "images: an epoch would have no step; pick a smaller batch",
                file=sys.stderr,
            )
        return 2

    with strategy.scope():
        params = [
            md.Variable(value, name=name, aggregation=md.VariableAggregation.MEAN)
            for name, value in zip(("w1", "b1", "w2", "b2"), _initial_params(args.hidden, args.seed))
        ]
        train_loss, train_accuracy = md.Mean("train_loss"), md.Accuracy("train_accuracy")
        test_accuracy = md.Accuracy("test_accuracy")
    epochs_done = np.zeros((), dtype=np.int64)
    position = _Position()
    checkpoint = md.Checkpoint(
        w1=params[0],
        b1=params[1],
        w2=params[2],
        b2=params[3],
        epochs_done=epochs_done,
        train_loss=train_loss.variables[0],
        train_accuracy=train_accuracy.variables[0],
        position=position,
    )

    progress = Progress(args.progress, rank == 0, steps, args.epochs)
    progress.line(
        f"training a 64-{args.hidden}-10 MLP on {len(y_train)} digits ({source}), {len(y_test)} held out; "
        f"{n} rank{'s' if n != 1 else ''} ({strategy.backend.name}), global batch {args.global_batch_size} "
        f"= {n} x {args.global_batch_size // n}, {steps} steps per epoch"
    )
    if args.resume:
        try:
            where = checkpoint.restore(args.checkpoint_dir)
        except FileNotFoundError:
            progress.line(f"no checkpoint in {args.checkpoint_dir} yet: starting afresh")
        except (OSError, ValueError, md.CheckpointError) as exc:  # raised on every rank: restore is collective
            raise SystemExit(f"error: cannot --resume from --checkpoint-dir {args.checkpoint_dir}: {exc}") from exc
        else:
            at = position.step_in(int(epochs_done), args.global_batch_size)
            progress.line(
                f"resumed from {where} after epoch {int(epochs_done)}"
                + (f" and step {at} of epoch {int(epochs_done) + 1}" if at else "")
            )

    lr = np.float32(args.learning_rate)  # set per epoch below

    def learning_rate(epoch: int) -> np.float32:
        """Cosine decay from --learning-rate at the first epoch towards 0 after the last."""
        return np.float32(args.learning_rate * 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs)))

    def train_step(batch: tuple[Array, Array]) -> None:
        if args.slow is not None and rank == args.slow[0]:
            time.sleep(args.slow[1])  # --slow: this rank computes more slowly than the others
        x, y = batch
        losses, logits, grads = _loss_and_grads(xp, [p.read_value() for p in params], x, y)
        for var, grad in zip(params, grads):
            var.assign_sub(lr * grad)  # collective: the MEAN of every rank's update, applied everywhere
        train_loss.update_state(losses)
        train_accuracy.update_state(y, logits)

    def test_step(batch: tuple[Array, Array], mask: Array) -> None:
        x, y = batch
        _, logits = _forward(xp, [p.read_value() for p in params], x)
        test_accuracy.update_state(y, logits, sample_weight=mask)

    def evaluate() -> float:
        test_accuracy.reset_state()
        for batch, mask in test_data:
            strategy.run(test_step, args=(batch, mask))
        return 100.0 * test_accuracy.result()

    accuracy = evaluate() if int(epochs_done) >= args.epochs else math.nan
    survived = ""  # what the failures of ranks cost, for the final line
    epoch = int(epochs_done)
    while epoch < args.epochs:
        try:
            epoch_started = time.perf_counter()
            train_data.set_epoch(epoch)
            lr = learning_rate(epoch)
            first = position.step_in(epoch, args.global_batch_size)
            if first:  # resuming mid-epoch: the metrics were restored too (or reset by a recovery)
                position.iterator = train_data.iterator_from_state(position.restored)
            else:
                position.iterator = iter(train_data)
                train_loss.reset_state()
                train_accuracy.reset_state()
            position.restored = None
            if fault_tolerant:  # where the survivors return to should ranks die: the start of each step
                strategy.snapshot(epoch=epoch, position=position.get_state())
            for step, batch in enumerate(position.iterator, first + 1):  # each rank: its share of the batches
                strategy.run(train_step, args=(batch,))
                if fault_tolerant:
                    strategy.snapshot(epoch=epoch, position=position.get_state())
                progress.step(epoch + 1, step, epoch_started)
                if strategy.should_stop():  # the same step on every rank
                    saved = (
                        "not saved (--no-checkpoint)"
                        if args.no_checkpoint
                        else f"saved {_save(checkpoint, args.checkpoint_dir)}"
                    )
                    progress.line(
                        f"stop requested: every rank stopped in epoch {epoch + 1}/{args.epochs} after step "
                        f"{step}/{steps}, {saved}; continue with --resume",
                        force=True,
                    )
                    return 0
            loss, train_acc = train_loss.result(), 100.0 * train_accuracy.result()
            accuracy = evaluate()
            epochs_done[...] = epoch + 1
            saved = "" if args.no_checkpoint else f", saved {_save(checkpoint, args.checkpoint_dir)}"
            progress.line(
                f"epoch {epoch + 1}/{args.epochs}: loss {loss:.4f}, train accuracy {train_acc:.2f}%, "
                f"held-out accuracy {accuracy:.2f}% ({time.perf_counter() - epoch_started:.2f} s{saved})"
            )
            epoch += 1
            if args.regrow and n < full_size and epoch < args.epochs:  # shrank: start again at full size
                progress.line(
                    f"regrow: {n} of {full_size} ranks left{survived}; stopped after epoch {epoch}/{args.epochs}"
                    f"{saved}; exit status {REGROW_STATUS}: start the job again at {full_size} ranks with --resume",
                    force=True,
                )
                return REGROW_STATUS
        except md.RankFailedError as failure:  # only with fault tolerance: the survivors carry on
            died = time.perf_counter()
            state = strategy.recover()  # every survivor back at the newest step start any of them reached
            n, rank = strategy.num_replicas_in_sync, strategy.rank
            if args.global_batch_size % n:
                raise SystemExit(
                    f"error: rank {rank}: {n} ranks survived, which do not divide --global-batch-size "
                    f"{args.global_batch_size}; pick a batch that every number of survivors divides"
                ) from failure
            train_data, test_data = strategy.distribute_dataset(train), strategy.distribute_dataset(test)
            epoch = int(state["epoch"])
            position.restored = state["position"] or None
            train_loss.reset_state()  # the dead ranks' part is lost: count the survivors' steps from here on
            train_accuracy.reset_state()
            progress = Progress(args.progress, rank == 0, steps, args.epochs)
            dead = ", ".join(str(r) for r in failure.failed_ranks)
            survived = f", after rank{'s' if len(failure.failed_ranks) > 1 else ''} {dead} died"
            progress.line(
                f"rank{'s' if len(failure.failed_ranks) > 1 else ''} {dead} died; {n} rank"
                f"{'s carry' if n != 1 else ' carries'} on from epoch {epoch + 1} step "
                f"{position.step_in(epoch, args.global_batch_size) + 1} with a global batch of "
                f"{args.global_batch_size} = {n} x {args.global_batch_size // n} (recovered in "
                f"{time.perf_counter() - died:.2f} s; this epoch's training metrics count from here on)",
                force=True,
            )

    elapsed = time.perf_counter() - started
    progress.line(
        f"final held-out accuracy: {accuracy:.2f}% ({len(y_test)} images, {n} rank{'s' if n != 1 else ''}"
        f"{survived}, {args.epochs} epochs, {elapsed:.1f} s)",
        force=True,
    )
    if args.min_accuracy is not None and not accuracy >= args.min_accuracy:
        if rank == 0:
            print(
                f"error: the final held-out accuracy {accuracy:.2f}% is below --min-accuracy {args.min_accuracy:.2f}%",
                file=sys.stderr,
            )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

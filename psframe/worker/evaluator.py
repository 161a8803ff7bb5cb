"""An evaluator beside training: every new committed checkpoint (or the newest), evaluated once, in step order.

TF's evaluator task (Estimator's ``train_and_evaluate``, with
``tf.contrib.training.checkpoints_iterator``) in psframe: a process that is
no worker polls the checkpoint folder, loads each checkpoint the chief
commits into a model of its own, evaluates it, and writes the metrics to
TensorBoard and the log::

    evaluator = psframe.Evaluator(model, lambda m: {"auc": auc_of(m)}, "s3://bucket/run-7",
                                  log_dir="runs/eval", max_step=10_000)
    history = evaluator.run()          # {1000: {"auc": 0.71}, 2000: {"auc": 0.74}, ...}

A committed checkpoint is one consistent view of every variable, so the
evaluator needs nothing else: it reads checkpoint files only. It never
connects to a ps task and holds no lock, so it can neither stall nor fail
the training job, and it may be started, killed and started again at any
time. A checkpoint pruned or damaged while it is read is skipped with a
warning, and the next one is tried. Every wait has a deadline.

An evaluation that takes longer than the chief takes between checkpoints
(delta checkpoints every few steps, say) falls further behind at each one
when every checkpoint is evaluated; with ``latest_only`` the evaluator goes
to the newest checkpoint each time, skipping those committed meanwhile, as
TF's ``checkpoints_iterator`` does.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from psframe import checkpoint
from psframe.checkpoint import files as checkpoint_files
from psframe.checkpoint.manifest import Manifest
from psframe.errors import CheckpointError
from psframe.worker.model_state import load_model_state

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("psframe.evaluator")

DEFAULT_POLL_SECONDS = 1.0
"""How often the checkpoint folder is listed while waiting (TF's ``checkpoints_iterator`` too)."""
DEFAULT_TIMEOUT = 600.0
"""Seconds without a new checkpoint after which the evaluator stops."""

EvaluateFn = Callable[[torch.nn.Module], Mapping[str, Any]]
LoadFn = Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], None]


def checkpoints_iterator(
    checkpoint_dir: str,
    *,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
    timeout: float = DEFAULT_TIMEOUT,
    max_step: int | None = None,
    stop: Callable[[], bool] | None = None,
    latest_only: bool = False,
) -> Iterator[Manifest]:
    """Each committed checkpoint of ``checkpoint_dir``, once, in step order, as training makes them.

    TF's ``tf.contrib.training.checkpoints_iterator``, yielding manifests. The
    folder is listed for checkpoints committed after the last one yielded;
    those already there when it starts come first (with ``latest_only``, only
    the newest of those found at each listing). A checkpoint pruned before
    its turn is never yielded. Nothing is verified or read beyond the
    manifest: :func:`psframe.checkpoint.load` checks the shards.

    It ends after yielding a checkpoint of step ``max_step`` or later; or
    when ``stop()`` returns True, asked each time a listing finds nothing
    new; or when ``timeout`` seconds pass without a new checkpoint, counted
    from the last one's return to the iterator (its evaluation does not count).

    Args:
        checkpoint_dir: the folder or fsspec URL the trainer saves to.
        poll_seconds: how often to list the folder while waiting.
        timeout: seconds to wait for a new checkpoint before ending.
        max_step: end after a checkpoint at or past this global step (the
            ``StopAtStepHook`` last step); None: no such end.
        stop: asked whenever there is nothing new; True ends the iteration.
        latest_only: yield the newest checkpoint committed since the last one
            yielded, skipping those in between (TF's); False: every one.

    Returns:
        An iterator of the manifests of the new committed checkpoints (``.step``, ``.folder``).

    Raises:
        ValueError: a setting out of range.
        TypeError: ``stop`` is not callable.
    """
    _check_seconds("poll_seconds", poll_seconds)
    _check_seconds("timeout", timeout)
    _check_max_step(max_step)
    if stop is not None and not callable(stop):
        raise TypeError(f"stop must be callable or None, got {type(stop).__name__}")
    if not isinstance(latest_only, bool):
        raise TypeError(f"latest_only must be a bool, got {type(latest_only).__name__}")
    # Checked here, not on the first next(): the generator below runs only when iterated.
    return _poll(checkpoint_dir, poll_seconds, timeout, max_step, stop, latest_only)


def _poll(
    checkpoint_dir: str,
    poll_seconds: float,
    timeout: float,
    max_step: int | None,
    stop: Callable[[], bool] | None,
    latest_only: bool,
) -> Iterator[Manifest]:
    last = -1
    deadline: float | None = None
    while True:
        newer = [m for m in _committed(checkpoint_dir) if m.step > last]
        if newer:
            manifest = newer[-1] if latest_only else newer[0]
            if len(newer) > 1 and latest_only:
                log.info("evaluator: going to checkpoint step %d, past %d not evaluated", manifest.step, len(newer) - 1)
            last = manifest.step
            yield manifest
            deadline = None  # the wait for the next one starts now
            if max_step is not None and last >= max_step:
                log.info("evaluator: checkpoint step %d reached max_step %d; done", last, max_step)
                return
            continue
        if stop is not None and stop():
            return
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout
            after = "a first checkpoint" if last < 0 else f"a checkpoint after step {last}"
            log.info("evaluator: waiting up to %gs for %s in %s", timeout, after, checkpoint_dir)
        if now >= deadline:
            log.info("evaluator: no new checkpoint in %s for %gs; done", checkpoint_dir, timeout)
            return
        time.sleep(min(poll_seconds, deadline - now))


class Evaluator:
    """Evaluates each checkpoint of a training run as the chief commits it.

    For each checkpoint of :func:`checkpoints_iterator`, :meth:`run` loads its
    parameters into ``model`` (``load_fn``), puts the model in ``eval()``
    mode, calls ``evaluate_fn(model)`` under ``torch.no_grad()``, writes each
    metric as a TensorBoard scalar at the checkpoint's global step (in
    ``log_dir``, when the ``tensorboard`` package is installed) and logs one
    line. It reads checkpoint files only: see :mod:`psframe.worker.evaluator`.

    A dynamic table (:class:`psframe.DynamicEmbedding`) of ``model`` looks
    its rows up in those the checkpoint held, and an id it did not hold gets
    its initial row, as an evaluation's lookup on the ps tasks would.

    Args:
        model: a model built as the trainer's was; the evaluator's own.
        evaluate_fn: ``evaluate_fn(model) -> {"name": number, ...}``.
        checkpoint_dir: the folder or fsspec URL the trainer saves to.
        log_dir: where TensorBoard event files go; None: the log only.
        poll_seconds: how often the folder is listed while waiting.
        timeout: stop after this many seconds without a new checkpoint.
        max_step: stop after evaluating a checkpoint at or past this global step.
        latest_only: evaluate the newest checkpoint each time, skipping those
            committed while the last one was evaluated (TF's evaluator); False: every one.
        load_fn: ``load_fn(model, state)`` puts the ``state_dict`` of
            :func:`psframe.checkpoint.load` into the model; by default
            :func:`psframe.worker.model_state.load_model_state`.

    Raises:
        ValueError: a setting out of range.
        TypeError: ``evaluate_fn`` or ``load_fn`` is not callable.

    Example::

        def evaluate(model):
            predicted = model(test_x).argmax(1)
            return {"accuracy": (predicted == test_y).float().mean().item()}

        history = psframe.Evaluator(Net(), evaluate, "ckpt/", log_dir="runs/eval", max_step=2000).run()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        evaluate_fn: EvaluateFn,
        checkpoint_dir: str,
        *,
        log_dir: str | None = None,
        poll_seconds: float = DEFAULT_POLL_SECONDS,
        timeout: float = DEFAULT_TIMEOUT,
        max_step: int | None = None,
        latest_only: bool = False,
        load_fn: LoadFn | None = None,
    ) -> None:
        for name, fn in (("evaluate_fn", evaluate_fn), ("load_fn", load_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        if not isinstance(checkpoint_dir, str) or not checkpoint_dir:
            raise ValueError(f"checkpoint_dir must be a folder or fsspec URL, got {checkpoint_dir!r}")
        _check_seconds("poll_seconds", poll_seconds)
        _check_seconds("timeout", timeout)
        _check_max_step(max_step)
        if not isinstance(latest_only, bool):
            raise TypeError(f"latest_only must be a bool, got {type(latest_only).__name__}")
        self.model = model
        self.evaluate_fn = evaluate_fn
        self.checkpoint_dir = checkpoint_dir
        self.log_dir = log_dir
        self.poll_seconds = poll_seconds
        self.timeout = timeout
        self.max_step = max_step
        self.latest_only = latest_only
        self.load_fn: LoadFn = load_fn or load_model_state
        self.history: dict[int, dict[str, float]] = {}
        """The metrics of every checkpoint evaluated so far, by global step."""
        self.skipped: list[int] = []
        """The steps of checkpoints skipped because they were pruned or damaged as they were read."""
        self._stop = threading.Event()

    def run(self) -> dict[int, dict[str, float]]:
        """Evaluate checkpoints until training is over (see :func:`checkpoints_iterator`).

        Returns:
            :attr:`history`: the metrics of each checkpoint evaluated, by global
            step, ascending (empty if none came before the timeout).

        Raises:
            ClusterMismatchError: a checkpoint does not fit the model.
            TypeError: ``evaluate_fn`` returned something other than names and numbers.
        """
        for _ in self.results():
            pass
        return self.history

    def results(self) -> Iterator[tuple[int, dict[str, float]]]:
        """What :meth:`run` does, yielding ``(global_step, metrics)`` as each checkpoint is evaluated."""
        writer = _summary_writer(self.log_dir)
        try:
            manifests = checkpoints_iterator(
                self.checkpoint_dir,
                poll_seconds=self.poll_seconds,
                timeout=self.timeout,
                max_step=self.max_step,
                stop=self._stop.is_set,
                latest_only=self.latest_only,
            )
            for manifest in manifests:
                metrics = self.evaluate(manifest)
                if metrics is not None:
                    if writer is not None:
                        for name, value in metrics.items():
                            writer.add_scalar(name, value, manifest.step)
                        writer.flush()
                    yield manifest.step, metrics
                if self._stop.is_set():
                    return
        finally:
            if writer is not None:
                writer.close()

    def evaluate(self, manifest: Manifest) -> dict[str, float] | None:
        """Load one checkpoint into the model and evaluate it.

        Args:
            manifest: a committed checkpoint (from :func:`checkpoints_iterator`).

        Returns:
            Its metrics, also kept in :attr:`history` and logged; None if the
            checkpoint was pruned or damaged as it was read (logged, and kept
            in :attr:`skipped`).
        """
        try:
            state = checkpoint.load(manifest.url, step=manifest.step)
        except (CheckpointError, FileNotFoundError) as e:
            log.warning("evaluator: skipping checkpoint %s (step %d): %s", manifest.folder, manifest.step, e)
            self.skipped.append(manifest.step)
            return None
        self.load_fn(self.model, state)
        self.model.eval()
        with torch.no_grad():
            metrics = _as_metrics(self.evaluate_fn(self.model))
        self.history[manifest.step] = metrics
        shown = " ".join(f"{name}={value:.6g}" for name, value in metrics.items())
        log.info("evaluator: checkpoint step %d: %s", manifest.step, shown)
        return metrics

    def stop(self) -> None:
        """Ask :meth:`run` to return after the checkpoint at hand (from any thread)."""
        self._stop.set()


def _committed(checkpoint_dir: str) -> list[Manifest]:
    """The committed checkpoints, full and delta, by step (a full one where both have a step)."""
    try:
        deltas = checkpoint_files.list_checkpoints(checkpoint_dir, deltas=True)
        by_step = {m.step: m for m in [*deltas, *checkpoint_files.list_checkpoints(checkpoint_dir)]}
        return [by_step[step] for step in sorted(by_step)]
    except OSError as e:  # storage that cannot be reached now: try again at the next poll, within the deadline
        log.warning("evaluator: cannot list %s (%s); trying again", checkpoint_dir, e)
        return []


def _as_metrics(raw: Any) -> dict[str, float]:
    if not isinstance(raw, Mapping):
        raise TypeError(f"evaluate_fn must return a dict of metric names to numbers, got {type(raw).__name__}")
    metrics = {}
    for name, value in raw.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError) as e:  # RuntimeError: a tensor of several values
            raise TypeError(f"evaluate_fn's metric {name!r} must be a number, got {value!r}") from e
        if not isinstance(name, str) or not name:
            raise TypeError(f"evaluate_fn's metric names must be non-empty str, got {name!r}")
        metrics[name] = number
    return metrics


def _summary_writer(log_dir: str | None) -> SummaryWriter | None:
    if log_dir is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning(
            "evaluator: the tensorboard package is not installed (pip install 'psframe[tensorboard]'); "
            "metrics go to the log only, not to %s",
            log_dir,
        )
        return None
    return SummaryWriter(log_dir)


def _check_max_step(max_step: int | None) -> None:
    if max_step is not None and (isinstance(max_step, bool) or not isinstance(max_step, int) or max_step < 0):
        raise ValueError(f"max_step must be an int >= 0 or None, got {max_step!r}")


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


__all__ = ["DEFAULT_POLL_SECONDS", "DEFAULT_TIMEOUT", "Evaluator", "checkpoints_iterator"]

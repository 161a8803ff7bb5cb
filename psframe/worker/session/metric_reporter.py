"""The chief's metric for the ps tasks' ``ReduceLROnPlateau`` schedules (``Trainer.report_metric``).

The word-language-model recipe (divide the learning rate when the validation
loss stops improving) with the optimizer on the ps tasks: the chief evaluates,
and reports the loss to every ps task; each steps its plateau schedules with it
(:mod:`psframe.ps.service.metric_report`), from the chief's global step on.
A ps task lost as it is told is waited for, and told again; the others are
not told twice.
"""

from __future__ import annotations

import logging

from psframe.errors import PsframeError
from psframe.worker.client import control_calls
from psframe.worker.session.session import Attempt, Session

log = logging.getLogger(__name__)


def report_metric(session: Session, value: float, task_index: int) -> int:
    """Report ``value`` to every ps task, counted from the global step of the values received
    (``task_index``: this worker's; the chief's, 0, alone reports).

    Returns:
        The global step from which the ps tasks count it (the latest among them: in synchronous
        training, the same on every one).

    Raises:
        PsframeError: this worker is not the chief, or a ps task has no ``ReduceLROnPlateau``
            schedule (``OptimizerConfigError``), or could not be reached.
    """
    if task_index != 0:
        raise PsframeError(
            f"the chief (worker 0) reports metrics for the learning-rate schedules; this is worker {task_index}"
        )
    step = session.global_step
    told: dict[int, int] = {}  # ps task -> the step from which it counts the metric
    rates: dict[int, float] = {}
    clients: list[object] = []

    def attempt(at: Attempt) -> None:
        if not clients or clients[-1] is not at.client:  # a layout of its own: every task is told
            told.clear()
            clients.append(at.client)
        tasks = [k for k in range(at.client.num_ps) if k not in told]
        failure = None
        for task, (reply, error) in zip(tasks, control_calls.report_metric(at.client, float(value), step, tasks)):
            if reply is not None:
                told[task], rates[task] = reply.global_step, reply.learning_rate
            failure = failure or error
        if failure is not None:
            raise failure

    session.call(attempt, then="reporting the metric again")
    if len(set(rates.values())) > 1:
        log.warning("the ps tasks' learning rates differ after metric %g: %s", value, rates)
    log.info("metric %g reported at global step %d; learning rate %s", value, step, sorted(set(rates.values())))
    return max(told.values())

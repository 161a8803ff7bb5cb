"""The ReportMetric handler: the chief's metric steps the ps task's ``ReduceLROnPlateau`` schedules.

The chief reports a metric (``Trainer.report_metric``: a validation loss, say)
to every ps task with its global step; each task's plateau schedules
(:mod:`psframe.ps.store.schedules`) count it from that step on: at once where
the task is there already, else once it gets there. Every task sees the same
metrics in the same order, so their learning rates agree; in synchronous
training, where no round ends without the chief, every task counts a metric
from the same step.
"""

from __future__ import annotations

import logging

from psframe.errors import NotReadyError
from psframe.ps.service.membership import Membership
from psframe.ps.store import VariableStore
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)


class MetricReportHandler:
    """Steps the plateau schedules of ``store``'s optimizers with the metrics workers ``membership``
    admits report.

    Args:
        membership: admits the caller.
        store: the model, with its schedules.
        task_name: for the log.
    """

    def __init__(self, membership: Membership, store: VariableStore, task_name: str) -> None:
        self._membership, self._store, self._task_name = membership, store, task_name

    def report_metric(self, request: pb.ReportMetricRequest) -> pb.ReportMetricReply:
        """Count the metric from the request's global step on; the reply says from which step, and the rate.

        Raises:
            NotReadyError: the task holds no model yet.
            OptimizerConfigError: no optimizer here has a ``ReduceLROnPlateau`` schedule.
        """
        self._membership.check_caller(request.caller)
        store = self._store
        with store.lock:
            if not store.ready:
                raise NotReadyError(f"{self._task_name} holds no model yet: there is no schedule to report to")
            schedules = store.schedules
            step = schedules.report(request.value, request.global_step)
            rate = schedules.learning_rate()
        log.info(
            "%s: metric %g counted from global step %d (reported at %d); learning rate %g",
            self._task_name,
            request.value,
            step,
            request.global_step,
            rate,
        )
        return pb.ReportMetricReply(global_step=step, learning_rate=rate or 0.0)

"""A ps task asked to stop while it serves (:meth:`psframe.Server.join`): Ctrl-C, or SIGTERM.

Either way the task stops serving (its port and serving processes released)
and ends with one line on stderr and no traceback, whether or not
:func:`psframe.flags.run` wraps the script:

- Ctrl-C: ``PROG: interrupted by Ctrl-C (SIGINT); stopped``, then
  :class:`~psframe.errors.Interrupted` (exit code 130; still a
  ``KeyboardInterrupt`` to a script that catches one);
- SIGTERM (Kubernetes deleting the pod, a spot machine reclaimed, ``psframe
  launch`` stopping its tasks): first a checkpoint of the whole cluster, where
  the task has a ``checkpoint_dir`` and every ps task holds the model, at one
  cut as ``psframe shutdown`` saves it (:func:`save_cluster`), within the grace
  (``PSFRAME_STOP_GRACE``, :mod:`psframe.config.stopping`); then
  ``PROG: stopped by SIGTERM; /job:ps/task:0 saved a checkpoint of global step
  N in DIR`` (or why it saved none), and :class:`~psframe.errors.TaskStopped`
  (exit code 143).

The other ps tasks and the workers go on: a worker waits for a lost ps task
to come back, and a ps task started again restores its shard from the newest
checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

from psframe.checkpoint import files as checkpoint_io
from psframe.checkpoint.manifest import ShardRecord
from psframe.cluster import ClusterSpec
from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.config.stopping import EXIT_INTERRUPTED, EXIT_TERMINATED, SigtermHandler, program, say
from psframe.errors import Interrupted, PsframeError, TaskStopped
from psframe.ps.elastic.peers import PsPeers
from psframe.wire import one_cut, transport
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)

MAX_HOLD_S = 10.0  # a checkpoint's cut holds pushes back this long at most (as the chief's)


@contextlib.contextmanager
def sigterm_noted() -> Iterator[threading.Event]:
    """An event set when SIGTERM comes, while the block runs (main thread, where SIGTERM has its
    default action; elsewhere the event is never set and SIGTERM does what it did)."""
    asked = threading.Event()
    handler = SigtermHandler(asked.set)
    handler.install()
    try:
        yield asked
    finally:
        handler.restore()


def interrupted() -> NoReturn:
    """Say that Ctrl-C stopped the task (it is stopped already) and end it: exit code 130."""
    say(f"{program()}: interrupted by Ctrl-C (SIGINT); stopped")
    raise Interrupted(EXIT_INTERRUPTED)


def terminated(task_name: str, saved: str) -> NoReturn:
    """Say that SIGTERM stopped the task (it is stopped already) and what it saved; exit code 143."""
    say(f"{program()}: stopped by SIGTERM; {task_name} {saved}")
    raise TaskStopped(EXIT_TERMINATED)


def save_cluster(
    cluster: ClusterSpec,
    task_index: int,
    checkpoint_dir: str | None,
    *,
    security: Security,
    liveness: Liveness,
    timeout: float,
) -> str:
    """Save a checkpoint of every ps task's shard at one cut, as ``psframe shutdown`` does.

    Ps task ``task_index`` leads it as a tool would: it asks every ps task
    (itself too, through its own port) to hold, then to save at the cut, and
    writes the manifest. Nothing is raised: a checkpoint a ps task cannot
    take part in (it is gone, holds no model yet) is not saved, and the reason
    comes back.

    Args:
        cluster: the task's cluster.
        task_index: the ps task that leads the save.
        checkpoint_dir: where to save; None: nothing is saved.
        security, liveness: the task's, for its calls.
        timeout: seconds the whole save may take.

    Returns:
        What happened, as the end of a sentence: ``"saved a checkpoint of
        global step 40 in DIR"``, or ``"saved no checkpoint (...)"``.
    """
    if not checkpoint_dir:
        return "saved no checkpoint (it has no checkpoint_dir)"
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PsframeError(f"the save ran out of its {timeout:g}s (PSFRAME_STOP_GRACE)")
        return remaining

    peers = PsPeers(cluster, task_index, security, liveness)
    caller = pb.Caller(
        job_name="tool", task_index=0, cluster_fingerprint=cluster.fingerprint, ps_fingerprint=cluster.ps_fingerprint
    )
    try:
        every = [peers.connection(k) for k in range(cluster.num_ps)]
        infos = transport.call_all([(ps, "GetInfo", pb.InfoRequest(caller=caller)) for ps in every], left())
        waiting = [k for k, info in enumerate(infos) if info.state != pb.TaskInfo.READY]
        if waiting:
            return f"saved no checkpoint ({ClusterSpec.task_name('ps', waiting[0])} holds no model)"
        step = infos[0].global_step
        if any(m.step == step for m in checkpoint_io.list_checkpoints(checkpoint_dir)):
            return f"saved no checkpoint (the one of global step {step} is committed already)"
        records = _save_at_one_cut(every, caller, checkpoint_dir, step, left)
        manifest = checkpoint_io.write_manifest(checkpoint_dir, step, records)
    except PsframeError as e:
        text = " ".join(str(e).split())
        log.warning("%s: no checkpoint saved on leaving: %s", ClusterSpec.task_name("ps", task_index), text)
        return f"saved no checkpoint ({type(e).__name__}: {text})"
    finally:
        peers.close()
    return f"saved a checkpoint of global step {step} in {manifest.folder}"


def _save_at_one_cut(
    every: list[transport.Connection], caller: pb.Caller, checkpoint_dir: str, step: int, remaining: Callable[[], float]
) -> list[ShardRecord]:
    """Every ps task's shard of checkpoint ``step``: held at one cut, then saved (as a chief's
    save, ``PsClient.save``); without the cut if it is lost (a worker lost mid-step). ``remaining``:
    the seconds left for each call."""
    requests = [pb.SaveShardRequest(caller=caller, checkpoint_dir=checkpoint_dir, step=step) for _ in every]
    replies = one_cut.at_one_cut(
        every,
        caller,
        "SaveShard",
        requests,
        remaining,
        hold_seconds=min(remaining(), MAX_HOLD_S),
        lost=f"checkpoint step {step} is saved without one cut across the ps tasks",
    )
    return [
        ShardRecord(ps_task=k, file=r.file, sha256=r.sha256, nbytes=r.nbytes, global_step=r.global_step)
        for k, r in enumerate(replies)
    ]

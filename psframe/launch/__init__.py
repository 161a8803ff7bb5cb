"""Start a whole psframe cluster on this machine (``psframe launch``).

:func:`launch` picks free loopback ports, starts one child process per task
with the flags (and ``TF_CONFIG``) a hand-started task would get, prints the
cluster it started, prefixes every line a child prints with its task name,
and leaves the cluster's addresses and token where ``psframe status`` looks
(:mod:`psframe.launch.record`). When a task fails, ``on_failure`` decides
(:mod:`psframe.launch.policy`): stop the others (the default), start it
again, or go on without it; a broken cluster never hangs.

One launch goes through these states::

    STARTING -> RUNNING -> every child exited 0 (or was left out) ---------> return 0
                        -> a child failed -> restart it / leave it out -> RUNNING
                                          -> stop                -> STOPPING -> return its code
                        -> timeout expired                       -> STOPPING -> return 124
                        -> KeyboardInterrupt (Ctrl-C)            -> STOPPING -> return 130
                        -> SIGTERM to the launcher               -> STOPPING -> return 143

STOPPING sends SIGTERM to the workers still running, waits ``grace``
seconds, sends SIGKILL to those left, then does the same with the ps tasks,
and reaps them all (a psframe worker given SIGTERM finishes its step and
leaves, a ps task saves where it can: :mod:`psframe.config.stopping`). After
Ctrl-C, which a terminal sends to every task as well, the children first get
``grace`` seconds to stop on their own (a psframe task prints its one line and
exits 130; a script that catches ``KeyboardInterrupt`` may do its last work,
such as evaluating on the test set); a second Ctrl-C kills them at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TextIO

from psframe.cluster import ClusterSpec
from psframe.config.security import Security, generate_token
from psframe.errors import LaunchError, TaskStopped
from psframe.launch import record as launch_record
from psframe.launch.children import POLL_S, Child, Output, drain, exit_code, pick_free_ports, stop, wait_for_exit
from psframe.launch.policy import Action, FailurePolicy, OnFailure, on_failure_named

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
DEFAULT_GRACE = 30.0
"""Seconds a task gets to stop once asked, before SIGKILL (as Kubernetes' and torchrun's default)."""


@dataclass(frozen=True)
class TaskResult:
    """How one task ended: its exit status, or 128 + N if killed by signal N."""

    task_name: str
    job_name: str
    task_index: int
    returncode: int


def launch(
    script: str,
    num_ps: int,
    num_workers: int,
    script_args: Sequence[str] = (),
    *,
    python: str = sys.executable,
    host: str = "127.0.0.1",
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    grace: float = DEFAULT_GRACE,
    security: Security | None = None,
    on_failure: FailurePolicy | str = OnFailure.STOP,
) -> int:
    """Run ``script`` as a cluster of ``num_ps`` ps and ``num_workers`` worker tasks.

    Each child runs ``python script --ps_hosts=... --worker_hosts=...
    --job_name=ps|worker --task_index=i *script_args`` with ``TF_CONFIG`` set to
    the same cluster and task. The launch first prints the cluster
    (``"[launch] cluster: ps0=127.0.0.1:41234 worker0=..."``) and how to reach it;
    then every line a child prints (stdout and stderr) goes to ``out``
    prefixed with its task name, e.g. ``"[worker1] step 10"``. A summary line
    such as ``"[launch] done: ps0=0 worker0=0"`` ends the output.

    Every task gets the cluster's auth token in ``PSFRAME_AUTH_TOKEN`` (and
    the TLS files of ``security`` in ``PSFRAME_TLS_*``), which
    ``psframe.Server`` and ``psframe.Trainer`` read: the token of
    ``security`` if it has one, else a fresh random one made for this
    cluster alone (never printed). While the launch runs, the cluster and a
    file holding the token are kept where ``psframe status`` (and
    ``shutdown``, ``reshard``) given no cluster look (:mod:`psframe.launch.record`).

    Args:
        script: path of the Python script every task runs.
        num_ps: number of ps tasks (>= 1).
        num_workers: number of worker tasks (>= 1).
        script_args: extra arguments passed after the cluster flags, as given.
        python: interpreter that runs the children.
        host: loopback address the tasks listen on.
        timeout: seconds before every task is stopped; None waits for ever.
        env: variables added to this process's environment for the children.
            Without ``OMP_NUM_THREADS`` there, each task gets an equal share
            of this machine's cores as its number of compute threads.
        out: where the children's lines go; defaults to ``sys.stdout``.
        grace: seconds a task gets to stop once asked before it is killed
            (SIGKILL): after SIGTERM, and after Ctrl-C (a script that catches
            ``KeyboardInterrupt`` has this long for its last work, then
            SIGTERM and ``grace`` more). 30 by default.
        security: the token and TLS files for every task; None: the
            ``PSFRAME_*`` variables of the environment (and ``env``).
        on_failure: what follows a task's failure, a
            :class:`~psframe.launch.policy.FailurePolicy` or its name:
            ``"stop"`` (the default), ``"restart"`` (up to 3 times per task)
            or ``"continue"`` (:mod:`psframe.launch.policy`).

    Returns:
        0 when every task exited 0 (or failed and was left out, or restarted
        and then exited 0); else the exit code of the task whose failure
        stopped the job (128 + N if it was killed by signal N); 124 on
        timeout; 130 on KeyboardInterrupt; 143 when the launcher got SIGTERM.

    Raises:
        LaunchError: a count is < 1, ``script`` is not a file, or another argument is bad.
        OSError: a child could not be started (those already started are stopped).

    Example::

        code = launch("examples/mlp_mnist_dist.py", 2, 2, ["--train_steps", "2000"], on_failure="restart")
    """
    _check_args(script, num_ps, num_workers, script_args, timeout, grace)
    policy = on_failure if isinstance(on_failure, FailurePolicy) else FailurePolicy(on_failure_named(on_failure))
    output = Output(sys.stdout if out is None else out)
    ports = pick_free_ports(num_ps + num_workers, host)
    addr = f"[{host}]:{{}}" if ":" in host else f"{host}:{{}}"
    cluster = {"ps": [addr.format(p) for p in ports[:num_ps]], "worker": [addr.format(p) for p in ports[num_ps:]]}
    flags = [f"--{job}_hosts={','.join(cluster[job])}" for job in ("ps", "worker")]
    base_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if security is None:
        security = Security.resolve(environ=base_env)
    if security.auth_token is None:
        security = dataclasses.replace(security, auth_token=generate_token())
        output.log("made a fresh auth token for this cluster; every task gets it in PSFRAME_AUTH_TOKEN")
    base_env = security.child_environment(base_env)
    if "OMP_NUM_THREADS" not in base_env:
        # Every task's torch would otherwise start a compute thread per core:
        # N tasks on one machine then fight over the cores (as torchrun, share them).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        base_env["OMP_NUM_THREADS"] = str(max(1, cores // (num_ps + num_workers)))
        output.log(
            f"OMP_NUM_THREADS is not set: each of the {num_ps + num_workers} tasks gets "
            f"{base_env['OMP_NUM_THREADS']} compute thread(s) of the {cores} cores; set it to choose"
        )
    spec = ClusterSpec(cluster)
    kept = _announce(spec, script, security, base_env, output)
    deadline = None if timeout is None else time.monotonic() + timeout
    children: list[Child] = []
    interrupted = False
    try:
        with _SigtermRaises() as sigterm:
            try:
                for job_name, count in (("ps", num_ps), ("worker", num_workers)):
                    for index in range(count):
                        task_env = {
                            **base_env,
                            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job_name, "index": index}}),
                        }
                        argv = [python, script, *flags, f"--job_name={job_name}", f"--task_index={index}"]
                        children.append(Child(job_name, index, [*argv, *script_args], task_env, output))
                code = _supervise(children, policy, deadline, timeout, output)
            except KeyboardInterrupt:
                output.log(
                    f"interrupted; every task has {grace:g}s (--grace) to stop on its own; Ctrl-C again stops them now"
                )
                code, interrupted = EXIT_INTERRUPTED, True
            except TaskStopped:  # SIGTERM to the launcher (_SigtermRaises)
                output.log("got SIGTERM; stopping every task")
                code = EXIT_TERMINATED
            finally:
                sigterm.ignore()  # stopping: another SIGTERM waits for it (each step bounded by the grace)
                again = interrupted and _wait_after_interrupt(children, grace)
                stop(children, 0.0 if again else grace)
    finally:
        if kept is not None:
            launch_record.remove(kept, base_env)
    drain(children)
    output.log("done: " + " ".join(c.summary() for c in children))
    return code


def _supervise(
    children: list[Child], policy: FailurePolicy, deadline: float | None, timeout: float | None, output: Output
) -> int:
    """Watch the children until every one has exited 0 or been left out (0), one failure stops the
    job (its code), or the timeout runs out (124); restart or leave out the failed ones as ``policy`` says."""
    done: set[int] = set()  # the children that exited 0, or failed and were left out
    while True:
        for k, c in enumerate(children):
            if k in done or c.running():
                continue
            if c.proc.returncode == 0:
                done.add(k)
                continue
            over = any(o.job_name == "ps" and not o.running() and o.proc.returncode == 0 for o in children)
            action, why = policy.decide(c.job_name, c.task_index, c.restarts, over)
            output.log(f"{c.name} {c.how_it_ended()}; {why}")
            if action is Action.STOP:
                return exit_code(c.proc.returncode)
            if action is Action.RESTART:
                c.restart()
            else:
                c.left_out = True
                done.add(k)
        if len(done) == len(children):
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            running = " ".join(c.name for c in children if c.running())
            output.log(f"timeout after {timeout:g}s; still running: {running}; stopping them")
            return EXIT_TIMEOUT
        time.sleep(POLL_S)


def _announce(
    cluster: ClusterSpec, script: str, security: Security, env: Mapping[str, str], output: Output
) -> launch_record.LaunchRecord | None:
    """Print the cluster, and keep it (and its token) where ``psframe status`` looks; the record, if kept."""
    tasks = [f"{job}{k}={address}" for job in ("ps", "worker") for k, address in enumerate(cluster.job_tasks(job))]
    output.log("cluster: " + " ".join(tasks))
    try:
        kept = launch_record.write(cluster, script, security, env)
    except OSError as e:
        output.log(
            f"could not keep the cluster for psframe status in {launch_record.folder(env)} ({e}); "
            f"give it --cluster_spec='{cluster.to_string()}'"
        )
        return None
    token = f" --auth_token_file={kept.auth_token_file}" if kept.auth_token_file else ""
    output.log(
        f"psframe status (shutdown, reshard) on this machine finds this cluster; elsewhere give it "
        f"--cluster_spec='{cluster.to_string()}'{token}"
    )
    return kept


def _wait_after_interrupt(children: Sequence[Child], grace: float) -> bool:
    """After Ctrl-C: wait up to ``grace`` seconds for every child to stop; True on a second Ctrl-C."""
    try:
        wait_for_exit(children, grace)
    except KeyboardInterrupt:
        return True
    return False


class _SigtermRaises:
    """SIGTERM raises :class:`~psframe.errors.TaskStopped` (143) in the main thread while the block runs,
    where SIGTERM has its default action (elsewhere nothing changes: a launch from another thread, or a
    program's own handler)."""

    def __enter__(self) -> _SigtermRaises:
        self._installed = (
            threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        )
        if self._installed:
            signal.signal(signal.SIGTERM, self._raise)
        return self

    def ignore(self) -> None:
        """From now on until the block ends, SIGTERM does nothing (the launch is stopping its tasks)."""
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    @staticmethod
    def _raise(signum: int, frame: FrameType | None) -> None:
        raise TaskStopped(EXIT_TERMINATED)


def _check_args(
    script: str, num_ps: int, num_workers: int, script_args: Sequence[str], timeout: float | None, grace: float
) -> None:
    for name, value in (("num_ps", num_ps), ("num_workers", num_workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LaunchError(f"{name} must be an int >= 1, got {value!r}")
    if not os.path.isfile(script):
        raise LaunchError(f"script {script!r} is not a file (looked in {os.getcwd()!r})")
    if isinstance(script_args, str) or not all(isinstance(a, str) for a in script_args):
        raise LaunchError(f"script_args must be a sequence of str, got {script_args!r}")
    if timeout is not None and not timeout > 0:
        raise LaunchError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    if not grace >= 0:
        raise LaunchError(f"grace must be >= 0 seconds, got {grace!r}")


__all__ = ["DEFAULT_GRACE", "FailurePolicy", "LaunchError", "OnFailure", "TaskResult", "launch", "pick_free_ports"]

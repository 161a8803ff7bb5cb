"""Start a psframe cluster as Ray actors: ``psframe.ray.run(main_fun, args, num_ps=, num_workers=)``.

Every ps and worker task is one Ray actor. The actors are placed through one
placement group (``SPREAD`` by default, so that ps tasks land on different
nodes where the cluster has them); each reserves a free port on its node, the
driver gathers every ``host:port``, builds the :class:`~psframe.ClusterSpec`
and calls ``main_fun(args, ctx)`` in every actor, with ``ctx.cluster``,
``ctx.job_name`` and ``ctx.task_index``. What the chief (worker 0) returns is
what :func:`run` returns::

    import psframe, psframe.ray

    def main_fun(args, ctx):
        if ctx.job_name == "ps":
            psframe.Server(ctx.cluster, "ps", ctx.task_index).join()  # returns once every worker finished
            return None
        trainer = psframe.Trainer(build_model(), ctx.cluster, task_index=ctx.task_index, ...)
        with trainer:
            ...
        return {"global_step": trainer.global_step} if ctx.is_chief else None

    result = psframe.ray.run(main_fun, args, num_ps=2, num_workers=4,
                             resources_per_worker={"CPU": 2, "GPU": 1})

One run goes through these states::

    PLACING --(placement group ready)--> STARTING --(every address gathered)--> RUNNING
    RUNNING --(every task returned)------------------------------------------> return the chief's result
    RUNNING --(workers all returned, a ps task still running after ps_grace)--> return it (ps killed, logged)
    any state --(a task raised / its actor died / a deadline passed)---------> RayRunError

Whatever the outcome, every actor is killed and the placement group removed
before :func:`run` returns or raises; no wait is unbounded (``startup_timeout``
covers PLACING and STARTING, ``timeout`` RUNNING).

Needs the ``ray`` extra: ``pip install psframe[ray]``.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from psframe.cluster import ClusterSpec
from psframe.errors import RayConfigError, RayRunError
from psframe.memory import malloc

log = logging.getLogger("psframe.ray")

STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
_POLL_S = 1.0


@dataclass(frozen=True)
class TaskContext:
    """What ``main_fun(args, ctx)`` learns about its task.

    Attributes:
        cluster: the whole cluster, every task's ``host:port``.
        job_name: ``"ps"`` or ``"worker"``.
        task_index: this task's index in its job.
    """

    cluster: ClusterSpec
    job_name: str
    task_index: int

    @property
    def is_chief(self) -> bool:
        """True for worker 0, whose return value :func:`run` returns."""
        return self.job_name == "worker" and self.task_index == 0

    @property
    def address(self) -> str:
        """This task's ``host:port`` (a ps task listens there)."""
        return self.cluster.task_address(self.job_name, self.task_index)


class _TaskActor:
    """One task: holds a free port until the cluster is known, then runs ``main_fun``."""

    def __init__(self, job_name: str, task_index: int) -> None:
        self.job_name = job_name
        self.task_index = task_index
        self._socket: socket.socket | None = None

    def __repr__(self) -> str:  # Ray prefixes the actor's output with it
        return f"psframe {self.job_name}{self.task_index}"

    def reserve(self, host: str | None) -> str:
        import ray

        host = host or ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.bind((host, 0))  # held until run(), so that tasks on one node get distinct ports
        port = self._socket.getsockname()[1]
        return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"

    def run(self, main_fun: Callable[[Any, TaskContext], Any], args: Any, cluster_spec: str) -> Any:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        ctx = TaskContext(ClusterSpec.from_string(cluster_spec), self.job_name, self.task_index)
        # The actor's process is this task's alone: tuned as `psframe server` tunes its own.
        malloc.tune_malloc()
        return main_fun(args, ctx)


def run(
    main_fun: Callable[[Any, TaskContext], Any],
    args: Any = None,
    *,
    num_ps: int = 1,
    num_workers: int = 2,
    resources_per_worker: Mapping[str, float] | None = None,
    resources_per_ps: Mapping[str, float] | None = None,
    placement_strategy: str = "SPREAD",
    host: str | None = None,
    runtime_env: Mapping[str, Any] | None = None,
    startup_timeout: float = 120.0,
    timeout: float | None = None,
    ps_grace: float = 60.0,
) -> Any:
    """Runs ``main_fun(args, ctx)`` in one Ray actor per ps and worker task; returns the chief's result.

    Connects to Ray first if this process has not (``ray.init()``: the
    cluster in ``RAY_ADDRESS``, else a local one). ``main_fun`` and ``args``
    travel to the actors through Ray (cloudpickle), so ``main_fun`` must be
    importable there or defined by value (a function of the driver's
    ``__main__``), with psframe installed on every node.

    Args:
        main_fun: called as ``main_fun(args, ctx)`` in every task, ``ctx`` a
            :class:`TaskContext`; a ps task should serve until training is over
            (``psframe.Server(ctx.cluster, "ps", ctx.task_index).join()``).
        args: passed to ``main_fun`` as is (an ``argparse.Namespace``, a dict...).
        num_ps: ps tasks (>= 1).
        num_workers: worker tasks (>= 1); worker 0 is the chief.
        resources_per_worker: Ray resources of one worker's actor and bundle,
            e.g. ``{"CPU": 2, "GPU": 1}`` (``"memory"`` in bytes, other keys
            custom resources); default ``{"CPU": 1}``.
        resources_per_ps: the same for a ps task; default ``{"CPU": 1}``.
        placement_strategy: the placement group's strategy, one of
            ``SPREAD`` (default: tasks on as many nodes as there are),
            ``STRICT_SPREAD``, ``PACK``, ``STRICT_PACK``.
        host: the address every task advertises and a ps task listens on;
            None takes the node's IP as Ray knows it. ``"127.0.0.1"`` suits a
            one-node Ray.
        runtime_env: Ray runtime environment of the actors (``env_vars``,
            ``working_dir``, ``py_modules``...).
        startup_timeout: seconds to place the actors and gather their addresses.
        timeout: seconds the tasks may run; None: no limit (failures still
            end the run at once).
        ps_grace: seconds ps tasks may run on once every worker returned,
            before they are stopped (they end on their own once every worker
            has finished training).

    Returns:
        What ``main_fun`` returned in worker 0.

    Raises:
        RayConfigError: a bad count, resource, strategy or timeout.
        RayRunError: the placement group could not be placed or an actor not
            started within ``startup_timeout``; a task raised (the message
            names it and its error, chained); a task's actor died (killed, out
            of memory, node lost); ``timeout`` ran out. Every actor is stopped
            first.
        ImportError: Ray is not installed.
    """
    ps_res = _check_resources("resources_per_ps", resources_per_ps)
    worker_res = _check_resources("resources_per_worker", resources_per_worker)
    for name, value in (("num_ps", num_ps), ("num_workers", num_workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RayConfigError(f"{name} must be an int >= 1, got {value!r}")
    if placement_strategy not in STRATEGIES:
        raise RayConfigError(f"placement_strategy must be one of {list(STRATEGIES)}, got {placement_strategy!r}")
    for name, seconds in (("startup_timeout", startup_timeout), ("timeout", timeout), ("ps_grace", ps_grace)):
        if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
            raise RayConfigError(f"{name} must be a number of seconds > 0, got {seconds!r}")
    ray = _import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init()
    tasks = [("ps", i) for i in range(num_ps)] + [("worker", i) for i in range(num_workers)]
    bundles = [dict(ps_res)] * num_ps + [dict(worker_res)] * num_workers
    actor_class = ray.remote(_TaskActor)
    group = placement_group(bundles, strategy=placement_strategy)
    actors: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + startup_timeout
        _wait_placed(ray, group, bundles, placement_strategy, startup_timeout)
        for bundle_index, (job_name, task_index) in enumerate(tasks):
            options = _actor_options(bundles[bundle_index])
            if runtime_env is not None:
                options["runtime_env"] = dict(runtime_env)
            actors[ClusterSpec.task_name(job_name, task_index)] = actor_class.options(
                **options,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle_index
                ),
            ).remote(job_name, task_index)
        addresses = _wait_all(
            ray, {actor.reserve.remote(host): name for name, actor in actors.items()}, deadline=deadline, what="start"
        )
        cluster = ClusterSpec(
            {
                job: [addresses[ClusterSpec.task_name(job, i)] for i in range(n)]
                for job, n in (("ps", num_ps), ("worker", num_workers))
            }
        )
        log.info("psframe cluster on Ray: %s", cluster.to_string())
        # Pickled once, into the object store; each actor gets the values (Ray resolves top-level refs).
        fun_ref, args_ref, spec = ray.put(main_fun), ray.put(args), cluster.to_string()
        calls = {actor.run.remote(fun_ref, args_ref, spec): name for name, actor in actors.items()}
        results = _wait_all(
            ray,
            calls,
            deadline=None if timeout is None else time.monotonic() + timeout,
            what="finish",
            ps_grace=ps_grace,
        )
        return results[ClusterSpec.task_name("worker", 0)]
    finally:
        for actor in actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                log.debug("could not kill %s", actor, exc_info=True)
        try:
            remove_placement_group(group)
        except Exception:
            log.debug("placement group already removed", exc_info=True)


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("psframe.ray needs Ray: pip install 'psframe[ray]'") from e
    return ray


def _check_resources(name: str, resources: Mapping[str, float] | None) -> dict[str, float]:
    if resources is None:
        return {"CPU": 1.0}
    if not isinstance(resources, Mapping) or not resources:
        raise RayConfigError(f"{name} must be a non-empty mapping such as {{'CPU': 1}}, got {resources!r}")
    for key, value in resources.items():
        if (
            not isinstance(key, str)
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < 0
            or not math.isfinite(value)
        ):
            raise RayConfigError(f"{name}[{key!r}] must be a number >= 0, got {value!r}")
    if not any(value > 0 for value in resources.values()):
        raise RayConfigError(f"{name} must ask for some resource (a Ray bundle cannot be empty), got {resources!r}")
    return {key: float(value) for key, value in resources.items()}


def _actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray's actor options for one bundle's resources (``CPU``/``GPU``/``memory`` have their own)."""
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0)}
    if "memory" in resources:
        options["memory"] = resources["memory"]
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    return options


def _wait_placed(ray, group, bundles, strategy: str, timeout: float) -> None:
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise RayRunError(
            f"Ray could not place {len(bundles)} tasks ({strategy}, bundles {bundles}) within {timeout:g} s; "
            f"the cluster has {ray.available_resources()} available of {ray.cluster_resources()}"
        ) from e


def _wait_all(
    ray, calls: dict[Any, str], *, deadline: float | None, what: str, ps_grace: float | None = None
) -> dict[str, Any]:
    """Waits for every call (object ref -> task name); raises on the first that fails.

    With ``ps_grace``, ps tasks still running that long after the last worker
    returned are left (the caller kills them) with a warning.
    """
    pending = dict(calls)
    results: dict[str, Any] = {}
    workers_done_at: float | None = None
    while pending:
        now = time.monotonic()
        if (
            workers_done_at is None
            and ps_grace is not None
            and not any(name.startswith("/job:worker/") for name in pending.values())
        ):
            workers_done_at = now
        if workers_done_at is not None and ps_grace is not None and now - workers_done_at >= ps_grace:
            log.warning(
                "%s still running %g s after every worker returned; stopping them",
                ", ".join(sorted(pending.values())),
                ps_grace,
            )
            break
        wait_s = _POLL_S
        if deadline is not None:
            if now >= deadline:
                raise RayRunError(
                    f"{', '.join(sorted(pending.values()))} did not {what} before the deadline; stopping every task"
                )
            wait_s = min(wait_s, deadline - now)
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
        for ref in ready:
            name = pending.pop(ref)
            try:
                results[name] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise RayRunError(f"{name} failed: {type(cause).__name__}: {cause}; stopping every task") from e
            except ray.exceptions.RayActorError as e:
                raise RayRunError(
                    f"{name}'s Ray actor died before it could {what} ({type(e).__name__}: "
                    f"{_first_line(e)}); stopping every task"
                ) from e
            except ray.exceptions.RayError as e:  # e.g. its runtime_env could not be set up
                raise RayRunError(
                    f"Ray could not run {name} ({type(e).__name__}: {_first_line(e)}); stopping every task"
                ) from e
    return results


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)


__all__ = ["RayConfigError", "RayRunError", "TaskContext", "run"]

"""Where ``psframe launch`` leaves what ``psframe status`` needs: the cluster it started, and its token.

While it runs, a launch keeps two files named after its process id in a
folder only its user may enter (:func:`folder`: ``$PSFRAME_LAUNCH_DIR``, else
``$XDG_RUNTIME_DIR/psframe/launched``, else ``~/.cache/psframe/launched``):

- ``PID.json``: the cluster's addresses, the script, the folder it was
  started from, and the TLS files the tasks were given, if any;
- ``PID.token``: the cluster's auth token (mode 600), the file
  ``--auth_token_file`` takes.

Both go when the launch ends. ``psframe status``, ``psframe shutdown`` and
``psframe reshard`` given no cluster (no flag, no ``TF_CONFIG``) take the
newest launch of that folder still running (:func:`find`); the records of a
launch that died are removed as they are found.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from psframe.cluster import ClusterSpec
from psframe.config.security import Security

LAUNCH_DIR_ENV = "PSFRAME_LAUNCH_DIR"


@dataclass(frozen=True)
class LaunchRecord:
    """One running launch, as its record says."""

    pid: int
    started: float  # time.time()
    process_start: str  # the launcher's start time as the kernel counts it ("" where unknown): a reused PID differs
    script: str
    cwd: str
    cluster_spec: str  # ClusterSpec.to_string()
    auth_token_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_ca_file: str | None

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec.from_string(self.cluster_spec)


def folder(environ: Mapping[str, str] | None = None) -> Path:
    """The folder of launch records (see the module); not made here."""
    env = os.environ if environ is None else environ
    if env.get(LAUNCH_DIR_ENV):
        return Path(env[LAUNCH_DIR_ENV])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "psframe" / "launched"
    try:
        return Path.home() / ".cache" / "psframe" / "launched"
    except RuntimeError:  # no home folder to be found: a folder of this user's in the temporary directory
        return Path(tempfile.gettempdir()) / f"psframe-{os.getuid()}" / "launched"


def write(
    cluster: ClusterSpec, script: str, security: Security, environ: Mapping[str, str] | None = None
) -> LaunchRecord:
    """Write this process's launch record (and its token file) in :func:`folder`.

    Raises:
        OSError: the folder cannot be made or written.
    """
    where = folder(environ)
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    pid = os.getpid()
    token_file = None
    if security.auth_token is not None:
        token_file = str(where / f"{pid}.token")
        _write_private(Path(token_file), security.auth_token + "\n")
    record = LaunchRecord(
        pid=pid,
        started=time.time(),
        process_start=_process_start(pid),
        script=os.path.abspath(script),
        cwd=os.getcwd(),
        cluster_spec=cluster.to_string(),
        auth_token_file=token_file,
        tls_cert_file=_absolute(security.tls_cert_file),
        tls_key_file=_absolute(security.tls_key_file),
        tls_ca_file=_absolute(security.tls_ca_file),
    )
    _write_private(where / f"{pid}.json", json.dumps(asdict(record), indent=1) + "\n")
    return record


def remove(record: LaunchRecord, environ: Mapping[str, str] | None = None) -> None:
    """Remove a launch's record and token file (those already gone are fine)."""
    where = folder(environ)
    for name in (f"{record.pid}.json", f"{record.pid}.token"):
        with contextlib.suppress(FileNotFoundError):
            (where / name).unlink()


def find(environ: Mapping[str, str] | None = None) -> tuple[LaunchRecord | None, int]:
    """The newest launch of :func:`folder` still running, and how many others run.

    Records of launches that are gone are removed; unreadable ones are skipped.
    """
    where = folder(environ)
    running: list[LaunchRecord] = []
    for path in sorted(where.glob("*.json")) if where.is_dir() else []:
        try:
            record = LaunchRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if _alive(record):
            running.append(record)
        else:
            remove(record, environ)
    running.sort(key=lambda r: r.started)
    return (running[-1] if running else None), max(0, len(running) - 1)


def _alive(record: LaunchRecord) -> bool:
    try:
        os.kill(record.pid, 0)  # signal 0: is there such a process (nothing is sent)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process under a reused PID
    return record.process_start == _process_start(record.pid)


def _process_start(pid: int) -> str:
    """When ``pid`` started, in clock ticks since boot (Linux's /proc); "" where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]  # field 22, counted after the command's name


def _absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only, whole (a reader never sees half)."""
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(text)
    os.replace(partial, path)

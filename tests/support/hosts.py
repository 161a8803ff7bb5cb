"""Test hosts: Linux network namespaces on one bridge, for tests that need several machines.

A :class:`HostSet` makes one network namespace per host name and a bridge in
a namespace of its own; each host has a veth ``eth0`` with an address on a
private /24, wired to a port ``vb-<name>`` of the bridge. Every veth is made
inside the bridge's namespace with its peer moved straight into the host's,
so the machine's own namespace never sees an interface or an address of a
run. Each host also has a ``/dev/shm`` of its own, shared by all the
processes started on that host and by no one else, so that tasks on
different hosts meet only through the network, as on separate machines.

Tasks run with :meth:`HostSet.popen` (their PID is the Popen's), links are
capped (``tc`` tbf both ways), cut (the host loses carrier) or black-holed
(carrier stays up, the switch drops the frames) and healed by host name.

Making hosts needs root (the suite and CI run as root). Tests get them through
the ``host_set`` fixture, a factory closed at the test's end; a test module
imports it by name so that pytest finds it::

    from tests.support.hosts import host_set  # noqa: F401  (a fixture, found by name)

    pytestmark = pytest.mark.hosts

    def test_something(host_set):
        hosts = host_set(["ps0", "w0"])
        server = hosts.popen("ps0", [sys.executable, "-m", "my.server"])
        hosts.run("w0", ["ss", "-tn"], timeout=5)
        hosts.cut("ps0")
        hosts.heal("ps0")

(An import in a test module keeps the fixture where it is used; one line in
``tests/conftest.py`` would make it every module's.) The fixture skips, with
the reason, where hosts cannot be made -- not root, a tool missing, ``ip netns
add`` refused -- and fails instead when ``CI=true``: there, hosts must work.

Names: every namespace of a run is ``psft<pid>.<seq>-<host>`` (the bridge's
``-br``), ``<pid>`` the process that made it. A killed run leaves its
namespaces behind; the next :class:`HostSet` deletes those whose process is
gone (and kills what still runs in them) before it makes its own.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

PREFIX = "psft"
BRIDGE = "br"  # the bridge namespace's suffix, so not a host name
NETNS_DIR = "/run/netns"  # where ``ip netns`` keeps its names
SUBNET = "10.213"  # hosts get 10.213.<run's byte>.<1..>/24
SHM_SOURCE = "psframe-shm"  # the name of each host's /dev/shm tmpfs in mount tables

# A host's name ends up in the interface name "vb-<name>": 15 characters at most.
_HOST_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,11}")
_RUN_NAME = re.compile(rf"{PREFIX}(\d+)\.(\d+)-")
_TOOLS = ("ip", "tc", "bridge", "nsenter", "mount", "sh")
_COMMAND_TIMEOUT = 10.0  # s, for one ip/tc/bridge command
_KILL_WAIT = 5.0  # s, for a killed process to be reaped
_sequence = itertools.count()


class HostsError(RuntimeError):
    """A command that makes, changes or removes test hosts failed; the message has its stderr."""


class HostSet:
    """Hosts made of network namespaces on one bridge; a context manager.

    Args:
        names: the hosts' names: lowercase letters, digits, ``_`` and ``-``,
            at most 12 characters, not ``br``, no repeats.
        shm_size: the size limit of each host's ``/dev/shm`` (a tmpfs: memory
            is used only as files fill it), in ``mount``'s notation.

    Attributes:
        names: the hosts' names, in the order given (addresses ``.1``, ``.2``, ...).
        run_id: ``psft<pid>.<seq>``, the start of every namespace name of this set.
        bridge_netns: the bridge's namespace (ports ``vb-<name>`` on ``br0``).

    Raises:
        ValueError: a bad or repeated name.
        HostsError: an ``ip`` command failed (not root, no netns support);
            what was made by then is removed.

    Example::

        with HostSet(["ps0", "w0"]) as hosts:
            hosts.popen("ps0", [sys.executable, "server.py", "--port=7000"])
            hosts.run("w0", ["python3", "client.py", hosts.address("ps0")], timeout=30)
    """

    def __init__(self, names: Sequence[str], *, shm_size: str = "1g") -> None:
        names = list(names)
        for name in names:
            if not _HOST_NAME.fullmatch(name) or name == BRIDGE:
                raise ValueError(f"host name {name!r} must match {_HOST_NAME.pattern} and not be {BRIDGE!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")
        if not 1 <= len(names) <= 250:
            raise ValueError(f"{len(names)} hosts: 1 to 250 fit one /24")
        seq = next(_sequence)
        self.run_id = f"{PREFIX}{os.getpid()}.{seq}"
        self.names = tuple(names)
        self.bridge_netns = f"{self.run_id}-{BRIDGE}"
        # Runs are in namespaces of their own, so subnets may repeat across runs;
        # varying it only makes captures of two runs easier to tell apart.
        third = (os.getpid() + seq) % 254 + 1
        self._addresses = {name: f"{SUBNET}.{third}.{i + 1}" for i, name in enumerate(names)}
        self._holders: dict[str, subprocess.Popen] = {}
        self._tasks: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces, in the order made
        self._closed = False
        atexit.register(self.close)  # a backstop; close() unregisters it
        try:
            remove_stale_namespaces()
            self._make(shm_size)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> HostSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def netns(self, name: str) -> str:
        """The network namespace of host ``name`` (for ``ip -n``, ``tc -n``)."""
        self._check(name)
        return f"{self.run_id}-{name}"

    def address(self, name: str) -> str:
        """The IPv4 address of host ``name``'s ``eth0``, e.g. ``"10.213.7.2"``."""
        self._check(name)
        return self._addresses[name]

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Starts ``argv`` on host ``name``; :meth:`close` kills it if it still runs.

        The process runs in the host's network namespace and sees the host's
        ``/dev/shm``; it inherits this process's environment (or ``env=``) and
        working directory (or ``cwd=``). It is ``argv`` itself, not a wrapper:
        its PID is the Popen's ``pid``.

        Args:
            name: the host.
            argv: the command and its arguments.
            **kwargs: passed to :class:`subprocess.Popen` (stdout, env, cwd, ...).
        """
        popen = subprocess.Popen(self._enter(name, argv, kwargs), **kwargs)
        self._tasks.append(popen)
        return popen

    def run(self, name: str, argv: Sequence[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
        """Runs a short command on host ``name`` to its end; output captured as text.

        Args:
            name: the host.
            argv: the command and its arguments, e.g. ``["ss", "-tn"]``.
            timeout: seconds; the command is killed then and
                :class:`subprocess.TimeoutExpired` raised.
            **kwargs: passed to :func:`subprocess.run` (``check=True``, ...).
        """
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self._enter(name, argv, kwargs), timeout=timeout, **kwargs)

    def cap(self, name: str, rate_mbit: float) -> None:
        """Limits host ``name``'s link to ``rate_mbit`` Mbit/s each way (tc tbf; again: replaces).

        One tbf on the host's ``eth0`` (what the host sends) and one on its
        bridge port (what it receives). The bucket (``burst``) holds at least
        one timer tick's worth of bytes at the rate (HZ is 250 or more), else
        the rate could not be reached, and 32 KiB at least (tbf splits larger
        segmentation-offload packets). ``latency 50ms`` queues up to 50 ms of
        data at the rate before dropping, a small switch's buffer: more would
        add delay to every request behind a bulk transfer.
        """
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit ({rate_mbit}) must be > 0")
        rate_bit = int(rate_mbit * 1e6)
        burst = max(32 * 1024, rate_bit // 8 // 250)
        tbf = ["root", "tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency", "50ms"]
        for netns, dev in self._link_ends(name):
            _command(["tc", "-n", netns, "qdisc", "replace", "dev", dev, *tbf])

    def uncap(self, name: str) -> None:
        """Removes :meth:`cap`'s limits from host ``name``'s link (none there: nothing to do)."""
        for netns, dev in self._link_ends(name):
            shown = _command(["tc", "-n", netns, "qdisc", "show", "dev", dev, "root"])
            if "qdisc tbf" in shown:
                _command(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"])

    def cut(self, name: str) -> None:
        """Takes host ``name``'s bridge port down: the host loses carrier, both sides can tell."""
        self._check(name)
        _command(["ip", "-n", self.bridge_netns, "link", "set", f"vb-{name}", "down"])

    def black_hole(self, name: str) -> None:
        """Drops every frame to and from host ``name`` at the bridge; its carrier stays up.

        Neither side's kernel learns anything: connections just go silent, as
        behind a failed switch or a partition further away. A cut link comes
        back up first (the kernel refuses to set a down port's state).
        """
        self._check(name)
        port = f"vb-{name}"
        _command(["ip", "-n", self.bridge_netns, "link", "set", port, "up"])
        _command(["bridge", "-n", self.bridge_netns, "link", "set", "dev", port, "state", "0"])

    def heal(self, name: str) -> None:
        """Undoes :meth:`cut` or :meth:`black_hole` of host ``name``; returns once frames pass."""
        self._check(name)
        port = f"vb-{name}"
        _command(["ip", "-n", self.bridge_netns, "link", "set", port, "up"])
        # Forwarding (3); a port that just came up is there already.
        _command(["bridge", "-n", self.bridge_netns, "link", "set", "dev", port, "state", "3"])
        netns = self.netns(name)

        def passing() -> bool:
            port_state = _command(["bridge", "-n", self.bridge_netns, "link", "show", "dev", port])
            carrier = _command(["ip", "-n", netns, "-o", "link", "show", "eth0"])
            return "state forwarding" in port_state and "LOWER_UP" in carrier

        _wait_until(passing, 5.0, f"{name}'s link to pass frames after heal")

    def close(self) -> None:
        """Kills the processes started here that still run, then removes the run's namespaces.

        Processes started by those (still in a namespace of the run) are
        killed too. Removing the bridge's namespace removes every veth. A
        second call does nothing.

        Raises:
            HostsError: a process outlived SIGKILL or a namespace stayed (all
                the rest is removed first).
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        errors: list[str] = []
        started = self._tasks + list(self._holders.values())
        for popen in started:
            if popen.poll() is None:
                popen.kill()  # by PID: a child not yet reaped cannot have a reused PID
        for popen in started:
            try:
                # The holders' stderr is ours to close; the tasks' pipes are the caller's.
                if popen in self._tasks:
                    popen.wait(timeout=_KILL_WAIT)
                else:
                    popen.communicate(timeout=_KILL_WAIT)
            except subprocess.TimeoutExpired:
                errors.append(f"pid {popen.pid} ({shlex.join(popen.args)}) outlived SIGKILL")
        # Hosts first: the bridge's namespace holds the veths they are wired to.
        for netns in [n for n in self._made if n != self.bridge_netns] + [self.bridge_netns]:
            try:
                _remove_namespace(netns)
            except HostsError as e:
                errors.append(str(e))
        if errors:
            raise HostsError(f"closing {self.run_id}: " + "; ".join(errors))

    # -- private -------------------------------------------------------------

    def _make(self, shm_size: str) -> None:
        bridge = self.bridge_netns
        self._add_namespace(bridge)
        _command(["ip", "-n", bridge, "link", "add", "br0", "type", "bridge"])
        _command(["ip", "-n", bridge, "link", "set", "br0", "up"])
        for name in self.names:
            netns, port = self.netns(name), f"vb-{name}"
            self._add_namespace(netns)
            _command(["ip", "-n", netns, "link", "set", "lo", "up"])
            # Made in the bridge's namespace, the peer moved at birth: the
            # machine's own namespace never has either end.
            _command(
                ["ip", "-n", bridge, "link", "add", port, "type", "veth"] + ["peer", "name", "eth0", "netns", netns]
            )
            _command(["ip", "-n", bridge, "link", "set", port, "master", "br0"])
            _command(["ip", "-n", bridge, "link", "set", port, "up"])
            address = f"{self._addresses[name]}/24"
            _command(["ip", "-n", netns, "addr", "add", address, "dev", "eth0"])
            _command(["ip", "-n", netns, "link", "set", "eth0", "up"])
            self._holders[name] = _start_holder(netns, shm_size)

    def _add_namespace(self, netns: str) -> None:
        _command(["ip", "netns", "add", netns])
        self._made.append(netns)

    def _check(self, name: str) -> None:
        if name not in self._addresses:
            raise KeyError(f"no host {name!r} in {self.run_id}: hosts are {list(self.names)}")

    def _link_ends(self, name: str) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of host ``name``'s link."""
        return [(self.netns(name), "eth0"), (self.bridge_netns, f"vb-{name}")]

    def _enter(self, name: str, argv: Sequence[str], kwargs: dict[str, Any]) -> list[str]:
        """The command line that runs ``argv`` on host ``name``; takes ``cwd`` out of ``kwargs``."""
        self._check(name)
        if self._closed:
            raise HostsError(f"{self.run_id} is closed")
        holder = self._holders[name]
        # The holder is our child: while poll() has not reaped it, its PID
        # cannot name another process, so nsenter enters its namespace or fails.
        if holder.poll() is not None:
            raise HostsError(f"host {name}'s /dev/shm holder exited ({holder.returncode})")
        # Entering a mount namespace moves to its root directory: carry the
        # working directory over explicitly.
        cwd = os.path.abspath(kwargs.pop("cwd", None) or os.getcwd())
        return [
            "nsenter",
            f"--net={NETNS_DIR}/{self.netns(name)}",
            f"--mount=/proc/{holder.pid}/ns/mnt",
            f"--wd={cwd}",
            "--",
            *map(os.fspath, argv),
        ]


def _start_holder(netns: str, shm_size: str) -> subprocess.Popen:
    """A process that keeps host ``netns``'s mount namespace, with its own /dev/shm, alive.

    ``ip netns exec`` runs its command in a new mount namespace (a slave of
    the machine's: nothing mounted there shows outside). Every process of the
    host enters this one, so they share one /dev/shm and no one else does.
    The holder ends within a second of the process that made it, so a killed
    run leaves no holder behind.
    """
    script = (
        f'mount -t tmpfs -o size="$2",mode=1777 {SHM_SOURCE} /dev/shm || exit 1\n'
        # Its sleeps must not hold the stderr pipe open after a kill.
        "exec 2>/dev/null\n"
        'while kill -0 "$1"; do sleep 1; done\n'
    )
    holder = subprocess.Popen(
        ["ip", "netns", "exec", netns, "sh", "-c", script, "sh", str(os.getpid()), shm_size],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def mounted() -> bool:
        if holder.poll() is not None:
            _, err = holder.communicate(timeout=_KILL_WAIT)
            raise HostsError(f"/dev/shm for {netns}: exited {holder.returncode}: {err.strip()}")
        try:
            with open(f"/proc/{holder.pid}/mountinfo") as f:
                return f" - tmpfs {SHM_SOURCE} " in f.read()
        except OSError:  # not yet in its namespace, or exiting: asked again
            return False

    try:
        _wait_until(mounted, 5.0, f"/dev/shm of {netns} to be mounted")
    except BaseException:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=_KILL_WAIT)
        raise
    return holder


def remove_stale_namespaces() -> list[str]:
    """Deletes the namespaces of runs whose process is gone; returns their names.

    What still runs in them (children of the killed run) is killed first.
    Namespaces of live processes (this one's included) are left alone.
    """
    removed = []
    for netns in list_namespaces():
        match = _RUN_NAME.match(netns)
        if match and not _alive(int(match.group(1))):
            _remove_namespace(netns)
            removed.append(netns)
    return removed


def list_namespaces() -> list[str]:
    """The names ``ip netns list`` shows."""
    # Lines are "NAME" or "NAME (id: N)".
    lines = _command(["ip", "netns", "list"]).splitlines()
    return [line.split()[0] for line in lines if line.strip()]


def _remove_namespace(netns: str) -> None:
    if netns not in list_namespaces():
        return
    # A namespace lives on while a process is in it: end those first.
    for pid in _command(["ip", "netns", "pids", netns]).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        _command(["ip", "netns", "del", netns])
    except HostsError:
        if netns in list_namespaces():  # else a concurrent run removed it first
            raise


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) S ...": the state follows the last ")".
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _command(argv: list[str], timeout: float = _COMMAND_TIMEOUT) -> str:
    """Runs an ip/tc/bridge command; its stdout, or HostsError with the command and its stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise HostsError(f"{shlex.join(argv)}: no answer in {timeout} s") from e
    if done.returncode != 0:
        raise HostsError(f"{shlex.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls ``predicate`` every 10 ms for at most ``timeout`` seconds; HostsError if never true."""
    step = 0.01
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / step) + 1):
        if predicate():
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(step)
    raise HostsError(f"waited {timeout} s for {what}")


_unavailable: list[str | None] = []  # the probe's answer, once per process


def hosts_unavailable() -> str | None:
    """Why test hosts cannot be made here, or None when they can (probed once per process)."""
    if not _unavailable:
        _unavailable.append(_probe())
    return _unavailable[0]


def _probe() -> str | None:
    if os.geteuid() != 0:
        return f"test hosts need root (euid {os.geteuid()})"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"test hosts need {', '.join(missing)} on PATH"
    # Named like a run, so that a probe killed halfway is cleaned up as stale.
    probe = f"{PREFIX}{os.getpid()}.{next(_sequence)}-probe"
    try:
        _command(["ip", "netns", "add", probe])
        _command(["ip", "netns", "del", probe])
    except HostsError as e:
        return str(e)
    return None


def require_hosts() -> None:
    """Skips the calling test where test hosts cannot be made, with the reason.

    With ``CI=true`` in the environment it fails instead, with the same
    reason: CI runs as root, so hosts that cannot be made there are a fault.
    """
    reason = hosts_unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and test hosts cannot be made: {reason}", pytrace=False)
    pytest.skip(f"test hosts cannot be made: {reason}")


@pytest.fixture
def host_set() -> Iterator[Callable[..., HostSet]]:
    """A factory of :class:`HostSet`, ``hosts = host_set(["ps0", "w0"])``; all closed at the end.

    Skips (fails with ``CI=true``) where hosts cannot be made; see :func:`require_hosts`.
    """
    require_hosts()
    made: list[HostSet] = []

    def make(names: Sequence[str], **kwargs: Any) -> HostSet:
        hosts = HostSet(names, **kwargs)
        made.append(hosts)
        return hosts

    yield make
    errors = []
    for hosts in reversed(made):
        try:
            hosts.close()
        except HostsError as e:  # close the others all the same
            errors.append(e)
    if errors:
        raise errors[0]

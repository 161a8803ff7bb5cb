"""The test hosts of tests/support/hosts.py: wiring, isolation, tasks, link control, cleanup."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys

import pytest

from tests.support import hosts as hosts_module
from tests.support.hosts import HostsError, HostSet, host_set, list_namespaces, require_hosts  # noqa: F401

pytestmark = pytest.mark.hosts

# A host's network namespace is new, so no other process can hold this port.
PORT = 7000
CLOSED_PORT = 7001

ECHO_SERVER = r"""
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
server.settimeout(60)  # a bound of its own: the test kills it much sooner
while True:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(5)
        conn.sendall(conn.recv(16))
"""

# Prints what one exchange with the echo server came to: "echo:ping",
# "refused", "timeout" or "error:<errno>"; tries again until `patience` runs out.
CLIENT = r"""
import socket, sys, time
address, port = sys.argv[1], int(sys.argv[2])
timeout, patience = float(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + patience
for _ in range(1000):
    try:
        with socket.create_connection((address, port), timeout=timeout) as s:
            s.sendall(b"ping")
            outcome = "echo:" + s.recv(16).decode()
            break
    except ConnectionRefusedError:
        outcome = "refused"
    except TimeoutError:
        outcome = "timeout"
    except OSError as e:
        outcome = f"error:{e.errno}"
    if time.monotonic() >= deadline:
        break
    time.sleep(0.05)
print(outcome)
"""


def exchange(
    hosts: HostSet,
    client: str,
    server: str,
    port: int = PORT,
    timeout: float = 1.0,
    patience: float = 0.0,
) -> str:
    """What a connection from host ``client`` to ``server``'s port came to (see CLIENT)."""
    argv = [sys.executable, "-c", CLIENT, hosts.address(server), str(port)]
    argv += [str(timeout), str(patience)]
    done = hosts.run(client, argv, timeout=timeout + patience + 15, check=True)
    return done.stdout.strip()


def start_echo(hosts: HostSet, server: str, client: str) -> subprocess.Popen:
    """An echo server on host ``server``, once host ``client`` got an answer from it."""
    popen = hosts.popen(server, [sys.executable, "-c", ECHO_SERVER, str(PORT)])
    assert exchange(hosts, client, server, patience=10) == "echo:ping"
    return popen


def root(argv: list[str]) -> str:
    """A command's stdout, run in the machine's own namespaces."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout


def root_links() -> set[str]:
    return {line.split(":")[1].strip() for line in root(["ip", "-o", "link"]).splitlines()}


def link_flags(hosts: HostSet, name: str) -> str:
    return hosts.run(name, ["ip", "-o", "link", "show", "eth0"], timeout=10, check=True).stdout


def test_hosts_reach_each_other_and_the_machine_sees_none_of_it(host_set):
    links_before = root_links()
    hosts = host_set(["ps0", "w0", "w1"])
    addresses = [hosts.address(name) for name in ("ps0", "w0", "w1")]
    assert len(set(addresses)) == 3
    assert len({a.rsplit(".", 1)[0] for a in addresses}) == 1  # one /24
    assert all(re.fullmatch(r"10\.213\.\d+\.\d+", a) for a in addresses)

    start_echo(hosts, "ps0", "w0")
    assert exchange(hosts, "w1", "ps0") == "echo:ping"

    own = hosts.run("w0", ["ip", "-o", "addr"], timeout=10, check=True).stdout
    assert f"inet {hosts.address('w0')}/24" in own
    seen = hosts.run("w0", ["ip", "-o", "link"], timeout=10, check=True).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in seen.splitlines()}
    assert names == {"lo", "eth0"}

    machine = root(["ip", "-o", "addr"])
    for address in addresses:
        assert f"{address}/" not in machine
    assert root_links() == links_before
    run = {hosts.netns(n) for n in ("ps0", "w0", "w1")} | {hosts.bridge_netns}
    assert run <= set(list_namespaces())


def test_each_host_has_a_dev_shm_of_its_own(host_set):
    hosts = host_set(["w0", "w1"])
    name = f"psframe-hosts-test-{os.getpid()}"
    hosts.run("w0", ["sh", "-c", f"echo here > /dev/shm/{name}"], timeout=10, check=True)

    # Another process on the same host sees it: the host's processes share one /dev/shm.
    reader = hosts.popen("w0", ["cat", f"/dev/shm/{name}"], stdout=subprocess.PIPE, text=True)
    assert reader.communicate(timeout=10)[0] == "here\n"
    assert hosts.run("w1", ["test", "-e", f"/dev/shm/{name}"], timeout=10).returncode == 1
    assert not os.path.exists(f"/dev/shm/{name}")
    mounts = hosts.run("w1", ["cat", "/proc/self/mountinfo"], timeout=10, check=True).stdout
    assert hosts_module.SHM_SOURCE in mounts
    assert hosts_module.SHM_SOURCE not in root(["cat", "/proc/self/mountinfo"])


def test_a_task_is_its_popens_pid_with_the_callers_environment_and_directory(host_set, tmp_path, monkeypatch):
    hosts = host_set(["w0"])
    monkeypatch.setenv("PSFRAME_HOSTS_TEST", "inherited")
    script = "import os; print(os.getpid(), os.getcwd(), os.environ['PSFRAME_HOSTS_TEST'])"
    argv = [sys.executable, "-c", script]
    task = hosts.popen("w0", argv, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    out, _ = task.communicate(timeout=15)
    assert out.split() == [str(task.pid), str(tmp_path), "inherited"]
    assert task.returncode == 0

    monkeypatch.chdir(tmp_path)
    done = hosts.run("w0", ["pwd"], timeout=10, check=True)
    assert done.stdout.strip() == str(tmp_path)


def test_a_cut_fails_connections_until_healed(host_set):
    hosts = host_set(["ps0", "w0", "w1"])
    start_echo(hosts, "ps0", "w0")

    hosts.cut("ps0")
    hosts.cut("ps0")  # again: no error
    assert "NO-CARRIER" in link_flags(hosts, "ps0")
    assert exchange(hosts, "w0", "ps0") == "timeout"
    assert exchange(hosts, "w1", "w0") == "refused"  # the others still talk

    hosts.heal("ps0")
    assert "LOWER_UP" in link_flags(hosts, "ps0")
    assert exchange(hosts, "w0", "ps0", patience=10) == "echo:ping"


def test_a_black_hole_keeps_carrier_and_silences_the_host_until_healed(host_set):
    hosts = host_set(["ps0", "w0"])
    start_echo(hosts, "ps0", "w0")
    assert exchange(hosts, "w0", "ps0", port=CLOSED_PORT) == "refused"

    hosts.black_hole("ps0")
    hosts.black_hole("ps0")  # again: no error
    assert "LOWER_UP" in link_flags(hosts, "ps0")
    # No reset comes back: a closed port times out like an open one.
    assert exchange(hosts, "w0", "ps0", port=CLOSED_PORT) == "timeout"
    assert exchange(hosts, "w0", "ps0") == "timeout"

    hosts.heal("ps0")
    assert exchange(hosts, "w0", "ps0", patience=10) == "echo:ping"
    assert exchange(hosts, "w0", "ps0", port=CLOSED_PORT) == "refused"

    # A cut link black-holed comes back up, silent; one heal undoes both.
    hosts.cut("ps0")
    hosts.black_hole("ps0")
    assert "LOWER_UP" in link_flags(hosts, "ps0")
    assert exchange(hosts, "w0", "ps0") == "timeout"
    hosts.heal("ps0")
    assert exchange(hosts, "w0", "ps0", patience=10) == "echo:ping"


def qdiscs(netns: str, dev: str) -> str:
    return root(["tc", "-n", netns, "-s", "qdisc", "show", "dev", dev, "root"])


def sent_bytes(netns: str, dev: str) -> int:
    return int(re.search(r"Sent (\d+) bytes", qdiscs(netns, dev)).group(1))


def test_cap_puts_a_tbf_on_both_ends_and_uncap_removes_it(host_set):
    hosts = host_set(["ps0", "w0"])
    ends = [(hosts.netns("w0"), "eth0"), (hosts.bridge_netns, "vb-w0")]
    hosts.cap("w0", 10)
    for netns, dev in ends:
        shown = qdiscs(netns, dev)
        assert "qdisc tbf" in shown and "rate 10Mbit" in shown

    hosts.cap("w0", 20)  # again: replaced, not stacked
    for netns, dev in ends:
        shown = qdiscs(netns, dev)
        assert shown.count("qdisc tbf") == 1 and "rate 20Mbit" in shown
    assert "tbf" not in qdiscs(hosts.netns("ps0"), "eth0")
    assert "tbf" not in qdiscs(hosts.bridge_netns, "vb-ps0")

    # Traffic both ways goes through both buckets.
    before = [sent_bytes(netns, dev) for netns, dev in ends]
    start_echo(hosts, "ps0", "w0")
    after = [sent_bytes(netns, dev) for netns, dev in ends]
    assert all(a > b for a, b in zip(after, before)), (before, after)

    hosts.uncap("w0")
    hosts.uncap("w0")  # again: no error
    for netns, dev in ends:
        assert "tbf" not in qdiscs(netns, dev)
    assert exchange(hosts, "w0", "ps0") == "echo:ping"


def test_a_dead_runs_namespaces_are_removed_and_a_live_ones_kept(host_set):
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    stale = [f"psft{gone.pid}.0-w0", f"psft{gone.pid}.0-br"]
    live = f"psft{os.getpid()}.999999-w0"  # this process's: alive
    leftover = None
    try:
        for netns in [*stale, live]:
            root(["ip", "netns", "add", netns])
        # A task the dead run left behind, still in its namespace.
        leftover = subprocess.Popen(["ip", "netns", "exec", stale[0], "sleep", "30"])
        hosts_module._wait_until(
            lambda: str(leftover.pid) in root(["ip", "netns", "pids", stale[0]]).split(),
            5.0,
            "the leftover task to enter its namespace",
        )

        host_set(["w0"])
        names = list_namespaces()
        assert not set(stale) & set(names)
        assert live in names
        assert leftover.wait(timeout=10) == -signal.SIGKILL
    finally:
        if leftover is not None and leftover.poll() is None:
            leftover.kill()
            leftover.wait(timeout=10)
        for netns in [*stale, live]:
            if netns in list_namespaces():
                root(["ip", "netns", "del", netns])


def test_close_kills_the_tasks_and_removes_the_namespaces(host_set):
    links_before = root_links()
    hosts = host_set(["w0", "w1"])
    argv = ["sh", "-c", "sleep 30 & echo $!; wait"]
    parent = hosts.popen("w0", argv, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([parent.stdout], [], [], 10)
    assert ready, "the task never printed its child's pid"
    child = int(parent.stdout.readline())
    sleeper = hosts.popen("w1", [sys.executable, "-c", "import time; time.sleep(30)"])
    finished = hosts.popen("w1", ["true"])
    assert finished.wait(timeout=10) == 0
    run = {hosts.netns("w0"), hosts.netns("w1"), hosts.bridge_netns}

    hosts.close()
    parent.stdout.close()
    assert parent.returncode == -signal.SIGKILL
    assert sleeper.returncode == -signal.SIGKILL
    assert finished.returncode == 0
    # The task's own child, left in the host's namespace, is killed too.
    hosts_module._wait_until(lambda: not hosts_module._alive(child), 5.0, f"pid {child} to end")
    assert not run & set(list_namespaces())
    assert root_links() == links_before

    hosts.close()  # again: nothing to do
    with pytest.raises(HostsError, match="closed"):
        hosts.popen("w0", ["true"])


@pytest.mark.parametrize("names", [["br"], ["w" * 13], ["W0"], ["w0", "w0"], [], ["-w"]])
def test_bad_host_names_are_refused(names):
    with pytest.raises(ValueError):
        HostSet(names)


def test_require_hosts_skips_where_hosts_cannot_be_made_and_fails_under_ci(monkeypatch):
    monkeypatch.setattr(hosts_module, "_unavailable", ["ip netns add: Operation not permitted"])
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Operation not permitted"):
        require_hosts()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="Operation not permitted"):
        require_hosts()
    monkeypatch.setattr(hosts_module, "_unavailable", [None])
    require_hosts()  # hosts can be made: nothing happens

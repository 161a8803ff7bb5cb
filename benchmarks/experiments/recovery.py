"""How long training stalls when a ps task is killed, and how many steps are lost.

Runs the MNIST example (1 ps + 2 workers, ``--checkpoint_dir``, its default
save interval), SIGKILLs the ps once worker 0 logs local step ``--kill_at``,
starts the same ps command again at once, and reports:

- seconds from the new ps serving to both workers going on,
- seconds from the kill to both workers going on,
- global steps lost (the step worker 0 had reached minus the restored one),
- the final global step and test accuracy.

    python -m benchmarks.experiments.recovery [--kill_at 1500] [--data_dir data]

MNIST must be in --data_dir (``python scripts/fetch_mnist.py`` puts it there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from benchmarks.common import ROOT
from psframe.launch import pick_free_ports

EXAMPLE = ROOT / "examples" / "mlp_mnist_dist.py"
DEADLINE_SECONDS = 600


def _stamp(line: str) -> float:
    """Seconds since the epoch of a log line's '%Y-%m-%d %H:%M:%S,mmm' prefix."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen, deadline: float) -> re.Match:
    while time.time() < deadline:
        match = re.search(pattern, path.read_text())
        if match:
            return match
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise TimeoutError(f"{path.name} never logged {pattern!r}:\n{path.read_text()[-2000:]}")


def measure(kill_at: int, data_dir: str) -> dict:
    deadline = time.time() + DEADLINE_SECONDS
    hosts = [f"127.0.0.1:{p}" for p in pick_free_ports(3)]
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        flags = [
            f"--ps_hosts={hosts[0]}",
            f"--worker_hosts={hosts[1]},{hosts[2]}",
            f"--data_dir={data_dir}",
            f"--checkpoint_dir={logs / 'ckpt'}",
            "--log_every=100",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs: dict[str, subprocess.Popen] = {}

        def start(name: str, job: str, index: int) -> None:
            out = open(logs / f"{name}.log", "w")
            procs[name] = subprocess.Popen(
                [sys.executable, str(EXAMPLE), *flags, f"--job_name={job}", f"--task_index={index}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
            )

        try:
            start("ps0", "ps", 0)
            start("worker0", "worker", 0)
            start("worker1", "worker", 1)
            reached = _wait_for(
                logs / "worker0.log", rf"local step {kill_at}, global step (\d+)", procs["worker0"], deadline
            )
            procs["ps0"].send_signal(signal.SIGKILL)
            killed = time.time()
            procs["ps0"].wait(timeout=30)
            start("ps1", "ps", 0)  # the same command again
            for name in ("worker0", "worker1"):
                procs[name].wait(timeout=max(1.0, deadline - time.time()))
            ps_log = (logs / "ps1.log").read_text()
            serving = _stamp(re.search(r"^.*serving at.*$", ps_log, re.M).group(0))
            restored = int(re.search(r"going on at global step (\d+)", ps_log).group(1))
            resumed = max(
                _stamp(re.search(r"^.*the ps tasks are back.*$", (logs / f"{w}.log").read_text(), re.M).group(0))
                for w in ("worker0", "worker1")
            )
            result = json.loads((logs / "worker0.log").read_text().strip().splitlines()[-1])
            procs["ps1"].wait(timeout=60)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    return {
        "killed_at_global_step": int(reached.group(1)),
        "restored_global_step": restored,
        "steps_lost": int(reached.group(1)) - restored,
        "seconds_serving_to_resumed": round(resumed - serving, 3),
        "seconds_kill_to_resumed": round(resumed - killed, 3),
        "final_global_step": result["global_step"],
        "test_accuracy": result["test_accuracy"],
        "recoveries": result["recoveries"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill_at", type=int, default=1500, help="worker 0's local step (a multiple of 100)")
    parser.add_argument("--data_dir", default=str(ROOT / "data"))
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.kill_at, args.data_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

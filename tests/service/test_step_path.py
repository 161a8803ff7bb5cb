"""The path of one step, as ``docs/contributing.md`` lists it file by file, is the code's: a
dense asynchronous step is traced (the worker's thread and the ps task's), and the files it runs
in must be the listed ones, no more and no fewer."""

from __future__ import annotations

import re
import signal
import sys
import threading
from pathlib import Path

import torch

import psframe

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = str(ROOT / "psframe") + "/"


def listed_files() -> list[str]:
    text = (ROOT / "docs" / "contributing.md").read_text()
    table = text.split("<!-- step-path:begin -->")[1].split("<!-- step-path:end -->")[0]
    return re.findall(r"^\| \d+ \| `([^`]+)` \|", table, flags=re.MULTILINE)


def test_the_listed_path_of_a_step_is_the_code_s(local_cluster):
    reached: list[str] = []
    tracing = threading.Event()

    def tracer(frame, event, arg):
        if tracing.is_set() and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE) and name[len(PACKAGE) :] not in reached:
                reached.append(name[len(PACKAGE) :])

    threading.settrace(tracer)  # the ps task's threads are made from here on
    # SIGTERM's default action, so that the trainer handles it (psframe.worker.leaving), as in a script.
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        cluster = local_cluster(num_ps=2, num_workers=1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.1)) as trainer:
            x = torch.randn(4, 8)
            for _ in range(3):  # what is done once (plans, streams, checks) is done by now
                trainer.step(model(x).sum())
            loss = model(x).sum()
            sys.settrace(tracer)
            tracing.set()
            # Two steps: a ps task's stream resumes its outer frames (the transport's) when it
            # asks for the next request, just after a reply went: before the second step's.
            trainer.step(loss)
            trainer.step(model(x).sum())
            tracing.clear()
            sys.settrace(None)
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
        signal.signal(signal.SIGTERM, before)
    listed = listed_files()
    assert len(listed) == len(set(listed)), "a file is listed twice"
    assert sorted(reached) == sorted(listed), (
        f"not listed: {sorted(set(reached) - set(listed))}; listed, not reached: {sorted(set(listed) - set(reached))}"
    )

"""Tests for psframe.launch: real child processes on loopback, a timeout on every launch."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import textwrap
from pathlib import Path

import pytest

from psframe.errors import PsframeError
from psframe.launch import LaunchError, TaskResult, launch, pick_free_ports

pytestmark = pytest.mark.cluster

LINE = re.compile(r"^\[(ps\d+|worker\d+|launch)\] (.*)$")
# Bounds that only stop a broken launcher from hanging the suite; no test relies on them.
TIMEOUT = 30.0

# Imported by every child script: who am I, and a bounded wait for files other tasks write.
PRELUDE = """\
import json, os, signal, sys, time
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:5])
me = flags["job_name"] + flags["task_index"]
def wait_for(paths):
    end = time.monotonic() + 20
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < end:
        time.sleep(0.01)
"""


@pytest.fixture(autouse=True)
def launch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's launches keep their records (psframe.launch.record) in a folder of its own."""
    folder = tmp_path / "launched"
    monkeypatch.setenv("PSFRAME_LAUNCH_DIR", str(folder))
    return folder


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return str(path)


def _lines(out: io.StringIO) -> list[tuple[str, str]]:
    parsed = []
    for line in out.getvalue().splitlines():
        m = LINE.match(line)
        assert m, f"unprefixed line: {line!r}"
        parsed.append((m.group(1), m.group(2)))
    return parsed


def _tagged(out: io.StringIO, tag: str) -> dict[str, str]:
    """The text after ``tag`` that each task printed, keyed by task name."""
    return {task: text[len(tag) :] for task, text in _lines(out) if text.startswith(tag)}


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_all_succeed_returns_zero_and_prefixes_every_line(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        print("hello from", me)
        print("oops from", me, file=sys.stderr)
    """,
    )
    out = io.StringIO()
    assert launch(script, 2, 3, timeout=TIMEOUT, out=out) == 0
    lines = _lines(out)
    names = ["ps0", "ps1", "worker0", "worker1", "worker2"]
    for name in names:
        assert (name, f"hello from {name}") in lines
        assert (name, f"oops from {name}") in lines
    assert lines[-1] == ("launch", "done: " + " ".join(f"{n}=0" for n in names))


def test_child_flags_tf_config_and_env(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        print("ARGV", json.dumps(sys.argv[1:]))
        print("TF_CONFIG", os.environ["TF_CONFIG"])
        print("ENV", json.dumps([os.environ.get("PYTHONUNBUFFERED"), os.environ.get("PSF_X")]))
    """,
    )
    out = io.StringIO()
    assert launch(script, 2, 2, timeout=TIMEOUT, out=out, env={"PSF_X": "y"}) == 0
    argvs = {k: json.loads(v) for k, v in _tagged(out, "ARGV ").items()}
    configs = {k: json.loads(v) for k, v in _tagged(out, "TF_CONFIG ").items()}
    envs = {k: json.loads(v) for k, v in _tagged(out, "ENV ").items()}
    assert sorted(argvs) == sorted(configs) == sorted(envs) == ["ps0", "ps1", "worker0", "worker1"]

    cluster = configs["ps0"]["cluster"]
    assert set(cluster) == {"ps", "worker"}
    assert len(cluster["ps"]) == 2 and len(cluster["worker"]) == 2
    addresses = cluster["ps"] + cluster["worker"]
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)
    for name, argv in argvs.items():
        job, index = name.rstrip("0123456789"), int(name[-1])
        assert argv == [
            f"--ps_hosts={','.join(cluster['ps'])}",
            f"--worker_hosts={','.join(cluster['worker'])}",
            f"--job_name={job}",
            f"--task_index={index}",
        ]
        assert configs[name] == {"cluster": cluster, "task": {"type": job, "index": index}}
        assert envs[name] == ["1", "y"]


def test_compute_threads_are_shared_out_unless_set(tmp_path: Path, monkeypatch) -> None:
    script = _script(tmp_path, 'print("OMP", os.environ.get("OMP_NUM_THREADS"))\n')
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = io.StringIO()
    assert launch(script, 1, 2, timeout=TIMEOUT, out=out) == 0
    share = str(max(1, len(os.sched_getaffinity(0)) // 3))
    assert _tagged(out, "OMP ") == {"ps0": share, "worker0": share, "worker1": share}
    assert "each of the 3 tasks gets" in out.getvalue()

    out = io.StringIO()
    assert launch(script, 1, 2, timeout=TIMEOUT, out=out, env={"OMP_NUM_THREADS": "3"}) == 0
    assert set(_tagged(out, "OMP ").values()) == {"3"}
    assert "OMP_NUM_THREADS is not set" not in out.getvalue()


def test_script_args_are_passed_through_verbatim(tmp_path: Path) -> None:
    script = _script(tmp_path, 'print("REST", json.dumps(sys.argv[5:]))\n')
    args = ["--train_steps", "5", "--sync_replicas", "--", "two words", "--job_name=evil"]
    out = io.StringIO()
    assert launch(script, 1, 2, args, timeout=TIMEOUT, out=out) == 0
    rests = _tagged(out, "REST ")
    assert sorted(rests) == ["ps0", "worker0", "worker1"]
    assert all(json.loads(r) == args for r in rests.values())


def test_first_failure_stops_the_others_and_returns_its_code(tmp_path: Path) -> None:
    # worker1 fails once every other task has started (and written its pid); they sleep.
    script = _script(
        tmp_path,
        f"""
        d = {str(tmp_path)!r}
        others = ["ps0", "ps1", "worker0", "worker2"]
        if me == "worker1":
            wait_for([os.path.join(d, o + ".pid") for o in others])
            sys.exit(3)
        with open(os.path.join(d, me + ".tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(d, me + ".tmp"), os.path.join(d, me + ".pid"))
        time.sleep(60)
    """,
    )
    out = io.StringIO()
    assert launch(script, 2, 3, timeout=TIMEOUT, out=out) == 3
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 4
    _assert_gone(pids)
    text = out.getvalue()
    assert "[launch] worker1 exited with code 3; stopping the others\n" in text
    last = _lines(out)[-1][1]
    assert last.startswith("done: ") and "worker1=3 " in last + " "
    assert "ps0=143 (stopped)" in last  # SIGTERM does not override the first failure


def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        f"""
        ready = os.path.join({str(tmp_path)!r}, "ready")
        if me == "ps0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("PID", os.getpid())
            open(ready, "w").close()
            time.sleep(60)
        wait_for([ready])
        sys.exit(1)
    """,
    )
    out = io.StringIO()
    assert launch(script, 1, 1, timeout=TIMEOUT, grace=0.2, out=out) == 1
    _assert_gone([int(_tagged(out, "PID ")["ps0"])])
    assert "ps0=137 (stopped)" in _lines(out)[-1][1]


def test_child_killed_by_signal_counts_as_128_plus_signal(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        if me == "worker0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """,
    )
    out = io.StringIO()
    assert launch(script, 1, 1, timeout=TIMEOUT, out=out) == 137
    assert "[launch] worker0 was killed by SIGKILL (code 137); stopping the others" in out.getvalue()


def test_timeout_stops_everything_and_returns_124(tmp_path: Path) -> None:
    script = _script(tmp_path, 'print("PID", os.getpid())\ntime.sleep(60)\n')
    out = io.StringIO()
    assert launch(script, 1, 2, timeout=1.0, out=out) == 124
    assert "[launch] timeout after 1s; still running: ps0 worker0 worker1; stopping them" in out.getvalue()
    _assert_gone([int(p) for p in _tagged(out, "PID ").values()])  # those that got to print


def test_keyboard_interrupt_stops_everything_and_returns_130(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        f"""
        ready = os.path.join({str(tmp_path)!r}, "ready")
        if me == "ps0":
            print("PID", os.getpid())
            open(ready, "w").close()
            time.sleep(60)
        wait_for([ready])
        os.kill(os.getppid(), signal.SIGINT)  # the launcher's own Ctrl-C
        time.sleep(60)
    """,
    )
    out = io.StringIO()
    assert launch(script, 1, 1, timeout=TIMEOUT, grace=1.0, out=out) == 130
    assert "[launch] interrupted; every task has 1s (--grace) to stop on its own" in out.getvalue()
    _assert_gone([int(_tagged(out, "PID ")["ps0"])])


def test_lines_stay_whole_and_partial_last_line_is_kept(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        for i in range(200):
            print(me * 300 + str(i))
            print(me * 300 + str(i), file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """,
    )
    out = io.StringIO()
    assert launch(script, 2, 2, timeout=TIMEOUT, out=out) == 0
    counts: dict[str, int] = {}
    for task, text in _lines(out):
        if task == "launch":
            continue
        if text == "no newline at the end":
            counts[task + "/end"] = counts.get(task + "/end", 0) + 1
            continue
        assert re.fullmatch(rf"(?:{task}){{300}}\d+", text), text[:80]
        counts[task] = counts.get(task, 0) + 1
    assert counts == {n: 400 for n in ["ps0", "ps1", "worker0", "worker1"]} | {
        f"{n}/end": 1 for n in ["ps0", "ps1", "worker0", "worker1"]
    }


def test_output_defaults_to_sys_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, 'print("hi")\n')
    assert launch(script, 1, 1, timeout=TIMEOUT) == 0
    captured = capsys.readouterr().out
    assert "[ps0] hi\n" in captured and "[worker0] hi\n" in captured


def test_pick_free_ports_are_distinct_and_bindable() -> None:
    ports = pick_free_ports(16)
    assert len(ports) == 16 and len(set(ports)) == 16
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
    assert pick_free_ports(0) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_ps": 0}, "num_ps must be an int >= 1, got 0"),
        ({"num_workers": -1}, "num_workers must be an int >= 1, got -1"),
        ({"num_ps": True}, "num_ps"),
        ({"num_workers": 1.5}, "num_workers"),
        ({"script": "/no/such/script.py"}, "'/no/such/script.py' is not a file"),
        ({"script_args": "--train_steps 5"}, "script_args must be a sequence of str"),
        ({"script_args": ["--n", 5]}, "script_args must be a sequence of str"),
        ({"timeout": 0}, "timeout must be > 0"),
        ({"grace": -1}, "grace must be >= 0"),
        ({"on_failure": "again"}, "on_failure must be one of 'stop', 'restart', 'continue', got 'again'"),
    ],
)
def test_bad_inputs_are_refused_before_anything_starts(tmp_path: Path, kwargs: dict, match: str) -> None:
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    args = {"script": str(script), "num_ps": 1, "num_workers": 1, "timeout": TIMEOUT} | kwargs
    out = io.StringIO()
    with pytest.raises(LaunchError, match=re.escape(match)) as info:
        launch(args.pop("script"), args.pop("num_ps"), args.pop("num_workers"), out=out, **args)
    assert isinstance(info.value, PsframeError) and isinstance(info.value, ValueError)
    assert not (tmp_path / "ran").exists() and out.getvalue() == ""


def test_missing_interpreter_raises_os_error(tmp_path: Path) -> None:
    script = _script(tmp_path, 'print("hi")\n')
    with pytest.raises(FileNotFoundError):
        launch(script, 1, 1, python=str(tmp_path / "no-python"), timeout=TIMEOUT, out=io.StringIO())


def test_pick_free_ports_refuses_bad_count() -> None:
    with pytest.raises(LaunchError, match="count must be an int >= 0, got -1"):
        pick_free_ports(-1)


def test_task_result_is_a_frozen_record() -> None:
    r = TaskResult("worker1", "worker", 1, 0)
    with pytest.raises(AttributeError):
        r.returncode = 1  # type: ignore[misc]

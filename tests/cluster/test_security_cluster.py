"""Issue 17 with real processes: a ps task's serving processes, a cluster of
processes started with ``--auth_token_file`` and the ``--tls_*`` flags, and
``psframe launch``'s own token. Loopback only, OS-picked ports, every wait bounded."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import grpc
import pytest

import psframe
from psframe.config.security import TOKEN_ENV, Security, generate_token
from psframe.launch import launch
from psframe.wire import transport
from tests.conftest import MNIST_FLAGS, MNIST_STEPS, ROOT, assert_params_equal, free_cluster
from tests.unit.test_security import PATHS, assert_refused_saying_nothing, call_raw, tls, train

pytestmark = pytest.mark.cluster

# Fresh connections to a task of 2 processes: the kernel spreads them (each goes
# to the owner with probability 1/2), so MAX_CONNECTIONS reach the serving process.
CONNECTIONS, MAX_CONNECTIONS = 8, 60


def test_every_serving_process_checks_the_token_and_the_client_certificate(tls_files):
    token = generate_token()
    security = tls(tls_files, mutual=True, token=token)

    def check(servers: list[psframe.Server]) -> None:
        server = servers[0]
        (pid,) = server._serving.pids
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert token.encode() not in f.read()  # secrets travel in the environment
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert f"{TOKEN_ENV}={token}".encode() in f.read().split(b"\0")
        tried = 0
        # Until the serving process has refused some (the owner counts only its own refusals).
        while tried < CONNECTIONS or server._rpc.refused_calls == tried:
            assert tried < MAX_CONNECTIONS, "the kernel sent no connection to the serving process"
            path = PATHS[tried % len(PATHS)]
            certified = transport.open_channel(
                server.address,
                Security(tls_cert_file=tls_files.cert, tls_key_file=tls_files.key, tls_ca_file=tls_files.ca),
            )
            with certified:  # a certificate, but no token: refused by whichever process took it
                assert_refused_saying_nothing(call_raw(certified, path), server)
            tried += 1
            uncertified = grpc.secure_channel(
                server.address, grpc.ssl_channel_credentials(open(tls_files.ca, "rb").read())
            )
            with uncertified:  # the token, but no certificate: the handshake fails
                error = call_raw(uncertified, path, (("authorization", "Bearer " + token),))
                assert error.code() == grpc.StatusCode.UNAVAILABLE

    assert_params_equal(train(1, security, serving_processes=2, check=check), train(1))


def last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def run_job(processes, cluster: psframe.ClusterSpec, *flags: str) -> dict[str, dict]:
    """cluster_job.py on every task of ``cluster`` (sync, 20 steps); each task's last JSON line."""
    processes.procs.clear()
    processes.start_cluster(cluster, "--sync_replicas", "--train_steps=20", "--connect_timeout=60", *flags)
    procs = processes.wait(timeout=180)
    return {name: last_json(proc.output) for name, proc in procs.items()}


def test_a_cluster_of_processes_with_token_and_mutual_tls_trains_as_one_without(processes, tls_files, token_file):
    token, path = token_file
    flags = [
        f"--auth_token_file={path}",
        f"--tls_cert_file={tls_files.cert}",
        f"--tls_key_file={tls_files.key}",
        f"--tls_ca_file={tls_files.ca}",
    ]
    secured = run_job(processes, free_cluster(2, 2), *flags)
    assert all(token not in proc.output for proc in processes.procs.values())
    plain = run_job(processes, free_cluster(2, 2))
    for worker in ("worker0", "worker1"):
        assert secured[worker]["global_step"] == plain[worker]["global_step"] == 20
        assert secured[worker]["final_loss"] == plain[worker]["final_loss"]
        assert secured[worker]["final_loss"] < secured[worker]["initial_loss"]
    assert secured["ps0"]["exit"] == secured["ps1"]["exit"] == "clean"


LAUNCHED = textwrap.dedent('''
    """A task of psframe launch: the ps serves; the worker checks that the ps refuses a
    caller without the cluster's token, then trains with the token it was given."""
    import os, sys
    import torch
    import psframe
    from psframe.flags import add_cluster_flags
    from psframe.cluster.tf_config import resolve_cluster
    from psframe.errors import AuthenticationError
    from psframe.hooks import StopAtStepHook
    from psframe.config.security import Security
    from psframe.worker.client import control_calls
    from psframe.worker.client.ps_client import PsClient
    import argparse

    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    args = parser.parse_args()
    cluster, job, index = resolve_cluster(args.ps_hosts, args.worker_hosts, None, args.job_name, args.task_index)
    token = os.environ["PSFRAME_AUTH_TOKEN"]
    assert token not in " ".join(sys.argv)
    print("token length", len(token), flush=True)
    if job == "ps":
        psframe.Server(cluster, "ps", index, serving_processes=1).join(timeout=60)
        sys.exit(0)
    for security in (Security(), Security(auth_token="not-the-cluster-token")):
        with PsClient(cluster, index, security=security) as client:
            try:
                control_calls.wait_for_ps(client, timeout=30)
            except AuthenticationError:
                print("refused without the cluster's token", flush=True)
            else:
                sys.exit("a ps task answered a caller without the token")
    model = torch.nn.Linear(3, 1)
    transport = psframe.Transport(connect_timeout=30)
    with psframe.Trainer(model, cluster, index, hooks=[StopAtStepHook(last_step=3)], transport=transport) as trainer:
        while not trainer.should_stop():
            trainer.step(model(torch.ones(2, 3)).sum())
        print("trained to global step", trainer.global_step, flush=True)
''')


def test_launch_gives_its_tasks_a_fresh_token_of_their_own(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    script = tmp_path / "task.py"
    script.write_text(LAUNCHED)
    outputs = []
    for _ in range(2):
        out_path = tmp_path / "out.txt"
        with open(out_path, "w") as out:
            code = launch(str(script), 1, 1, timeout=120, out=out, env={"PYTHONPATH": str(ROOT)})
        outputs.append(out_path.read_text())
        assert code == 0, outputs[-1]
        assert outputs[-1].count("[worker0] refused without the cluster's token") == 2, outputs[-1]
        assert "[worker0] trained to global step 3" in outputs[-1]
        assert "fresh auth token" in outputs[-1]
    assert os.environ.get(TOKEN_ENV) is None  # nothing leaked into the launcher's environment


def test_launch_passes_a_given_token_file(tmp_path, token_file, capsys):
    from psframe import cli

    token, path = token_file
    script = tmp_path / "task.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys
        sys.exit(0 if os.environ["PSFRAME_AUTH_TOKEN"] == open(sys.argv[-1].split("=", 1)[1]).read().strip() else 3)
    """)
    )
    code = cli.main(
        [
            "launch",
            "--num_ps=1",
            "--num_workers=1",
            "--timeout=60",
            f"--auth_token_file={path}",
            str(script),
            "--",
            f"--token_file={path}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fresh auth token" not in out and token not in out


@pytest.mark.mnist
@pytest.mark.timeout(480)
def test_mnist_example_with_token_and_mutual_tls_reaches_97_percent(processes, mnist_dir, tls_files, token_file):
    """Issue 17's bar: the example, every task with the token and mutual TLS (the ps served
    from two processes), trains as it does without them."""
    token, path = token_file
    processes.start(
        "launch",
        [
            sys.executable,
            "-m",
            "psframe.cli",
            "launch",
            "--num_ps",
            "1",
            "--num_workers",
            "2",
            "--timeout",
            "400",
            f"--auth_token_file={path}",
            f"--tls_cert_file={tls_files.cert}",
            f"--tls_key_file={tls_files.key}",
            f"--tls_ca_file={tls_files.ca}",
            str(ROOT / "examples" / "mlp_mnist_dist.py"),
            "--",
            f"--data_dir={mnist_dir}",
            *MNIST_FLAGS,
            "--serving_processes=2",
        ],
    )
    procs = processes.wait(timeout=420)
    output = procs["launch"].output
    assert "(auth token, mutual TLS)" in output and token not in output
    chief = [line.removeprefix("[worker0] ") for line in output.splitlines() if line.startswith("[worker0] {")]
    result = json.loads(chief[-1])
    assert result["test_accuracy"] >= 0.97, result
    assert result["global_step"] >= MNIST_STEPS

"""Issue 17, parts 1 and 2: the auth token and TLS.

Settings (no network), then in-process ps servers on free loopback ports:
every method refuses a call without the token, with another one, without
TLS or without a client certificate, and says nothing more; training with
a token, TLS or mutual TLS gives the same values, bit for bit, as without;
``psframe status``/``shutdown``/``ping`` with and without the token.
Processes (serving processes, a cluster, ``psframe launch``): test_security_cluster.py.

This file holds the service tier's tests of the subject; `tests/unit/test_security.py` holds the
other tiers'.
"""

from __future__ import annotations

import time

import grpc
import pytest

from psframe.config.security import TOKEN_ENV, Security, generate_token
from psframe.errors import AuthenticationError, ConnectTimeoutError
from psframe.wire import psframe_pb2 as pb
from psframe.wire import transport
from psframe.worker.client import control_calls
from psframe.worker.client.control_calls import ping
from psframe.worker.client.ps_client import PsClient
from tests.conftest import assert_params_equal
from tests.unit.test_security import (  # noqa: F401
    DEADLINE_S,
    PATHS,
    assert_refused_saying_nothing,
    call_raw,
    run_cli,
    serve,
    tls,
    train,
)


@pytest.mark.parametrize("offered", [None, "wrong"], ids=["no_token", "wrong_token"])
def test_every_method_refuses_a_caller_without_the_token(serve, offered):
    token = generate_token()
    server = serve(Security(auth_token=token))
    metadata = None if offered is None else (("authorization", "Bearer " + generate_token()),)
    with grpc.insecure_channel(server.address) as channel:
        for path in PATHS:
            assert_refused_saying_nothing(call_raw(channel, path, metadata), server)
        # The same token under another key, or twice, or without its scheme: refused too.
        for bad in (
            (("x-token", "Bearer " + token),),
            (("authorization", token),),
            (("authorization", "Bearer " + token), ("authorization", "Bearer " + token)),
        ):
            assert_refused_saying_nothing(call_raw(channel, "/psframe.ParameterServer/GetInfo", bad), server)
        info = channel.unary_unary(
            transport.METHODS["GetInfo"].path, **transport.METHODS["GetInfo"].serializers("client")
        )(pb.InfoRequest(), timeout=5, metadata=(("authorization", "Bearer " + token),))
    assert info.state == pb.TaskInfo.WAITING_FOR_MODEL and not info.variables


def test_psframe_clients_are_told_at_once_and_the_token_is_not_in_the_error(serve):
    token = generate_token()
    server = serve(Security(auth_token=token))
    wrong = Security(auth_token=generate_token())
    start = time.monotonic()
    with PsClient(server.cluster, 0, security=wrong) as client, pytest.raises(AuthenticationError) as e:
        control_calls.wait_for_ps(client, timeout=DEADLINE_S)
    assert time.monotonic() - start < DEADLINE_S / 2  # not waited for as if the task were down
    assert "unauthenticated" in str(e.value) and token not in str(e.value)
    assert wrong.auth_token not in str(e.value)
    with pytest.raises(AuthenticationError):
        ping(server.address, timeout=5)
    assert ping(server.address, timeout=5, security=Security(auth_token=token)).job_name == "ps"


@pytest.mark.parametrize("mutual", [False, True], ids=["server_tls", "mutual_tls"])
def test_a_tls_task_refuses_plaintext_and_certificates_of_another_ca(serve, tls_files, mutual):
    token = generate_token()
    server = serve(tls(tls_files, mutual=mutual, token=token))
    metadata = (("authorization", "Bearer " + token),)  # the right token does not help
    callers = {
        "plaintext": grpc.insecure_channel(server.address),
        "another CA's server": grpc.secure_channel(
            server.address, grpc.ssl_channel_credentials(open(tls_files.other_ca, "rb").read())
        ),
    }
    if mutual:
        callers["no client certificate"] = transport.open_channel(server.address, Security(tls_ca_file=tls_files.ca))
        callers["another CA's client certificate"] = transport.open_channel(
            server.address,
            Security(tls_cert_file=tls_files.other_cert, tls_key_file=tls_files.other_key, tls_ca_file=tls_files.ca),
        )
    for name, channel in callers.items():
        with channel:
            for path in PATHS:
                error = call_raw(channel, path, metadata)
                assert error.code() == grpc.StatusCode.UNAVAILABLE, (name, path, error.details())
    client = Security(
        tls_ca_file=tls_files.ca,
        auth_token=token,
        **({"tls_cert_file": tls_files.cert, "tls_key_file": tls_files.key} if mutual else {}),
    )
    with PsClient(server.cluster, 0, security=client) as ok:
        assert control_calls.wait_for_ps(ok, timeout=DEADLINE_S)[0].job_name == "ps"
    without_token = Security(
        tls_ca_file=client.tls_ca_file, tls_cert_file=client.tls_cert_file, tls_key_file=client.tls_key_file
    )
    with PsClient(server.cluster, 0, security=without_token) as refused, pytest.raises(AuthenticationError):
        control_calls.wait_for_ps(refused, timeout=DEADLINE_S)


def test_a_plaintext_client_of_a_tls_task_times_out_naming_the_task(serve, tls_files):
    server = serve(tls(tls_files, mutual=False))
    with PsClient(server.cluster, 0) as client, pytest.raises(ConnectTimeoutError, match="/job:ps/task:0"):
        control_calls.wait_for_ps(client, timeout=1.0)


@pytest.mark.service
@pytest.mark.parametrize("how", ["token", "server_tls", "mutual_tls", "mutual_tls_no_token"])
def test_training_with_security_gives_the_values_of_training_without(tls_files, how):
    token = None if how == "mutual_tls_no_token" else generate_token()
    security = Security(auth_token=token) if how == "token" else tls(tls_files, mutual=how != "server_tls", token=token)
    # Server-only TLS: the worker checks the ps tasks' certificate, and has none of its own.
    worker = Security(auth_token=token, tls_ca_file=tls_files.ca) if how == "server_tls" else None
    assert_params_equal(train(2, security, worker), train(2))


def test_status_shutdown_and_ping_need_the_token(serve, token_file, tls_files, capsys):
    token, path = token_file
    server = serve(tls(tls_files, mutual=True, token=token))
    spec = f"--cluster_spec={server.cluster.to_string()}"
    tls_flags = [
        f"--tls_cert_file={tls_files.cert}",
        f"--tls_key_file={tls_files.key}",
        f"--tls_ca_file={tls_files.ca}",
    ]
    for command in (["status", spec], ["shutdown", spec, "--timeout=10"], ["ping", server.address]):
        code, out, err = run_cli(capsys, *command, *tls_flags)
        assert code == 1 and "unauthenticated" in err, (command, out, err)
        assert token not in out + err
    assert server.service.info().state != pb.TaskInfo.FINISHED  # the refused shutdown did nothing
    code, out, err = run_cli(capsys, "status", spec, f"--auth_token_file={path}", *tls_flags)
    assert code == 0 and "waiting_for_model" in out, err
    code, out, err = run_cli(capsys, "ping", server.address, f"--auth_token_file={path}", *tls_flags)
    assert code == 0 and "/job:ps/task:0" in out, err
    code, out, err = run_cli(capsys, "shutdown", spec, f"--auth_token_file={path}", *tls_flags)
    assert code == 0 and "is shutting down" in out, err
    assert server.join(timeout=DEADLINE_S)
    assert token not in out + err


def test_commands_read_the_token_from_the_environment(serve, monkeypatch, capsys):
    token = generate_token()
    server = serve(Security(auth_token=token))
    monkeypatch.setenv(TOKEN_ENV, token)
    code, _out, err = run_cli(capsys, "status", f"--cluster_spec={server.cluster.to_string()}")
    assert code == 0, err

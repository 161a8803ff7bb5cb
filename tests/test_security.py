"""Issue 17, parts 1 and 2: the auth token and TLS.

Settings (no network), then in-process ps servers on free loopback ports:
every method refuses a call without the token, with another one, without
TLS or without a client certificate, and says nothing more; training with
a token, TLS or mutual TLS gives the same values, bit for bit, as without;
``psframe status``/``shutdown``/``ping`` with and without the token.
Processes (serving processes, a cluster, ``psframe launch``): test_security_cluster.py.
"""

from __future__ import annotations

import logging
import time

import grpc
import pytest
import torch

import psframe
from psframe import cli
from psframe.config.security import CA_ENV, CERT_ENV, KEY_ENV, TOKEN_ENV, Security, generate_token, read_token_file
from psframe.errors import AuthenticationError, ConnectTimeoutError, SecurityConfigError
from psframe.wire import psframe_pb2 as pb
from psframe.wire import transport
from psframe.worker.client import control_calls
from psframe.worker.client.control_calls import ping
from psframe.worker.client.ps_client import PsClient
from tests.conftest import assert_params_equal, free_cluster, params

DEADLINE_S = 20.0
STEPS = 4
# Every method of the service, and one it does not have: a refused caller must
# not learn which exist.
PATHS = sorted(m.path for m in transport.METHODS.values()) + ["/psframe.ParameterServer/NoSuchMethod"]


# ---- settings


def test_settings_come_from_arguments_then_the_environment(token_file, tls_files):
    token, path = token_file
    env = {TOKEN_ENV: "e" * 20, CERT_ENV: tls_files.cert, KEY_ENV: tls_files.key, CA_ENV: tls_files.ca}
    assert Security.resolve(auth_token_file=path, environ=env) == Security(
        token, tls_files.cert, tls_files.key, tls_files.ca
    )
    assert Security.resolve(auth_token="a" * 16, auth_token_file=path, environ={}).auth_token == "a" * 16
    assert Security.resolve(environ={TOKEN_ENV: " " + "e" * 20 + "\n"}).auth_token == "e" * 20
    assert Security.resolve(environ={TOKEN_ENV: ""}) == Security()  # empty: not set
    server_only = Security.resolve(tls_cert_file=tls_files.cert, tls_key_file=tls_files.key, environ={})
    assert (server_only.tls, server_only.mutual_tls) == (True, False)
    mutual = Security.resolve(environ=env)
    assert (mutual.tls, mutual.mutual_tls) == (True, True)
    client = Security(tls_ca_file=tls_files.ca)
    assert (client.tls, client.mutual_tls) == (True, False)


def test_the_token_is_never_shown(token_file, tls_files):
    token, path = token_file
    security = Security.resolve(auth_token_file=path, tls_ca_file=tls_files.ca, environ={})
    for text in (repr(security), str(security), security.describe()):
        assert token not in text
    assert security.describe() == "auth token, TLS (client)"
    assert Security().describe() == "no auth token, no TLS"


@pytest.mark.parametrize("token", ["short", "has a space in it!", "é" * 20, "x" * 15])
def test_a_bad_token_is_refused_without_being_echoed(token):
    with pytest.raises(SecurityConfigError) as e:
        Security(auth_token=token)
    assert token not in str(e.value)


def test_bad_tls_settings_are_refused(tls_files, tmp_path):
    with pytest.raises(SecurityConfigError, match="go together"):
        Security(tls_cert_file=tls_files.cert)
    with pytest.raises(SecurityConfigError, match="is not a file"):
        Security(tls_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(SecurityConfigError, match="cannot read the auth token file"):
        read_token_file(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecurityConfigError, match="at least 16"):
        read_token_file(str(empty))


def test_a_token_file_others_may_read_is_warned_about(token_file, caplog):
    token, path = token_file
    import os

    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="psframe.config.security"):
        assert read_token_file(path) == token
    assert "chmod 600" in caplog.text and token not in caplog.text


def test_children_get_the_settings_in_their_environment(tls_files):
    security = Security(auth_token="t" * 20, tls_ca_file=tls_files.ca)
    env = security.child_environment({TOKEN_ENV: "old" * 10, CERT_ENV: "x", "OTHER": "1"})
    assert env == {TOKEN_ENV: "t" * 20, CA_ENV: tls_files.ca, "OTHER": "1"}


def test_generated_tokens_are_fresh_and_valid():
    tokens = {generate_token() for _ in range(20)}
    assert len(tokens) == 20 and all(len(t) >= 40 for t in tokens)
    Security(auth_token=tokens.pop())


# ---- every method, refused


@pytest.fixture
def serve(request):
    """Factory: one ps task in this process, with the given security; stopped at the end."""
    servers = []

    def start(security: Security | None = None, num_workers: int = 1) -> psframe.Server:
        cluster = free_cluster(1, num_workers)
        server = psframe.Server(cluster, "ps", 0, serving_processes=1, security=security)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0.1)


def call_raw(channel: grpc.Channel, path: str, metadata=None) -> grpc.RpcError:
    """Call ``path`` with junk bytes (unary, or a stream for PushPull): the error it ends with."""
    streaming = any(m.path == path and m.streaming for m in transport.METHODS.values())
    try:
        if streaming:
            list(channel.stream_stream(path)(iter([b"\x00junk"]), timeout=5, metadata=metadata))
        else:
            channel.unary_unary(path)(b"\x00junk", timeout=5, metadata=metadata)
    except grpc.RpcError as e:
        return e
    pytest.fail(f"{path} answered a refused caller")


def assert_refused_saying_nothing(error: grpc.RpcError, server: psframe.Server) -> None:
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (error.code(), error.details())
    assert error.details() == transport.UNAUTHENTICATED_MESSAGE
    assert not error.trailing_metadata()  # no error class, nothing
    assert not error.initial_metadata()
    for secret in (server.address, server.cluster.to_string(), server.task_name, "ps", "token"):
        assert secret not in error.details()


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


# ---- TLS


def tls(tls_files, *, mutual: bool, token: str | None = None) -> Security:
    """A task's settings: its certificate, and the CA (mutual TLS) or not."""
    return Security(token, tls_files.cert, tls_files.key, tls_files.ca if mutual else None)


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


def test_a_server_needs_a_certificate_to_serve_tls(tls_files):
    with pytest.raises(SecurityConfigError, match="tls_cert_file and tls_key_file"):
        psframe.Server(free_cluster(1, 1), "ps", 0, serving_processes=1, security=Security(tls_ca_file=tls_files.ca))


# ---- training gives the same values


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def train(
    num_ps: int,
    security: Security | None = None,
    worker_security: Security | None = None,
    *,
    serving_processes: int = 1,
    check=None,
) -> dict[str, torch.Tensor]:
    """STEPS steps of one worker against ``num_ps`` in-process ps tasks: the ps tasks with
    ``security``, the worker with ``worker_security`` (default: the same); ``check(servers)``
    runs once the worker has trained."""
    worker_security = security if worker_security is None else worker_security
    cluster = free_cluster(num_ps, 1)
    servers = []
    try:
        for k in range(num_ps):
            servers.append(psframe.Server(cluster, "ps", k, serving_processes=serving_processes, security=security))
        model = make_model()
        trainer = psframe.Trainer(
            model,
            cluster,
            optimizer=psframe.optim.Adam(lr=0.05),
            transport=psframe.Transport(connect_timeout=DEADLINE_S, rpc_timeout=DEADLINE_S),
            placement=psframe.Placement(min_partition_bytes=64),
            security=worker_security,
        )
        with trainer:
            for step in range(STEPS):
                generator = torch.Generator().manual_seed(step)
                x, y = torch.randn(8, 5, generator=generator), torch.randint(0, 2, (8,), generator=generator)
                trainer.step(torch.nn.functional.cross_entropy(model(x), y))
            trainer.pull()
            assert trainer.global_step == STEPS
            if check is not None:
                check(servers)
        return params(model)
    finally:
        for server in servers:
            server.stop(grace=0.1)


@pytest.mark.service
@pytest.mark.parametrize("how", ["token", "server_tls", "mutual_tls", "mutual_tls_no_token"])
def test_training_with_security_gives_the_values_of_training_without(tls_files, how):
    token = None if how == "mutual_tls_no_token" else generate_token()
    security = Security(auth_token=token) if how == "token" else tls(tls_files, mutual=how != "server_tls", token=token)
    # Server-only TLS: the worker checks the ps tasks' certificate, and has none of its own.
    worker = Security(auth_token=token, tls_ca_file=tls_files.ca) if how == "server_tls" else None
    assert_params_equal(train(2, security, worker), train(2))


# ---- the commands


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


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


def test_a_token_without_tls_off_loopback_is_warned_about(tls_files):
    from psframe.config.security import is_loopback

    assert [is_loopback(h) for h in ("localhost", "127.0.0.1", "127.1.2.3", "::1", "0.0.0.0", "h0", "10.0.0.5")] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    token = generate_token()
    assert "travels in clear" in Security(auth_token=token).clear_token_warning("h0")
    assert Security(auth_token=token).clear_token_warning("127.0.0.1") is None
    assert Security(auth_token=token, tls_ca_file=tls_files.ca).clear_token_warning("h0") is None
    assert Security().clear_token_warning("h0") is None

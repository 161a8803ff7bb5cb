"""Issue 17, parts 1 and 2: the auth token and TLS.

Settings (no network), then in-process ps servers on free loopback ports:
every method refuses a call without the token, with another one, without
TLS or without a client certificate, and says nothing more; training with
a token, TLS or mutual TLS gives the same values, bit for bit, as without;
``psframe status``/``shutdown``/``ping`` with and without the token.
Processes (serving processes, a cluster, ``psframe launch``): test_security_cluster.py.

This file holds the unit tier's tests of the subject; `tests/service/test_security.py` holds the
other tiers'.
"""

from __future__ import annotations

import logging

import grpc
import pytest
import torch

import psframe
from psframe import cli
from psframe.config.security import CA_ENV, CERT_ENV, KEY_ENV, TOKEN_ENV, Security, generate_token, read_token_file
from psframe.errors import SecurityConfigError
from psframe.wire import transport
from tests.conftest import free_cluster, params

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


# ---- TLS


def tls(tls_files, *, mutual: bool, token: str | None = None) -> Security:
    """A task's settings: its certificate, and the CA (mutual TLS) or not."""
    return Security(token, tls_files.cert, tls_files.key, tls_files.ca if mutual else None)


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


# ---- the commands


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


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

"""Who may talk to a psframe task: a shared auth token, and TLS.

:class:`Security` holds a task's (or a command's) settings, resolved once
from its arguments and the environment, and every channel and server of
the task is made with it (:mod:`psframe.wire.transport`):

- **auth token**: a shared secret every call carries in its metadata; a ps
  task answers a call without it, or with another, ``UNAUTHENTICATED``
  and nothing else. It comes from ``--auth_token_file PATH`` (the file's
  text, surrounding whitespace stripped), ``Server/Trainer(security=Security(auth_token=...))``,
  or the ``PSFRAME_AUTH_TOKEN`` environment variable.
- **TLS**: ``tls_cert_file`` + ``tls_key_file`` (PEM): this task's
  certificate, which its server presents and its channels offer as a client
  certificate; ``tls_ca_file``: the CA that certificates of the other tasks
  must chain to. A task with a certificate and a CA serves *mutual* TLS
  (every caller must present a certificate the CA signed); a task with a
  certificate but no CA serves server-only TLS; a client (a worker, a
  command) with only a CA checks the server's certificate and presents none.
  The environment variables ``PSFRAME_TLS_CERT_FILE``,
  ``PSFRAME_TLS_KEY_FILE`` and ``PSFRAME_TLS_CA_FILE`` stand in for
  arguments not given.

Without TLS the token travels in clear: anyone who can read the traffic can
replay it. The token is never logged and never shown by ``repr``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from psframe.errors import AuthenticationError, SecurityConfigError

log = logging.getLogger(__name__)

TOKEN_ENV = "PSFRAME_AUTH_TOKEN"
CERT_ENV = "PSFRAME_TLS_CERT_FILE"
KEY_ENV = "PSFRAME_TLS_KEY_FILE"
CA_ENV = "PSFRAME_TLS_CA_FILE"
ENVIRONMENT = (TOKEN_ENV, CERT_ENV, KEY_ENV, CA_ENV)
# gRPC metadata values are printable ASCII; a token is one word of it.
_TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
MIN_TOKEN_LENGTH = 16


__all__ = ["AuthenticationError", "Security", "SecurityConfigError", "generate_token", "read_token_file"]


def generate_token() -> str:
    """A fresh random auth token (256 bits, URL-safe text), as ``psframe launch`` makes one."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Security:
    """A task's security settings; ``Security()`` is none (no token, no TLS).

    Args:
        auth_token: the cluster's shared secret (printable ASCII, no spaces,
            at least :data:`MIN_TOKEN_LENGTH` characters), or None.
        tls_cert_file: this task's certificate (PEM); needs ``tls_key_file``.
        tls_key_file: the private key of ``tls_cert_file`` (PEM).
        tls_ca_file: the CA certificate(s) (PEM) the other tasks' certificates chain to.

    Raises:
        SecurityConfigError: a setting is invalid or a file cannot be read;
            the message never contains the token.

    Example::

        security = Security.resolve(auth_token_file="/etc/psframe/token",
                                    tls_cert_file="ps0.pem", tls_key_file="ps0.key", tls_ca_file="ca.pem")
    """

    auth_token: str | None = field(default=None, repr=False)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None

    def __post_init__(self) -> None:
        if self.auth_token is not None:
            _check_token(self.auth_token, "auth_token")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise SecurityConfigError(
                "tls_cert_file and tls_key_file go together: give both (this task's certificate and its "
                f"private key) or neither; got tls_cert_file={self.tls_cert_file!r}, "
                f"tls_key_file={self.tls_key_file!r}"
            )
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise SecurityConfigError(f"{name} {path!r} is not a file")

    @property
    def tls(self) -> bool:
        """Channels and servers use TLS (a certificate or a CA is set)."""
        return self.tls_cert_file is not None or self.tls_ca_file is not None

    @property
    def mutual_tls(self) -> bool:
        """This task's server requires callers' certificates (it has a certificate and a CA)."""
        return self.tls_cert_file is not None and self.tls_ca_file is not None

    def clear_token_warning(self, host: str) -> str | None:
        """A warning for a server on ``host`` that takes the token without TLS, off loopback; else None."""
        if self.auth_token and not self.tls and not is_loopback(host):
            return (
                "the auth token travels in clear without TLS (--tls_cert_file, --tls_key_file, "
                "--tls_ca_file): anyone who can watch the network can copy it"
            )
        return None

    def describe(self) -> str:
        """What is on, for logs: e.g. ``"auth token, mutual TLS"`` (never the token)."""
        parts = ["auth token"] if self.auth_token else []
        if self.tls:
            parts.append("mutual TLS" if self.mutual_tls else "TLS" if self.tls_cert_file else "TLS (client)")
        return ", ".join(parts) or "no auth token, no TLS"

    def environment(self) -> dict[str, str | None]:
        """The environment variables that give a child process these settings
        (None: remove the variable). Secrets go to children this way, never in argv."""
        return {
            TOKEN_ENV: self.auth_token,
            CERT_ENV: self.tls_cert_file,
            KEY_ENV: self.tls_key_file,
            CA_ENV: self.tls_ca_file,
        }

    def child_environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with :meth:`environment` applied."""
        env = dict(os.environ if base is None else base)
        for name, value in self.environment().items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    @classmethod
    def resolve(
        cls,
        *,
        auth_token: str | None = None,
        auth_token_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_ca_file: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Security:
        """The settings from arguments, and from the environment for those not given.

        Args:
            auth_token: the token itself; wins over ``auth_token_file``.
            auth_token_file: a file holding the token (surrounding whitespace ignored).
            tls_cert_file: this task's certificate (PEM); see :class:`Security`.
            tls_key_file: the private key of ``tls_cert_file`` (PEM).
            tls_ca_file: the CA certificate(s) (PEM) the other tasks' certificates chain to.
            environ: where ``PSFRAME_*`` variables are read (default: ``os.environ``);
                an empty variable counts as not set.

        Raises:
            SecurityConfigError: a setting is invalid or a file cannot be read.
        """
        env = os.environ if environ is None else environ
        if auth_token is None and auth_token_file is not None:
            auth_token = read_token_file(auth_token_file)
        if auth_token is None and env.get(TOKEN_ENV):
            auth_token = env[TOKEN_ENV].strip()
            _check_token(auth_token, TOKEN_ENV)
        return cls(
            auth_token=auth_token,
            tls_cert_file=tls_cert_file or env.get(CERT_ENV) or None,
            tls_key_file=tls_key_file or env.get(KEY_ENV) or None,
            tls_ca_file=tls_ca_file or env.get(CA_ENV) or None,
        )


def accept_security(owner: str, security: Security | None) -> Security:
    """The settings a constructor was given: ``security`` as given, or, given None, those of the
    ``PSFRAME_*`` environment variables (:meth:`Security.resolve`).

    Args:
        owner: the constructor, for messages (``"Server"``, ``"Trainer"``).
        security: the ``security`` argument.

    Raises:
        SecurityConfigError: ``security`` is not a :class:`Security`, or a setting from the
            environment is invalid.
    """
    if security is None:
        return Security.resolve()
    if not isinstance(security, Security):
        raise SecurityConfigError(f"{owner}(security=...) must be a psframe.Security, got {type(security).__name__}")
    return security


def is_loopback(host: str) -> bool:
    """``host`` names this machine's loopback interface (``localhost``, ``127.x.x.x``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped); warns if others may read the file.

    Raises:
        SecurityConfigError: the file cannot be read or holds no valid token.
    """
    try:
        with open(path, encoding="ascii") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SecurityConfigError(f"cannot read the auth token file {path!r}: {type(e).__name__}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "the auth token file %s may be read by other users (mode %o); chmod 600 it", path, stat.S_IMODE(mode)
        )
    _check_token(token, f"the auth token file {path!r}")
    return token


def _check_token(token: str, where: str) -> None:
    if not isinstance(token, str):
        raise SecurityConfigError(f"{where} must be a str, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_LENGTH:
        raise SecurityConfigError(
            f"{where}: the auth token must be at least {MIN_TOKEN_LENGTH} characters, got {len(token)}"
        )
    if not set(token) <= _TOKEN_CHARS:
        raise SecurityConfigError(f"{where}: the auth token must be printable ASCII without spaces")

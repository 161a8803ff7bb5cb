"""Task addresses: ``host:port``, ``1.2.3.4:2222`` or ``[::1]:2222``."""

from __future__ import annotations

import re

from psframe.errors import ClusterSpecError

# Host names and IPv4 addresses; IPv6 (with an optional zone) goes in brackets.
# Separators of the string formats (',', ';', '|') can never appear in a host,
# so from_string(to_string()) always round-trips.
_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
_IPV6_RE = re.compile(r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9._-]+)?")


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def parse_address(address: str, *, any_port: bool = False) -> tuple[str, int]:
    """Splits a task address into host and port.

    Args:
        address: ``"host:port"``, ``"1.2.3.4:2222"`` or ``"[::1]:2222"`` (an
            IPv6 host goes in brackets). Surrounding whitespace is ignored.
        any_port: also accept port 0, "any free port" (a task address in a
            cluster: the server of that task picks its port; see ``psframe.Server``).

    Returns:
        ``(host, port)``; an IPv6 host is returned without its brackets.

    Raises:
        ClusterSpecError: the address is not a string, is empty, contains
            whitespace, has no port, an empty or malformed host, or a port that
            is not an integer in 1..65535 (0..65535 with ``any_port``).

    Example:
        >>> parse_address("[::1]:2222")
        ('::1', 2222)
    """
    if not isinstance(address, str):
        raise ClusterSpecError(f"a task address must be a 'host:port' string, got {_describe(address)}")
    text = address.strip()
    if not text:
        raise ClusterSpecError(f"task address {address!r} is empty; expected 'host:port' such as 'h0:2222'")
    if any(c.isspace() for c in text):
        raise ClusterSpecError(f"task address {address!r} contains whitespace; expected 'host:port' such as 'h0:2222'")
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ClusterSpecError(f"task address {address!r} opens '[' without a closing ']'; expected '[ipv6]:port'")
        host, rest = text[1:close], text[close + 1 :]
        if not rest.startswith(":"):
            raise ClusterSpecError(f"task address {address!r} has no port; expected '[ipv6]:port' such as '[::1]:2222'")
        port_text = rest[1:]
        if not host:
            raise ClusterSpecError(f"task address {address!r} has an empty host; expected '[ipv6]:port'")
        if not _IPV6_RE.fullmatch(host):
            raise ClusterSpecError(f"task address {address!r} has {host!r} in brackets; expected an IPv6 address")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ClusterSpecError(f"task address {address!r} has no port; expected 'host:port' such as '{text}:2222'")
        if ":" in host:
            raise ClusterSpecError(
                f"task address {address!r} has more than one ':'; an IPv6 host goes in brackets, as in '[::1]:2222'"
            )
        if not host:
            raise ClusterSpecError(f"task address {address!r} has an empty host; expected 'host:port' like 'h0:2222'")
        if not _HOST_RE.fullmatch(host):
            raise ClusterSpecError(
                f"task address {address!r} has host {host!r}; expected letters, digits, '.', '-' and '_' only"
            )
    # isdigit() alone would accept '²' and int() would accept '+1' or '1_0'.
    lowest = 0 if any_port else 1
    if not (port_text.isascii() and port_text.isdigit()) or not lowest <= int(port_text) <= 65535:
        raise ClusterSpecError(
            f"task address {address!r} has port {port_text!r}; expected an integer in {lowest}..65535"
        )
    return host, int(port_text)

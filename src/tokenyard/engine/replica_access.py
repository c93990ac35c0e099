"""Who may reach a replica: its bearer token, compared in constant time, and the refusal
to serve beyond loopback without one. Shared by the engine and the embeddings replica."""

from __future__ import annotations

import hmac
import ipaddress
import sys


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` (compared in constant time)."""
    scheme, _, value = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        value.strip().encode(), token.encode()
    )


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the replica reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, token: str | None) -> None:
    """Refuse (ValueError) to serve a replica beyond loopback without a token; warn when
    one serves on loopback without a token (anyone on this machine may call it)."""
    if token is not None:
        return
    if not is_loopback(host):
        raise ValueError(
            f"refusing to serve the replica on {host} without a token: set "
            "TOKENYARD_REPLICA_TOKEN (and give the same one to `tokenyard serve "
            "--replica-url`), or bind 127.0.0.1"
        )
    print("tokenyard engine: warning: no TOKENYARD_REPLICA_TOKEN set; any process on this "
          "machine may call the replica and choose a request's tenant", file=sys.stderr,
          flush=True)

"""`Idempotency-Key` (IETF draft "The Idempotency-Key HTTP Header Field").

A POST that carries the header claims the key for its org. The same key and the same body
again gets the stored response back (and is not charged again); the same key with another
body is 422; a retry while the first is still running is 409 — unless the process running
it is gone (a gateway worker killed mid-request), and then the retry runs. Only successful
(2xx) responses are kept, for 24 hours; a request that failed releases its key so that the
client's retry runs — a stream that began with 200 and then ended in an error event
failed too.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from functools import cache

from tokenyard.errors import APIError, invalid_request
from tokenyard.store.records import IdempotencyRecord
from tokenyard.store.repo import Store

HEADER = "Idempotency-Key"
#: Response header on a replayed response (as Stripe names it).
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_LENGTH = 255
TTL_S = 24 * 3600.0


def _start_ticks(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22), which
    tells a live process from a later one given the same pid; None: no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@cache
def claim_owner() -> str:
    """This process, as a running claim names it: host, pid and start time."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_ticks(os.getpid())}"


def owner_is_dead(owner: str) -> bool:
    """Whether the process `owner` (a `claim_owner`) is gone. Only a process of this host
    can be judged (another gateway host's claims wait for their lease), and only where
    /proc tells (elsewhere nothing is judged dead)."""
    host, _, rest = owner.partition(":")
    pid, _, ticks = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit() or not os.path.isdir("/proc/self"):
        return False
    return _start_ticks(int(pid)) != ticks


def body_digest(body: bytes) -> str:
    """SHA-256 hex of the request body: what "the same request" means."""
    return hashlib.sha256(body).hexdigest()


async def claim(store: Store, org_id: str, key: str, body: bytes) -> IdempotencyRecord | None:
    """Claim `key` for this request: None to go on and run it, or the stored response of
    an earlier identical request to replay. Raises 400 (bad key), 409 or 422."""
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise invalid_request(
            f"The {HEADER} header must be 1 to {MAX_KEY_LENGTH} printable characters.",
            param=HEADER,
        )
    outcome, record = await store.idem_begin(org_id, key, body_digest(body), ttl_s=TTL_S,
                                             owner=claim_owner(), owner_is_dead=owner_is_dead)
    if outcome == "new":
        return None
    if outcome == "replay" and record is not None:
        return record
    if outcome == "mismatch":
        raise APIError(
            422, f"This {HEADER} was already used with a different request body.",
            param=HEADER, code="idempotency_key_reused",
        )
    raise APIError(
        409, f"A request with this {HEADER} is still being processed; retry later.",
        param=HEADER, code="idempotency_key_in_use", headers={"retry-after": "1"},
    )


async def finish(
    store: Store, org_id: str, key: str, status: int, headers: Mapping[str, str],
    body: bytes, *, failed: bool = False,
) -> None:
    """Keep the response of the request that claimed `key` for replays when it succeeded
    (2xx and not `failed`, a stream's error after its 200); else free the key."""
    if failed or not 200 <= status < 300:
        await store.idem_release(org_id, key)
    else:
        await store.idem_complete(org_id, key, status, dict(headers), body)

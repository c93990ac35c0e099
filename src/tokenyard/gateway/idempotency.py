"""`Idempotency-Key` (IETF draft "The Idempotency-Key HTTP Header Field").

A POST that carries the header claims the key for the API key that sent it, on its route
(method and path). The same key, route and body again get the stored response back (and
are not charged again); the same key with another body, or on another route, is 422
`idempotency_key_reused` (a key names one request: Stripe answers 400 to either, the IETF
draft 422 to another body, which this already answered); a retry while the first is still
running is 409 — unless the process running it is gone (a gateway worker killed
mid-request), and then the retry runs. Only successful (2xx) responses are kept, for 24
hours; a request that failed releases its key so that the client's retry runs — a stream
that began with 200 and then ended in an error event failed too.

Whose replay it is: only the API key that made the request gets its stored response, as
a Stripe key's idempotency keys are its account's. Another key, even of the same org,
that sends the same Idempotency-Key and body makes a request of its own, authorized (a key
whose scopes bar the model gets 403), run and billed as such: a replay never skips the
scopes of the key it is served to. The replaying key passed authentication (not revoked,
not expired), and a key's scopes cannot change after it is made (the admin API has no way
to), so the key that was authorized for the request may still make it. Were scopes ever to
become editable, a replay would have to pass `authorize` again for the record's model.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from functools import cache

from tokenyard.errors import APIError, invalid_request
from tokenyard.store.records import IdempotencyRecord, KeyContext
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


def route_of(method: str, path: str) -> str:
    """What a record holds as the route a key was first sent to: "POST /v1/messages"."""
    return f"{method.upper()} {path}"


async def claim(
    store: Store, caller: KeyContext, route: str, key: str, body: bytes,
) -> IdempotencyRecord | None:
    """Claim `key` of the authenticated `caller` for this request to `route` (`route_of`):
    None to go on and run it, or the stored response of an earlier identical request of
    the same API key to replay. Raises 400 (bad key), 409 or 422 (another body or route).
    """
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise invalid_request(
            f"The {HEADER} header must be 1 to {MAX_KEY_LENGTH} printable characters.",
            param=HEADER,
        )
    outcome, record = await store.idem_begin(
        caller.org_id, key, body_digest(body), ttl_s=TTL_S, owner=claim_owner(),
        owner_is_dead=owner_is_dead, api_key_id=caller.key_id, route=route,
    )
    if outcome == "new":
        return None
    if outcome == "replay" and record is not None:
        return record
    if outcome == "mismatch":
        used = (f"for {record.route}" if record is not None and record.route != route
                else "with a different request body")
        raise APIError(
            422, f"This {HEADER} was already used {used}; send another request with "
            f"another {HEADER}.", param=HEADER, code="idempotency_key_reused",
        )
    raise APIError(
        409, f"A request with this {HEADER} is still being processed; retry later.",
        param=HEADER, code="idempotency_key_in_use", headers={"retry-after": "1"},
    )


async def finish(
    store: Store, caller: KeyContext, key: str, status: int, headers: Mapping[str, str],
    body: bytes, *, failed: bool = False,
) -> None:
    """Keep the response of `caller`'s request that claimed `key` for replays when it
    succeeded (2xx and not `failed`, a stream's error after its 200); else free the key."""
    if failed or not 200 <= status < 300:
        await release(store, caller, key)
    else:
        await store.idem_complete(caller.org_id, key, status, dict(headers), body,
                                  api_key_id=caller.key_id)


async def release(store: Store, caller: KeyContext, key: str) -> None:
    """Free `caller`'s claim on `key` (its request failed or was cancelled): a retry runs."""
    await store.idem_release(caller.org_id, key, api_key_id=caller.key_id)

"""Replicas found rather than listed: a pool whose members follow a source of addresses.

- **DNS**: a fleet file `urls` entry `dns+http://NAME:PORT[/path]` stands for one member
  per A/AAAA address of NAME (`http://ADDR:PORT/path`), looked up again every
  `balancer.discovery_interval_s` (5 s). A Kubernetes headless Service is such a name.
  `balancer.dns_server` (`host[:port]`) asks that server (`dns_query.py`); without it the
  system resolver answers (getaddrinfo).
- **Any other source** (Ray's registry of live replicas, `tokenyard.ray`) is an async
  callable returning the member URLs now.

Every round, a URL that appears joins the pool; one that vanished stops taking new work
(draining) and leaves once its requests ended, so none is lost; one that comes back
before it left is back in service. A source that fails (the DNS server is down) changes
nothing: a lookup error is not an empty fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from tokenyard.balancer.affinity import AffinityTable
from tokenyard.balancer.dns_query import lookup
from tokenyard.balancer.member_clients import MemberClient
from tokenyard.balancer.members import Member

logger = logging.getLogger("tokenyard.balancer")

DNS_PREFIX = "dns+"
#: host → its addresses (an injectable lookup; tests point it at their own names).
Resolver = Callable[[str], Awaitable[list[str]]]
#: The member URLs a source holds now.
Source = Callable[[], Awaitable[list[str]]]
#: How often a leaving member's requests are checked for having ended.
_DRAIN_POLL_S = 0.05


class Members(Protocol):
    """What discovery changes (`pool.Pool`)."""

    name: str
    members: list[Member]
    affinity: AffinityTable


def is_dns_url(url: str) -> bool:
    return url.startswith(DNS_PREFIX)


@dataclass(frozen=True)
class DnsTarget:
    """One `dns+http(s)://NAME:PORT[/path]` entry."""

    scheme: str
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> DnsTarget:
        """ValueError names what is wrong with the entry."""
        parts = urlsplit(url.removeprefix(DNS_PREFIX))
        if not is_dns_url(url) or parts.scheme not in ("http", "https"):
            raise ValueError(f"{url!r}: a DNS entry is dns+http://NAME:PORT or dns+https://")
        if not parts.hostname or parts.port is None:
            raise ValueError(f"{url!r}: a DNS entry names a host and a port")
        return cls(parts.scheme, parts.hostname, parts.port, parts.path.rstrip("/"))

    def url(self, address: str) -> str:
        """The member URL of one of the name's addresses."""
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}{self.path}"


async def system_resolve(host: str) -> list[str]:
    """The addresses the system resolver gives `host` (none: it has no such name)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
            return []
        raise
    return [str(info[4][0]) for info in infos]


def make_resolver(dns_server: str | None) -> Resolver:
    """`dns_server`'s lookups, or the system resolver's when None."""
    if dns_server is None:
        return system_resolve
    server = dns_server

    async def resolve(host: str) -> list[str]:
        return await lookup(server, host)

    return resolve


def dns_source(urls: Sequence[str], resolver: Resolver) -> Source:
    """The member URLs of `dns+` entries, every address of each (sorted, no repeats)."""
    targets = [DnsTarget.parse(u) for u in urls]

    async def current() -> list[str]:
        found = await asyncio.gather(*(resolver(t.host) for t in targets))
        return sorted({t.url(a) for t, addresses in zip(targets, found, strict=True)
                       for a in addresses})

    return current


class Discovery:
    """Keeps a pool's members equal to what `source` holds (see the module's docstring).

    `make_client(url)` builds a member's client. `initial()` gives the first members
    (before the pool exists); `attach(pool)` follows the source from then on."""

    def __init__(self, source: Source, make_client: Callable[[str], MemberClient], *,
                 interval_s: float = 5.0, what: str = "discovery") -> None:
        self.source = source
        self.make_client = make_client
        self.interval_s = interval_s
        self.what = what
        self.pool: Members | None = None
        self._task: asyncio.Task[None] | None = None
        self._leaving: dict[str, asyncio.Task[None]] = {}

    async def initial(self) -> list[tuple[str, MemberClient]]:
        """The members found now, as (url, client) pairs for a new pool."""
        return [(url, self.make_client(url)) for url in await self.source()]

    def attach(self, pool: Members) -> None:
        """Follow the source for `pool` every `interval_s` until `close`."""
        self.pool = pool
        if self._task is None and self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception as exc:  # a failed lookup changes nothing
                logger.warning("%s of %s failed: %r", self.what, self._name, exc, extra={
                    "event": "discovery_failed", "deployment": self._name,
                    "error": repr(exc)})

    @property
    def _name(self) -> str:
        return self.pool.name if self.pool is not None else "?"

    async def refresh(self) -> None:
        """One round: look the source up and make the pool's members follow it."""
        if self.pool is None:
            raise RuntimeError("attach a pool first")
        found = set(await self.source())
        pool = self.pool
        present = {m.id: m for m in pool.members}
        for url in sorted(found - present.keys()):
            pool.members.append(Member(url, self.make_client(url)))
            self._log("replica %s joined %s", url, "replica_discovered")
        for url, member in present.items():
            if url in found and url in self._leaving:
                self._leaving.pop(url).cancel()
                member.draining = False
                self._log("replica %s of %s is back", url, "replica_rediscovered")
            elif url not in found and url not in self._leaving:
                member.draining = True
                self._leaving[url] = asyncio.get_running_loop().create_task(
                    self._leave(member))
                self._log("replica %s of %s vanished; draining", url, "replica_vanished")

    async def _leave(self, member: Member) -> None:
        """Remove `member` once its requests ended (it takes no new ones meanwhile)."""
        while member.inflight > 0:
            await asyncio.sleep(_DRAIN_POLL_S)
        pool = self.pool
        assert pool is not None
        with contextlib.suppress(ValueError):
            pool.members.remove(member)
        self._leaving.pop(member.id, None)
        forget = getattr(pool.affinity, "forget", None)
        if forget is not None:
            forget(member.id)
        self._log("replica %s left %s", member.id, "replica_removed")
        with contextlib.suppress(Exception):
            await member.client.close()

    def _log(self, message: str, url: str, event: str) -> None:
        logger.info(message, url, self._name, extra={
            "event": event, "replica": url, "deployment": self._name})

    async def close(self) -> None:
        """Stop following (members leaving now are left as they are)."""
        tasks = [t for t in (self._task, *self._leaving.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._task = None
        self._leaving.clear()

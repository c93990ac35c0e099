"""DNS discovery end to end (issue 24 §3): a real DNS server on 127.0.0.1 (dnslib) holds one
name with two addresses, 127.0.0.2 and 127.0.0.3, and a mock replica (the replica
protocol on a timer) listens on each on the same port. A pool that finds its members by
`dns+http://NAME:PORT` through that server spreads requests over both; when one address
leaves the name, its member drains (its open stream ends whole) and leaves the pool, and
no request fails."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import require_service
from tokenyard.balancer.discovery import Discovery, dns_source, make_resolver
from tokenyard.balancer.pool import Pool
from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.bench.mock_core import MockConfig
from tokenyard.bench.mock_replica import MockReplica
from tokenyard.deployments import BalancerSpec
from tokenyard.wire.sampling_params import SamplingParams

NAME = "tokenyard-engine.default.svc.cluster.local"
ADDRESSES = ["127.0.0.2", "127.0.0.3"]


class Zone:
    """A dnslib resolver answering A queries for NAME from a list the test changes."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.queries = 0

    def resolve(self, request: Any, handler: Any) -> Any:
        from dnslib import QTYPE, RCODE, RR, A

        reply = request.reply()
        qname = str(request.q.qname).rstrip(".")
        self.queries += 1
        if qname != NAME:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for address in list(self.addresses):
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=1))
        return reply


@pytest.fixture()
def dns_server() -> Iterator[tuple[str, Zone]]:
    try:
        from dnslib.server import DNSServer
    except ImportError:
        require_service("dnslib", False, "dnslib is not installed (the dev extra pins it)")
        raise
    zone = Zone(list(ADDRESSES))
    server = DNSServer(zone, address="127.0.0.1", port=0)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server.server_address[1]}", zone
    finally:
        server.server.shutdown()
        server.server.server_close()


def _free_port_on_both() -> int:
    """A port free on 127.0.0.2 and 127.0.0.3 (the whole of 127/8 is loopback)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((ADDRESSES[0], 0))
            port = int(probe.getsockname()[1])
            with socket.socket() as other:
                try:
                    other.bind((ADDRESSES[1], port))
                except OSError:
                    continue
        return port
    raise RuntimeError("no port free on both addresses")


@contextlib.asynccontextmanager
async def _replicas(port: int, config: MockConfig) -> AsyncIterator[list[MockReplica]]:
    runners, mocks = [], []
    try:
        for address in ADDRESSES:
            mock = MockReplica(config)
            runner = web.AppRunner(mock.make_app(), access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            await web.TCPSite(runner, address, port).start()
            runners.append(runner)
            mocks.append(mock)
        yield mocks
    finally:
        for runner in runners:
            await runner.cleanup()


def test_two_addresses_behind_one_name_then_one_vanishes(
        dns_server: tuple[str, Zone]) -> None:
    server, zone = dns_server

    async def scenario() -> None:
        port = _free_port_on_both()
        async with _replicas(port, MockConfig(output_len=8, itl_ms=20)):
            found = Discovery(
                dns_source([f"dns+http://{NAME}:{port}"], make_resolver(server)),
                lambda url: ReplicaClient(url), interval_s=0.2)
            members = await found.initial()
            assert [url for url, _ in members] == [f"http://{a}:{port}" for a in ADDRESSES]
            pool = Pool("dep", members, BalancerSpec(policy="round_robin",
                                                     health_interval_s=0))
            found.attach(pool)
            pool.watchers.append(found)
            try:
                before = [m.served for m in pool.members]
                results = await asyncio.gather(*(_count(pool, f"a{i}") for i in range(6)))
                assert all(n == 8 for n in results)
                served = [m.served - b for m, b in zip(pool.members, before, strict=True)]
                assert all(s > 0 for s in served), served  # spread over both addresses
                # A long stream on each member; .3 leaves the name meanwhile.
                streams = [asyncio.create_task(_count(pool, f"long{i}", 40))
                           for i in range(2)]
                await asyncio.sleep(0.1)
                assert all(m.inflight for m in pool.members)
                zone.addresses = [ADDRESSES[0]]
                gone = f"http://{ADDRESSES[1]}:{port}"
                for _ in range(100):  # the next rounds (0.2 s apart) see it gone
                    if any(m.id == gone and m.draining for m in pool.members):
                        break
                    await asyncio.sleep(0.05)
                leaving = next(m for m in pool.members if m.id == gone)
                assert leaving.draining and leaving.inflight == 1
                during = await asyncio.gather(*(_count(pool, f"b{i}") for i in range(4)))
                assert during == [8] * 4  # new requests: the remaining member
                assert await asyncio.gather(*streams) == [40, 40]  # the drained one ended whole
                for _ in range(100):
                    if len(pool.members) == 1:
                        break
                    await asyncio.sleep(0.05)
                assert [m.id for m in pool.members] == [f"http://{ADDRESSES[0]}:{port}"]
                assert sum(m.failed for m in pool.members) == 0
                zone.addresses = list(ADDRESSES)  # back: it joins again
                for _ in range(100):
                    if len(pool.members) == 2:
                        break
                    await asyncio.sleep(0.05)
                assert len(pool.members) == 2
                assert zone.queries > 4
            finally:
                await pool.close()

    asyncio.run(scenario())


async def _count(pool: Pool, request_id: str, max_tokens: int = 8) -> int:
    count = 0
    async for delta in pool.generate(request_id, list(range(100, 140)),
                                     SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
        count += len(delta.new_token_ids)
    return count


def test_serve_fleet_file_with_a_dns_entry_follows_the_name(
        dns_server: tuple[str, Zone]) -> None:
    """`serve`'s own path (`FleetBuilder.served`): the fleet file's `dns+http://` entry and
    `balancer.dns_server` give the deployment a pool of every address, kept following."""
    from tokenyard.cli.fleet import FleetBuilder
    from tokenyard.config import ServeConfig, default_cache_dir
    from tokenyard.deployments import parse_fleet

    server, zone = dns_server

    async def unused_starter(*_: Any) -> Any:
        raise AssertionError("a deployment found by DNS starts no local child")

    async def scenario() -> None:
        port = _free_port_on_both()
        fleet_spec = parse_fleet({
            "balancer": {"dns_server": server, "discovery_interval_s": 0.2},
            "deployments": [{"name": "dep", "urls": [f"dns+http://{NAME}:{port}"]}]})
        config = ServeConfig.from_env(replica_token="dns-test-token")
        async with _replicas(port, MockConfig(output_len=8, itl_ms=1)):
            fleet = FleetBuilder(fleet_spec, unused_starter, config, default_cache_dir())
            served = await fleet.served(fleet_spec.deployments["dep"])
            try:
                pool = served.pool
                assert [m.id for m in pool.members] == [
                    f"http://{a}:{port}" for a in ADDRESSES]
                assert await _count(pool, "r1") == 8
                zone.addresses = [ADDRESSES[1]]
                for _ in range(100):
                    if len(pool.members) == 1:
                        break
                    await asyncio.sleep(0.05)
                assert [m.id for m in pool.members] == [f"http://{ADDRESSES[1]}:{port}"]
            finally:
                await served.pool.close()

    asyncio.run(scenario())

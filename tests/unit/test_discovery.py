"""Replicas found by name (`balancer/discovery.py`, `balancer/dns_query.py`): members that
appear join the pool, members that vanish drain and leave once their requests ended, a
failed lookup changes nothing. The lookup is injected here (a dict of names); the real
DNS path is tests/integration/test_dns_discovery.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.unit.test_pool import FakeReplica, assert_no_leases, collect, make_pool, open_stream
from tokenyard.balancer.discovery import (
    Discovery,
    DnsTarget,
    dns_source,
    is_dns_url,
    system_resolve,
)
from tokenyard.balancer.dns_query import AAAA, A, decode_answers, encode_query, split_server
from tokenyard.balancer.members import Member
from tokenyard.balancer.pool import Pool
from tokenyard.deployments import parse_fleet
from tokenyard.fleet_values import FleetConfigError

NAME = "tokenyard-engine.default.svc.cluster.local"


class Names:
    """An injectable resolver: host → addresses, changed by the test; `broken` fails."""

    def __init__(self, **names: list[str]) -> None:
        self.names = {k.replace("_", "-"): v for k, v in names.items()}
        self.broken = False
        self.asked: list[str] = []

    async def __call__(self, host: str) -> list[str]:
        self.asked.append(host)
        if self.broken:
            raise OSError("the DNS server is down")
        return list(self.names.get(host, []))


def test_dns_target_parses_and_builds_member_urls() -> None:
    target = DnsTarget.parse(f"dns+http://{NAME}:8001")
    assert (target.scheme, target.host, target.port, target.path) == ("http", NAME, 8001, "")
    assert target.url("10.1.2.3") == "http://10.1.2.3:8001"
    assert target.url("fd00::7") == "http://[fd00::7]:8001"
    assert DnsTarget.parse("dns+https://up.example:443/v1/").url("1.2.3.4") == (
        "https://1.2.3.4:443/v1")
    assert is_dns_url("dns+http://x:1") and not is_dns_url("http://x:1")
    for bad in ("dns+http://name", "dns+ftp://name:1", "http://name:1"):
        with pytest.raises(ValueError, match="DNS entry"):
            DnsTarget.parse(bad)


def test_fleet_file_accepts_dns_urls_and_discovery_settings() -> None:
    fleet = parse_fleet({
        "balancer": {"discovery_interval_s": 2, "dns_server": "10.96.0.10:53"},
        "deployments": [{"name": "m", "urls": [f"dns+http://{NAME}:8001"]}]})
    assert fleet.deployments["m"].urls == (f"dns+http://{NAME}:8001",)
    assert (fleet.balancer.discovery_interval_s, fleet.balancer.dns_server) == (
        2, "10.96.0.10:53")
    with pytest.raises(FleetConfigError, match="not an http"):
        parse_fleet({"deployments": [{"name": "m", "urls": ["dns+ftp://x:1"]}]})
    with pytest.raises(FleetConfigError, match="dns_server"):
        parse_fleet({"balancer": {"dns_server": 53},
                     "deployments": [{"name": "m", "urls": ["http://x:1"]}]})
    with pytest.raises(FleetConfigError, match="discovery_interval_s"):
        parse_fleet({"balancer": {"discovery_interval_s": -1},
                     "deployments": [{"name": "m", "urls": ["http://x:1"]}]})


def test_dns_source_lists_every_address_of_every_name_once() -> None:
    names = Names(a=["127.0.0.3", "127.0.0.2"], b=["127.0.0.2", "::1"])
    source = dns_source(["dns+http://a:8001", "dns+http://b:8001/x", "dns+http://a:8001"],
                        names)
    assert asyncio.run(source()) == [
        "http://127.0.0.2:8001", "http://127.0.0.2:8001/x", "http://127.0.0.3:8001",
        "http://[::1]:8001/x"]


async def _followed(names: Names) -> tuple[Discovery, Pool, dict[str, FakeReplica]]:
    """A pool whose members follow `names` (refreshed by the test: the hour-long interval
    never comes round), and the fake replica made for each URL (the newest)."""
    made: dict[str, FakeReplica] = {}

    def client(url: str) -> FakeReplica:
        made[url] = FakeReplica(url)
        return made[url]

    found = Discovery(dns_source([f"dns+http://{NAME}:8001"], names), client,
                      interval_s=3600)
    pool = make_pool()
    pool.members[:] = [Member(u, c) for u, c in await found.initial()]
    found.attach(pool)
    pool.watchers.append(found)
    return found, pool, made


def test_vanished_member_drains_its_stream_then_leaves_and_new_ones_join() -> None:
    async def scenario() -> None:
        names = Names(**{NAME: ["127.0.0.2", "127.0.0.3"]})
        found, pool, made = await _followed(names)
        assert [m.id for m in pool.members] == ["http://127.0.0.2:8001",
                                                "http://127.0.0.3:8001"]
        gate = asyncio.Event()  # holds a stream after its first item
        for replica in made.values():
            replica.gate = gate
        stream = open_stream(pool, "held")
        await anext(stream)
        victim = next(m for m in pool.members if m.inflight)
        other = next(m for m in pool.members if m is not victim)
        names.names[NAME] = [other.id.split("//")[1].split(":")[0]]
        await found.refresh()
        assert victim.draining and victim in pool.members  # still there: its stream runs
        made[other.id].gate = None
        for i in range(4):  # new work goes only to the member that is still named
            assert (await collect(pool, f"r{i}"))[0].startswith(other.id)
        gate.set()
        assert len([item async for item in stream]) == 2  # the held stream ended whole
        for _ in range(100):
            if len(pool.members) == 1:
                break
            await asyncio.sleep(0.02)
        assert pool.members == [other]
        assert made[victim.id].closed
        # It comes back: a new member (a fresh client) joins.
        names.names[NAME] = ["127.0.0.2", "127.0.0.3"]
        await found.refresh()
        assert sorted(m.id for m in pool.members) == sorted([victim.id, other.id])
        assert not any(m.draining for m in pool.members)
        assert not made[victim.id].closed  # the new client
        assert_no_leases(pool)
        await pool.close()  # closes the discovery too (a watcher of the pool)
        assert found._task is None

    asyncio.run(scenario())


def test_failed_lookup_keeps_members_and_reappearing_one_is_back_in_service() -> None:
    async def scenario() -> None:
        names = Names(**{NAME: ["127.0.0.2", "127.0.0.3"]})
        found, pool, made = await _followed(names)
        names.broken = True
        with pytest.raises(OSError):
            await found.refresh()
        assert [m.draining for m in pool.members] == [False, False]
        names.broken = False
        # .3 vanishes while a request holds it, then comes back before it ended.
        gate = asyncio.Event()
        for replica in made.values():
            replica.gate = gate
        stream = open_stream(pool, "held")
        await anext(stream)
        busy = next(m for m in pool.members if m.inflight)
        names.names[NAME] = [a for a in ("127.0.0.2", "127.0.0.3") if a not in busy.id]
        await found.refresh()
        assert busy.draining
        names.names[NAME] = ["127.0.0.2", "127.0.0.3"]
        await found.refresh()
        assert not busy.draining and busy in pool.members
        gate.set()
        assert len([item async for item in stream]) == 2
        await asyncio.sleep(0.1)
        assert len(pool.members) == 2  # its leaving was called off
        await found.close()
        await pool.close()

    asyncio.run(scenario())


def test_dns_packets_round_trip() -> None:
    query = encode_query("a.example", A, 0x1234)
    assert query[:2] == b"\x12\x34" and query.endswith(b"\x00\x01\x00\x01")
    # An answer: header, the question, two A records with a compressed name (0xc00c).
    answer = (b"\x12\x34\x81\x80\x00\x01\x00\x02\x00\x00\x00\x00" + query[12:]
              + b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04" + bytes([127, 0, 0, 2])
              + b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04" + bytes([127, 0, 0, 3]))
    assert decode_answers(answer, 0x1234, A) == ["127.0.0.2", "127.0.0.3"]
    nxdomain = b"\x12\x34\x81\x83\x00\x01\x00\x00\x00\x00\x00\x00" + query[12:]
    assert decode_answers(nxdomain, 0x1234, A) == []
    assert decode_answers(answer.replace(bytes([127, 0, 0, 2]), b"\0" * 4), 0x1234,
                          AAAA) == []  # no AAAA among them
    assert split_server("10.96.0.10") == ("10.96.0.10", 53)
    assert split_server("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert split_server("[::1]:5353") == ("::1", 5353)


def test_system_resolver_knows_localhost_and_not_a_made_up_name() -> None:
    addresses = asyncio.run(system_resolve("localhost"))
    assert {"127.0.0.1", "::1"} & set(addresses)
    try:
        assert asyncio.run(system_resolve("no-such-host.invalid")) == []
    except socket.gaierror as exc:  # a sandbox without any resolver answers so
        pytest.skip(f"no resolver here: {exc}")

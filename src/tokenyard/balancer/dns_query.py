"""A stub DNS lookup over UDP (RFC 1035): the A and AAAA addresses of one name, asked of
one named server. The balancer's discovery uses it when the fleet file names a
`dns_server` (a cluster's DNS, or a test's); otherwise the system resolver answers.
Only what a lookup needs: one question, answers read (compressed names skipped), no
recursion of our own and no cache (the server has one; discovery asks every few seconds).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct

A, AAAA = 1, 28
_FAMILY = {A: socket.AF_INET, AAAA: socket.AF_INET6}
_NXDOMAIN = 3


class DnsLookupError(OSError):
    """The server did not answer, or answered with an error other than "no such name"."""


def split_server(server: str) -> tuple[str, int]:
    """`host`, `host:port`, `[v6]:port` or a bare IPv6 address → (host, port; 53 default)."""
    if server.startswith("["):
        host, _, rest = server[1:].partition("]")
        return host, int(rest.lstrip(":") or 53)
    if server.count(":") == 1:
        host, port = server.split(":")
        return host, int(port)
    return server, 53


def encode_query(name: str, qtype: int, qid: int) -> bytes:
    """One standard query (recursion desired) for `name`'s records of `qtype`."""
    labels = [label.encode("idna") for label in name.rstrip(".").split(".") if label]
    if any(len(label) > 63 for label in labels):
        raise ValueError(f"{name!r}: a DNS label has at most 63 bytes")
    question = b"".join(bytes([len(label)]) + label for label in labels) + b"\0"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question + struct.pack(
        "!HH", qtype, 1)


def _skip_name(packet: bytes, offset: int) -> int:
    while True:
        length = packet[offset]
        if length == 0:
            return offset + 1
        if length & 0xC0 == 0xC0:  # a pointer ends the name
            return offset + 2
        offset += length + 1


def decode_answers(packet: bytes, qid: int, qtype: int) -> list[str]:
    """The addresses of `qtype` in a response to query `qid` ([] for "no such name")."""
    rid, flags, questions, answers, _, _ = struct.unpack_from("!HHHHHH", packet)
    if rid != qid or not flags & 0x8000:
        raise DnsLookupError("a DNS packet that is not the answer to our query")
    rcode = flags & 0xF
    if rcode == _NXDOMAIN:
        return []
    if rcode:
        raise DnsLookupError(f"the DNS server answered with error code {rcode}")
    offset = 12
    for _ in range(questions):
        offset = _skip_name(packet, offset) + 4
    found = []
    for _ in range(answers):
        offset = _skip_name(packet, offset)
        rtype, _cls, _ttl, size = struct.unpack_from("!HHIH", packet, offset)
        offset += 10
        if rtype == qtype:  # CNAMEs on the way are skipped: their targets' records follow
            found.append(socket.inet_ntop(_FAMILY[qtype], packet[offset:offset + size]))
        offset += size
    return found


class _Answer(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.packet: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: object) -> None:
        if not self.packet.done():
            self.packet.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.packet.done():
            self.packet.set_exception(exc)


async def _ask(server: tuple[str, int], name: str, qtype: int, timeout_s: float) -> list[str]:
    qid = secrets.randbelow(0x10000)
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(_Answer, remote_addr=server)
    try:
        transport.sendto(encode_query(name, qtype, qid))
        async with asyncio.timeout(timeout_s):
            return decode_answers(await protocol.packet, qid, qtype)
    except TimeoutError:
        raise DnsLookupError(f"no answer from the DNS server {server[0]}:{server[1]}") from None
    finally:
        transport.close()


async def lookup(server: str, name: str, timeout_s: float = 2.0) -> list[str]:
    """Every A and AAAA address of `name` according to `server` (`host[:port]`)."""
    where = split_server(server)
    v4, v6 = await asyncio.gather(_ask(where, name, A, timeout_s),
                                  _ask(where, name, AAAA, timeout_s))
    return [*v4, *v6]

"""Fetching an image URL safely, for the gateway's image input (`api/images.py`).

The rules:

- URLs: http and https only; the host is resolved once, here, and refused if any of its
  addresses is not public (`is_public_address`: loopback, private, link-local and the
  cloud metadata address, CGNAT, multicast, reserved, and IPv6 forms embedding those);
  the connection goes to exactly those addresses, so a second lookup cannot rebind it;
  redirects are followed by hand, at most `max_redirects`, each hop checked afresh; the
  whole fetch has a deadline and the body a byte cap enforced while it streams.

The address policy and the resolver are parameters, so tests can serve images from
127.0.0.1 and point names anywhere without touching the default, which refuses both.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: Whether the gateway may connect to an address.
AddressPolicy = Callable[[IPAddress], bool]
#: (host, port) → every address the host resolves to, as strings.
Resolver = Callable[[str, int], Awaitable[list[str]]]

_SCHEMES = frozenset({"http", "https"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
#: Longest URL (or data URI prefix) accepted.
MAX_URL_CHARS = 8192
_CHUNK = 64 * 1024


MiB = 1024 * 1024


@dataclass(frozen=True)
class ImageLimits:
    """Caps on one image and on a request's images; sizes in bytes, times in seconds.

    They bound what one request's images can cost the gateway: its images load one after
    another (`api/images.py`), so at most one fetched image (`max_bytes`), one decode
    (`max_decode_bytes`, Pillow's pixels and the decoder's own buffers) with its scaled
    copy (at most `output_side` squared, 4 bytes a pixel) and the re-encodings kept so
    far (`max_total_bytes`) are held at once: about 100 MiB at worst.

    - `max_side`, `max_pixels`: the size a header may declare (checked before decoding);
    - `max_decode_bytes`: the memory one decode may take. A large JPEG is decoded at a
      reduced scale (libjpeg's 1/2, 1/4, 1/8) when it is to be scaled down anyway, so
      JPEGs up to `max_side` a side pass; PNG, GIF and WebP decode in full, so it caps
      their pixels (about 12.5 million for RGB or RGBA, 3 million for WebP, which
      libwebp decodes through four RGBA canvases);
    - `output_side`: the long side of what goes on; larger images are scaled down to fit
      (OpenAI's high detail fits images into 2048x2048, Anthropic into 1568 a side);
    - `max_total_bytes`: a request's images once re-encoded, in all.
    """

    max_bytes: int = 20 * MiB
    max_side: int = 8000
    max_pixels: int = 8000 * 8000
    max_decode_bytes: int = 48 * MiB
    output_side: int = 2048
    max_total_bytes: int = 16 * MiB
    max_images: int = 20
    timeout_s: float = 10.0
    max_redirects: int = 3


DEFAULT_LIMITS = ImageLimits()


class ImageRejected(ValueError):
    """An image source or its bytes broke a rule; the message says which, for the client."""


# ---------------------------------------------------------------------------- addresses

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_public_address(address: IPAddress) -> bool:
    """Whether `address` is a public unicast address (the default policy).

    IPv6 addresses that carry an IPv4 one (mapped, 6to4, Teredo, NAT64) are judged by
    the IPv4 address they reach."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded: list[ipaddress.IPv4Address] = []
        if address.ipv4_mapped is not None:
            embedded.append(address.ipv4_mapped)
        if address.sixtofour is not None:
            embedded.append(address.sixtofour)
        if address.teredo is not None:
            embedded.extend(address.teredo)
        if address in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        if embedded:
            return all(is_public_address(a) for a in embedded)
    elif address in _CGNAT:
        return False
    return address.is_global and not (
        address.is_multicast or address.is_reserved or address.is_loopback
        or address.is_link_local or address.is_private or address.is_unspecified
    )


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address of `host` from the system's resolver (getaddrinfo)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    )
    return [str(info[4][0]) for info in infos]


class _PinnedResolver(AbstractResolver):
    """aiohttp's resolver for one connection: the addresses we already checked, only."""

    def __init__(self, host: str, addresses: Sequence[IPAddress]) -> None:
        self._host = host
        self._addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host != self._host:
            raise OSError(f"{host!r} was not resolved for this fetch")
        return [
            ResolveResult(
                hostname=host, host=str(a), port=port,
                family=socket.AF_INET6 if a.version == 6 else socket.AF_INET,
                proto=0, flags=socket.AI_NUMERICHOST,
            )
            for a in self._addresses
        ]

    async def close(self) -> None:
        return None


async def checked_addresses(
    url: URL, allow: AddressPolicy, resolve: Resolver, what: str = "image URL"
) -> list[IPAddress]:
    """Every address `url`'s host resolves to, all allowed by `allow`; ImageRejected
    naming `what` (the kind of URL, for the message) otherwise. The MCP client
    (`api/mcp_client.py`) checks a tool server's URL with it too."""
    host = url.raw_host
    if not host:
        raise ImageRejected(f"the {what} has no host.")
    try:
        found = await resolve(host, url.port or 0)
    except OSError as exc:
        raise ImageRejected(f"the {what}'s host {host!r} does not resolve.") from exc
    addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in found]
    if not addresses:
        raise ImageRejected(f"the {what}'s host {host!r} does not resolve.")
    for address in addresses:
        if not allow(address):
            raise ImageRejected(
                f"the {what}'s host {host!r} resolves to {address}, which is not a "
                "public address."
            )
    return addresses


# ---------------------------------------------------------------------------- fetching


def check_url(url: str, what: str = "image URL") -> URL:
    """`url` parsed, when it is an http(s) URL with a host; ImageRejected (naming `what`)
    otherwise."""
    if len(url) > MAX_URL_CHARS:
        raise ImageRejected(f"the {what} is longer than {MAX_URL_CHARS} characters.")
    try:
        parsed = URL(url)
    except ValueError as exc:
        raise ImageRejected(f"the {what} is not a valid URL.") from exc
    if parsed.scheme not in _SCHEMES:
        raise ImageRejected(f"{what}s must use http or https"
                            + (" (or be a base64 data URI)." if what == "image URL" else "."))
    if not parsed.raw_host:
        raise ImageRejected(f"the {what} has no host.")
    return parsed


async def _read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body, refused as soon as it passes `max_bytes`. Gathered in a BytesIO, whose
    getvalue hands over its buffer: a bytearray's bytes() would hold the body twice."""
    too_big = f"the image is larger than {max_bytes} bytes."
    if response.content_length is not None and response.content_length > max_bytes:
        raise ImageRejected(too_big)
    body = io.BytesIO()
    async for chunk in response.content.iter_chunked(_CHUNK):
        if body.tell() + len(chunk) > max_bytes:
            raise ImageRejected(too_big)
        body.write(chunk)
    return body.getvalue()


def _joined(base: URL, location: str) -> str:
    try:
        return str(base.join(URL(location)))
    except ValueError as exc:
        raise ImageRejected("the image URL redirects to an invalid URL.") from exc


async def _fetch_hops(
    url: str, allow: AddressPolicy, resolve: Resolver, limits: ImageLimits
) -> bytes:
    current = check_url(url)
    for _ in range(limits.max_redirects + 1):
        addresses = await checked_addresses(current, allow, resolve)
        assert current.raw_host is not None  # checked by check_url
        connector = aiohttp.TCPConnector(
            resolver=_PinnedResolver(current.raw_host, addresses), use_dns_cache=False,
            force_close=True,
        )
        # No proxies from the environment, no transparent decompression (a gzip bomb).
        async with aiohttp.ClientSession(
            connector=connector, trust_env=False, auto_decompress=False
        ) as session, session.get(
            current, allow_redirects=False,
            headers={"Accept": "image/*", "Accept-Encoding": "identity"},
        ) as response:
            if response.status in _REDIRECTS:
                location = response.headers.get("Location")
                if not location:
                    raise ImageRejected("the image URL redirects without a Location.")
                current = check_url(_joined(current, location))
                continue
            if response.status != 200:
                raise ImageRejected(f"fetching the image URL answered HTTP {response.status}.")
            return await _read_capped(response, limits.max_bytes)
    raise ImageRejected(f"the image URL redirects more than {limits.max_redirects} times.")


async def fetch_image_bytes(
    url: str,
    *,
    allow: AddressPolicy = is_public_address,
    resolve: Resolver = system_resolver,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> bytes:
    """The body at `url`, fetched under the rules above (deadline: `limits.timeout_s`)."""
    try:
        async with asyncio.timeout(limits.timeout_s):
            return await _fetch_hops(url, allow, resolve, limits)
    except TimeoutError:
        raise ImageRejected(
            f"fetching the image URL took longer than {limits.timeout_s:g} s."
        ) from None
    except aiohttp.ClientError as exc:
        raise ImageRejected(f"the image URL could not be fetched ({type(exc).__name__}).") \
            from None

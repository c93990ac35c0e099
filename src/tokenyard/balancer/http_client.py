"""What every client of a replica or upstream shares: one pooled aiohttp session created
on first use (in the running event loop), a health probe, and closing."""

from __future__ import annotations

from types import TracebackType
from typing import Self

import aiohttp


class PooledClient:
    """A base URL, its pooled session and the timeouts of its calls.

    `request_timeout` bounds the small calls; a stream has no total timeout (a long
    generation is legitimate) but, with `read_timeout`, a bound on each silence.
    `max_connections` 0 means unbounded: streams, not this pool, are the limit."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
        read_timeout: float | None = None,
        max_connections: int = 0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._read_timeout = read_timeout
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        #: Responses whose bodies are being read: `close` fails their readers (closing
        #: a connection alone leaves them waiting for bytes a lost peer never sends).
        self._streams: set[aiohttp.ClientResponse] = set()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self._connect_timeout,
                    sock_connect=self._connect_timeout, sock_read=self._read_timeout,
                ),
            )
        return self._session

    async def _probe(self, path: str, headers: dict[str, str] | None = None) -> bool:
        """True if ``GET path`` answers 200 within the request timeout."""
        try:
            async with self._get_session().get(
                self.base_url + path, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self._request_timeout),
            ) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        """Close the pooled connections; open streams end with ClientConnectionError."""
        for response in self._streams:
            response.content.set_exception(
                aiohttp.ClientConnectionError("the client was closed"))
        self._streams.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

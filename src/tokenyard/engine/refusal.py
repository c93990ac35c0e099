"""A generate request the replica turns away before it begins, whichever way it came
(its own HTTP call, or the gateway's multiplexed channel), and the replica's JSON answers."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tokenyard.wire.protocol import dumps, error_body


def json_answer(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=dumps(obj), status=status, content_type="application/json", headers=headers
    )


class Refused(Exception):
    """A generate request turned away before it began: the route's non-200 answer."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.retry_after = status, code, param, retry_after

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.code, self.param)

    def response(self) -> web.Response:
        headers = None if self.retry_after is None else {"Retry-After": f"{self.retry_after:g}"}
        return json_answer(self.body(), status=self.status, headers=headers)

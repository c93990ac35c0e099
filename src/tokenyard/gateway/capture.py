"""Body capture of a generating request, for the orgs that turned it on.

The pipeline decides once, after admission, from the gateway's in-memory list of
capturing orgs (no database read); for every other request there is no capture and
nothing below runs. The response captured is the body the client got; for a stream, the
body the same request would have got unstreamed, built by the dialect from the deltas
the stream sent. Redaction, cutting and the write happen in the request log, off the
request path (`gateway/requests.py`). A request that failed or was cancelled is captured
without a response.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenyard.gateway.call import Generating
from tokenyard.gateway.requests import RequestLog
from tokenyard.store.records import KeyContext
from tokenyard.wire.outputs import Completion, RequestOutput


class BodyCapture:
    """One request's bodies on their way to the request log."""

    def __init__(self, log: RequestLog, request_id: str, key: KeyContext, raw: bytes) -> None:
        self.log, self.request_id, self.key, self.raw = log, request_id, key, raw
        self.completions: list[list[Completion]] = []
        self.sent = False

    def watch(self, gens: Sequence[Generating]) -> None:
        """Collect a stream's deltas from now on (`add`)."""
        self.completions = [[Completion(index=j) for j in range(gen.params.n)] for gen in gens]

    def add(self, index: int, out: RequestOutput) -> None:
        if self.completions:
            for delta in out.deltas:
                self.completions[index][delta.index].add(delta)

    def send(self, response: Any) -> None:
        """Queue the bodies (`response` None: none was made), once."""
        if not self.sent:
            self.sent = True
            self.log.capture(self.request_id, self.key, self.raw, response)

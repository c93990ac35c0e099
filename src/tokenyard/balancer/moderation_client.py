"""The client of an external OpenAI-compatible moderation endpoint (`POST /v1/moderations`).

One call classifies a list of texts; the answer is plain values, one `Moderated` per
text in order. Failures (unreachable, a non-200, a body of the wrong shape) raise
`ModerationUnavailable`, which the gateway turns into its own error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from tokenyard.balancer.http_client import PooledClient


class ModerationUnavailable(Exception):
    """The moderation upstream could not answer."""


@dataclass(frozen=True)
class Moderated:
    """One text's result as the upstream gave it."""

    flagged: bool
    categories: dict[str, bool]
    scores: dict[str, float]


class ModerationClient(PooledClient):
    """`POST {base_url}/moderations` with `model` and a bearer `token` (both optional);
    `base_url` ends in `/v1` as an OpenAI client's does."""

    def __init__(self, base_url: str, *, model: str | None = None, token: str | None = None,
                 request_timeout: float = 10.0) -> None:
        super().__init__(base_url, request_timeout=request_timeout)
        self.model = model
        self.token = token

    async def moderate(self, texts: Sequence[str]) -> list[Moderated]:
        body: dict[str, Any] = {"input": list(texts)}
        if self.model:
            body["model"] = self.model
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            async with self._get_session().post(
                self.base_url + "/moderations", json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self._request_timeout),
            ) as response:
                if response.status != 200:
                    text = (await response.text())[:200]
                    raise ModerationUnavailable(f"HTTP {response.status}: {text}")
                data = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ModerationUnavailable(str(exc) or type(exc).__name__) from None
        return _results(data, len(texts))


def _results(data: Any, count: int) -> list[Moderated]:
    """The `results` of a moderation response, checked to hold `count` entries."""
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list) or len(results) != count:
        raise ModerationUnavailable(f"expected {count} results, got {results!r:.200}")
    out = []
    for item in results:
        try:
            out.append(Moderated(
                flagged=bool(item["flagged"]),
                categories={str(k): bool(v) for k, v in item["categories"].items()},
                scores={str(k): float(v) for k, v in item["category_scores"].items()},
            ))
        except (KeyError, TypeError, AttributeError, ValueError):
            raise ModerationUnavailable(f"a malformed result: {item!r:.200}") from None
    return out

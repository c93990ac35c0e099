"""Rate-limit headers in each dialect's spelling: OpenAI's `x-ratelimit-*` (resets as
durations) and Anthropic's `anthropic-ratelimit-*` (resets as RFC 3339 times)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from tokenyard.gateway.limits import RateLimitState


def _openai_duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def ratelimit_headers(state: RateLimitState, anthropic: bool) -> dict[str, str]:
    """`x-ratelimit-*` (OpenAI routes) or `anthropic-ratelimit-*` headers for `state`."""
    out: dict[str, str] = {}
    now = datetime.now(UTC)
    for kind, limit, remaining, reset in (
        ("requests", state.limit_requests, state.remaining_requests, state.reset_requests),
        ("tokens", state.limit_tokens, state.remaining_tokens, state.reset_tokens),
    ):
        if limit is None or remaining is None or reset is None:
            continue
        if anthropic:
            at = (now + timedelta(seconds=reset)).replace(microsecond=0)
            out[f"anthropic-ratelimit-{kind}-limit"] = str(limit)
            out[f"anthropic-ratelimit-{kind}-remaining"] = str(remaining)
            out[f"anthropic-ratelimit-{kind}-reset"] = at.isoformat().replace("+00:00", "Z")
        else:
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            out[f"x-ratelimit-reset-{kind}"] = _openai_duration(reset)
    return out

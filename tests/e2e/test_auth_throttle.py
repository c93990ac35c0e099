"""Key guessing from one address is throttled through the public routes: after N failed
authentications every request from that address (a good key too) gets 429 with
retry-after, in each dialect's shape, while the window lasts."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.e2e.conftest import running_server


def test_failed_keys_from_one_address_are_throttled_then_refused() -> None:
    with running_server(env={"TOKENYARD_AUTH_FAILURES_PER_MINUTE": "3"}) as (srv, _):
        guesser = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sk-guess",
                                max_retries=0)
        for _ in range(3):
            with pytest.raises(openai.AuthenticationError):
                guesser.models.list()
        with pytest.raises(openai.RateLimitError) as refused:
            guesser.models.list()
        assert "failed authentication" in refused.value.message
        assert 0 < int(refused.value.response.headers["retry-after"]) <= 60
        # The good key from the same address waits too: a guess must not learn it hit.
        owner = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=srv.api_key,
                              max_retries=0)
        with pytest.raises(openai.RateLimitError):
            owner.models.list()
        claude = anthropic.Anthropic(base_url=srv.base_url, api_key=srv.api_key or "",
                                     max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as anthropic_refused:
            claude.messages.create(model=srv.model, max_tokens=1,
                                   messages=[{"role": "user", "content": "hi"}])
        assert anthropic_refused.value.body["error"]["type"] == "rate_limit_error"
        # Probes stay open: they need no key.
        assert openai.OpenAI(base_url=srv.base_url, api_key="x").get(
            "/healthz", cast_to=object) is not None

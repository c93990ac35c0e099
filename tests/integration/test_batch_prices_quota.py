"""A batch's price and its org's quota, through HTTP against `tokenyard serve --config`
in front of the project's mock replica: a deployment whose fleet entry sets
`batch_prices` bills its batch lines at them, one without at half its live prices; the
enqueued-token quota is the gateway's default (`tokenyard serve --batch-enqueued-tokens`:
the lane's settings come from serve's flags) until the org's own is set through
`POST /admin/v1/orgs/{id}/limits`, and a batch over either is a 429 naming it."""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, running_server
from tests.integration.test_upstream_tenancy import _serving
from tests.integration.test_workers import poll
from tokenyard.bench.mock_core import MockConfig
from tokenyard.bench.mock_replica import MockReplica
from tokenyard.store.money import Prices, cost_micros

OWN, HALF = "own-batch-price-2026-12-01", "half-batch-price-2026-12-01"
#: The gateway's default quota in this module: a few lines' worth (each line below is
#: estimated at its bytes / 4 + max_tokens, about 60 tokens).
DEFAULT_QUOTA = 1_000


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    mock = MockReplica(MockConfig(output_len=5, ttft_ms=0.0, itl_ms=0.0))
    with _serving({"mock": mock.make_app()}) as urls, tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tokenyard.toml"
        config.write_text(f"""
[[deployments]]
name = "{OWN}"
kind = "upstream"
urls = ["{urls['mock']}/v1"]
model = "mock"
prices = {{ input = "2", cached_input = "1", output = "4" }}
batch_prices = {{ input = "0.5", cached_input = "0.25", output = "1.5" }}

[[deployments]]
name = "{HALF}"
kind = "upstream"
urls = ["{urls['mock']}/v1"]
model = "mock"
prices = {{ input = "2", cached_input = "1", output = "4" }}
""")
        with running_server("--config", str(config), "--batch-enqueued-tokens",
                            str(DEFAULT_QUOTA)) as (srv, _):
            yield srv


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


def _create(server: Server, model: str, n: int, max_tokens: int = 5) -> str:
    client = _client(server)
    content = "".join(json.dumps({
        "custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": f"Line {i}."}]}}) + "\n"
        for i in range(n)).encode()
    file = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def _admin(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=server.headers, timeout=30)


def _billed(server: Server, batch_id: str, prices: Prices) -> tuple[int, int]:
    """(what the ledger holds for the batch, what its lines cost at `prices`), once every
    line is done and billed."""
    client = _client(server)
    batch = poll(lambda: client.batches.retrieve(batch_id),
                 lambda b: b.status == "completed", 60, "the batch's end")
    assert batch.output_file_id is not None
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    expected = 0
    for line in out:
        usage = line["response"]["body"]["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        expected += cost_micros(prices, usage["prompt_tokens"] - cached, cached,
                                usage["completion_tokens"])

    def report() -> dict[str, Any]:
        r = httpx.get(server.base_url + "/admin/v1/usage?group_by=batch",
                      headers=server.headers, timeout=30)
        assert r.status_code == 200, r.text
        return {row["group"]: row for row in r.json()["data"]}.get(batch_id, {})

    row = poll(report, lambda r: r.get("requests") == len(out), 30, "every line's row")
    return int(row["cost_micros"]), expected


def test_a_deployment_s_own_batch_price_is_billed_else_half_its_live_price(
        server: Server) -> None:
    own = _create(server, OWN, 3)
    half = _create(server, HALF, 3)
    billed, expected = _billed(server, own, Prices(500_000, 250_000, 1_500_000))
    assert billed == expected > 0
    billed, expected = _billed(server, half, Prices(1_000_000, 500_000, 2_000_000))
    assert billed == expected > 0


def test_the_enqueued_token_quota_is_the_default_until_the_org_sets_its_own(
        server: Server) -> None:
    org = "org_default"  # the development key's
    with pytest.raises(openai.RateLimitError) as refused:
        _create(server, HALF, 1, max_tokens=DEFAULT_QUOTA)
    message = refused.value.body["message"]  # type: ignore[index]
    assert "batch_enqueued_tokens" in message and "default" in message
    assert str(DEFAULT_QUOTA) in message
    assert refused.value.response.headers.get("x-should-retry") == "false"

    r = _admin(server, f"/admin/v1/orgs/{org}/limits", {"batch_enqueued_tokens": 100_000})
    assert r.status_code == 200 and r.json()["batch_enqueued_tokens"] == 100_000, r.text
    listed = httpx.get(server.base_url + "/admin/v1/orgs", headers=server.headers).json()
    assert {o["id"]: o for o in listed["data"]}[org]["batch_enqueued_tokens"] == 100_000
    accepted = _create(server, HALF, 1, max_tokens=DEFAULT_QUOTA)
    assert accepted.startswith("batch_")

    r = _admin(server, f"/admin/v1/orgs/{org}/limits", {"batch_enqueued_tokens": 10})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.RateLimitError) as refused:
        _create(server, HALF, 1)
    message = refused.value.body["message"]  # type: ignore[index]
    assert "organization's own" in message and "is 10." in message

    r = _admin(server, f"/admin/v1/orgs/{org}/limits", {"batch_enqueued_tokens": -1})
    assert r.status_code == 400 and "batch_enqueued_tokens" in r.text
    # Limits are replaced whole: without it, the org is back on the default, which
    # holds a small batch once the large one (no longer at work) is done.
    client = _client(server)
    poll(lambda: client.batches.retrieve(accepted), lambda b: b.status == "completed", 60,
         "the large batch's end")
    assert _admin(server, f"/admin/v1/orgs/{org}/limits", {}).status_code == 200
    assert _create(server, HALF, 1).startswith("batch_")


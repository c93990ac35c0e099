"""Every request record names its lane, through HTTP against `make serve`'s server: a
live request's record says `live`, a Batch API line's says `batch`, in
`GET /v1/requests/{id}` and in the admin listing `GET /admin/v1/requests`, which filters
by `lane` (and refuses a lane it does not know, and a key without the admin scope)."""

from __future__ import annotations

import functools
import json
import urllib.request
from typing import Any

import pytest

from tests.conformance.keys import new_key
from tests.e2e.conftest import Server
from tests.e2e.test_admin_http import call
from tests.e2e.test_batches import _client, _record, _upload, _wait

pytestmark = pytest.mark.slow


def _listed(server: Server, query: str) -> list[dict[str, Any]]:
    status, body = call(server, "GET", f"/admin/v1/requests?{query}")
    assert status == 200, body
    return list(body["data"])


def test_a_batch_line_s_record_says_batch_and_a_live_request_s_says_live(
    server: Server,
) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    raw = urllib.request.Request(
        f"{server.base_url}/v1/chat/completions", method="POST",
        data=json.dumps({"model": server.model, "max_tokens": 2,
                         "messages": messages}).encode(),
        headers={"Authorization": f"Bearer {server.api_key}",
                 "Content-Type": "application/json"})
    with urllib.request.urlopen(raw, timeout=120) as response:
        assert response.status == 200
        live_id = response.headers["x-request-id"]

    client = _client(server)
    file_id = _upload(client, [{"custom_id": "one", "method": "POST",
                                "url": "/v1/chat/completions",
                                "body": {"model": server.model, "max_tokens": 2,
                                         "messages": messages}}])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = _wait(functools.partial(client.batches.retrieve, batch.id),
                  lambda b: b.status == "completed")
    assert batch.status == "completed" and batch.output_file_id, batch
    (line,) = [json.loads(x) for x in
               client.files.content(batch.output_file_id).text.splitlines()]
    line_id = line["response"]["request_id"]

    live = _wait(functools.partial(_record, server, live_id), lambda r: r is not None, 30)
    lined = _wait(functools.partial(_record, server, line_id), lambda r: r is not None, 30)
    assert live is not None and live["lane"] == "live", live
    assert lined is not None and lined["lane"] == "batch", lined

    batch_ids = {r["id"]: r["lane"] for r in _listed(server, "lane=batch&limit=1000")}
    assert batch_ids.get(line_id) == "batch" and live_id not in batch_ids
    assert set(batch_ids.values()) == {"batch"}
    live_ids = {r["id"]: r["lane"] for r in _listed(server, "lane=live&limit=1000")}
    assert live_ids.get(live_id) == "live" and line_id not in live_ids
    assert set(live_ids.values()) == {"live"}
    every = {r["id"] for r in _listed(server, "limit=1000")}
    assert {live_id, line_id} <= every
    # The listing is newest first, of one org when asked.
    org = lined["org_id"]
    listed = _listed(server, f"org_id={org}&limit=1000")
    assert listed and {r["org_id"] for r in listed} == {org}
    stamps = [r["created_at"] for r in listed]
    assert stamps == sorted(stamps, reverse=True)


def test_the_listing_checks_its_query_and_needs_the_admin_scope(server: Server) -> None:
    status, body = call(server, "GET", "/admin/v1/requests?lane=overnight")
    assert status == 400 and body["error"]["param"] == "lane", body
    status, body = call(server, "GET", "/admin/v1/requests?limit=0")
    assert status == 400 and body["error"]["param"] == "limit", body
    status, body = call(server, "GET", "/admin/v1/requests?colour=red")
    assert status == 400, body
    status, body = call(server, "GET", "/admin/v1/requests", key=new_key(server))
    assert status == 403, body

"""The operator dashboard at /dashboard in a real browser, and its endpoint
GET /admin/v1/dashboard."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from tests.browser.conftest import call, new_key, screenshot
from tests.e2e.conftest import Server


def chat(server: Server, text: str, **extra: Any) -> tuple[int, dict[str, str], Any]:
    body = {"model": server.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": text}], **extra}
    return call(server, "POST", "/v1/chat/completions", body)


def test_a_finished_request_appears_on_the_dashboard_within_two_seconds(
    page: Any, server: Server,
) -> None:
    page.goto(server.base_url + "/dashboard")
    page.fill("#key", server.api_key or "")
    page.press("#key", "Tab")
    replica = page.locator("#replicas tbody tr").first
    replica.wait_for()
    assert "healthy" in replica.inner_text()
    status, _, refused = chat(server, "Hi", max_tokens=-1)
    assert status == 400, refused
    status, headers, _ = chat(server, "Say hello.")
    assert status == 200
    request_id = headers["x-request-id"]
    finished = time.monotonic()
    row = page.locator(f'#recent tr[data-request-id="{request_id}"]')
    row.wait_for(timeout=2_000)
    assert time.monotonic() - finished < 2.0
    assert "200" in row.inner_text() and server.model in row.inner_text()
    row.locator("button").click()  # its stages
    stages = page.locator("#recent .waterfall .bar-row span:first-child").all_inner_texts()
    assert {"queue", "prefill", "decode"} <= set(stages), stages
    # The refused request is counted by its stage, status and code; the finished one's
    # tokens are in the org's and the model's rows, and its latencies in the percentiles.
    # (Its endpoint's row: a server other tests hammered lists more invalid_value rows.)
    refusals = page.locator("#refusals tbody tr", has_text="invalid_value").filter(
        has_text="/v1/chat/completions")
    refusals.wait_for()
    assert refusals.locator("td").all_inner_texts()[:2] == ["validation", "400"]
    assert page.locator("#by-model tbody tr", has_text=server.model).count() == 1
    assert page.locator("#by-org tbody tr").count() >= 1
    ttft = page.locator("#latency tbody tr", has_text="Time to first token")
    assert ttft.locator("td").last.inner_text() != "0"
    screenshot(page, "dashboard.png")


def test_the_dashboard_endpoint_needs_the_admin_scope_and_checks_its_query(
    server: Server,
) -> None:
    status, _, body = call(server, "GET", "/admin/v1/dashboard",
                           key=new_key(server, "not-an-admin"))
    assert status == 403, body
    status, _, body = call(server, "GET", "/admin/v1/dashboard?recent=lots")
    assert status == 400 and body["error"]["param"] == "recent", body
    # The replica's figures arrive with the pool's first health tick (1 s after start):
    # a test that runs at once, the browser ones before it skipped, waits for it.
    deadline = time.monotonic() + 10
    while True:
        status, _, body = call(server, "GET", "/admin/v1/dashboard?recent=0")
        assert status == 200 and body["requests"]["recent"] == []
        (deployment,) = [d for d in body["deployments"] if d["name"] == server.model]
        (member,) = deployment["replicas"]
        if member["kv_blocks"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert member["state"] == "healthy" and member["kv_blocks"] > 0
    assert set(body["latency"]) == {"ttft_s", "inter_token_s", "e2e_s", "queue_s"}


def test_a_refused_key_is_shown_and_not_polled_again(page: Any, server: Server) -> None:
    # Each refused poll would count toward the gateway's failed-authentication throttle.
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if "/admin/v1/dashboard" in r.url else None)
    page.goto(server.base_url + "/dashboard")
    page.fill("#key", new_key(server, "dashboard-viewer"))
    page.press("#key", "Tab")
    page.locator("#error", has_text="Error 403: ").wait_for()
    assert page.locator("#status").inner_text() == "Give an admin key."
    seen = len(polls)
    page.wait_for_timeout(2_500)
    assert len(polls) == seen, polls


def test_the_lane_switch_shows_live_traffic_by_default_and_batch_lines_on_request(
    page: Any, server: Server,
) -> None:
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if "/admin/v1/dashboard" in r.url else None)
    page.goto(server.base_url + "/dashboard")
    assert page.locator("#lane").input_value() == "live"
    page.fill("#key", server.api_key or "")
    page.press("#key", "Tab")
    page.locator("#status", has_text="live traffic").wait_for()
    status, headers, _ = chat(server, "Say hello.")
    assert status == 200
    row = page.locator(f'#recent tr[data-request-id="{headers["x-request-id"]}"]')
    row.wait_for()
    assert polls and all("lane=live" in url for url in polls), polls
    # Batch lines on request: the live request's row goes, the polls ask for the batch lane.
    page.select_option("#lane", "batch")
    page.locator("#status", has_text="batch lines").wait_for()
    row.wait_for(state="detached")
    assert "lane=batch" in polls[-1], polls
    page.select_option("#lane", "live")
    row.wait_for()


def test_the_page_s_lane_switch_starts_on_live_and_its_endpoint_keeps_lanes_apart(
    server: Server,
) -> None:
    """Without a browser: the page ships the switch (live selected, batch offered), and
    a live request shows in the endpoint's live lane and not in its batch lane."""
    with urllib.request.urlopen(server.base_url + "/dashboard", timeout=30) as response:
        html = response.read().decode()
    switch = html[html.index('<select id="lane"'):html.index("</select>")]
    assert '<option value="live" selected>' in switch and '<option value="batch">' in switch
    status, headers, _ = chat(server, "Say hello.")
    assert status == 200
    request_id = headers["x-request-id"]
    lanes = {}
    for lane in ("live", "batch"):
        status, _, body = call(server, "GET", f"/admin/v1/dashboard?lane={lane}&recent=200")
        assert status == 200 and body["lane"] == lane, body
        lanes[lane] = {r["request_id"] for r in body["requests"]["recent"]}
    assert request_id in lanes["live"] and request_id not in lanes["batch"]

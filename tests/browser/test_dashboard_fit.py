"""The dashboard's recent-requests table fits its panel at 1280 px wide (issue 29 §6): it
used to run past the panel's right edge, its last columns cut off behind a scroll."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from tests.browser.conftest import call
from tests.e2e.conftest import Server

CLIENT_ID = "checkout-service.eu-west-1.pod-7f9c2b4d1"


def _long_request(server: Server) -> str:
    """A request whose row has long values, as real ones do: a 40-character client id
    (the longest the gateway keeps as the id's prefix) and a generated org id; its id."""
    status, _, org = call(server, "POST", "/admin/v1/orgs", {"name": "a-long-named-tenant"})
    assert status in (200, 201), org
    status, _, key = call(server, "POST", "/admin/v1/keys", {"org_id": org["id"], "name": "k"})
    assert status == 201, key
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions", method="POST",
        data=json.dumps({"model": server.model, "max_tokens": 2,
                         "messages": [{"role": "user", "content": "Say hello."}]}).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": CLIENT_ID,
                 "Authorization": f"Bearer {key['secret']}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        request_id = response.headers["x-request-id"]
    assert request_id.startswith(CLIENT_ID + "."), request_id
    return str(request_id)


def test_the_recent_requests_table_fits_its_panel_at_1280_px(page: Any, server: Server) -> None:
    assert page.viewport_size == {"width": 1280, "height": 800}
    request_id = _long_request(server)
    page.goto(server.base_url + "/dashboard")
    page.fill("#key", server.api_key or "")
    page.press("#key", "Tab")
    row = page.locator(f'#recent tr[data-request-id="{request_id}"]')
    row.wait_for()
    fit = page.evaluate("""() => {
        const table = document.querySelector("#recent table");
        const panel = table.closest("section.panel");
        const t = table.getBoundingClientRect(), p = panel.getBoundingClientRect();
        const cells = [...table.querySelectorAll("td, th")]
            .map((c) => c.getBoundingClientRect().right);
        return {table: t.right, panel: p.right, cells: Math.max(...cells),
                scroll: panel.scrollWidth - panel.clientWidth, page: window.innerWidth};
    }""")
    assert fit["table"] <= fit["panel"] and fit["cells"] <= fit["panel"], fit
    assert fit["scroll"] <= 0 and fit["panel"] <= fit["page"], fit
    # Every column is there, the last one (its stages button) included.
    assert row.locator("button").is_visible()
    assert row.locator("button").bounding_box()["x"] + 10 < fit["panel"]


def _refuse_many(server: Server) -> None:
    """Refusals with long codes on long routes, as a busy gateway has: a key scoped to
    another model asks several routes, and an unknown key asks more."""
    status, _, org = call(server, "POST", "/admin/v1/orgs", {"name": "refused-tenant"})
    assert status == 201, org
    status, _, key = call(server, "POST", "/admin/v1/keys", {
        "org_id": org["id"], "scopes": {"models": ["another-model"]}})
    assert status == 201, key
    chat = {"model": server.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}]}
    for path, body, secret in (
            ("/v1/chat/completions", chat, key["secret"]),
            ("/v1/messages", chat, key["secret"]),
            ("/v1/responses", {"model": server.model, "input": "Hi"}, key["secret"]),
            ("/v1/messages/count_tokens", chat, "sk-ty-not-a-key"),
            ("/v1/responses/{response_id}/input_items".replace(
                "{response_id}", "resp_nope"), None, "sk-ty-not-a-key"),
            ("/admin/v1/orgs/{org_id}/spend_cap".replace("{org_id}", org["id"]),
             {"cap": "1", "project_id": "proj_nope"}, server.api_key or "")):
        status, _, _ = call(server, "POST" if body is not None else "GET", path, body,
                            key=secret)
        assert status >= 400, path


def test_the_refusals_table_fits_its_panel_at_1400_px(browser: Any, server: Server) -> None:
    """Its half-width panel let the table run past the panel's edge behind a scroll."""
    _refuse_many(server)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    try:
        page.goto(server.base_url + "/dashboard")
        page.fill("#key", server.api_key or "")
        page.press("#key", "Tab")
        page.locator("#refusals tr", has_text="model_not_in_scope").first.wait_for()
        fit = page.evaluate("""() => {
            const table = document.querySelector("#refusals table");
            const panel = table.closest("section.panel");
            const t = table.getBoundingClientRect(), p = panel.getBoundingClientRect();
            const cells = [...table.querySelectorAll("td, th")]
                .map((c) => c.getBoundingClientRect().right);
            const grid = panel.parentElement.getBoundingClientRect();
            return {table: t.right, panel: p.right, cells: Math.max(...cells),
                    grid: grid.right, scroll: panel.scrollWidth - panel.clientWidth,
                    page: document.documentElement.clientWidth};
        }""")
        assert fit["table"] <= fit["panel"] and fit["cells"] <= fit["panel"], fit
        assert fit["scroll"] <= 0 and fit["panel"] <= fit["grid"] <= fit["page"], fit
    finally:
        context.close()

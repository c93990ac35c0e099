"""The chat page at / in a real browser, against the real server and model."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

from tests.browser.conftest import call, new_key, replica_stats, screenshot
from tests.e2e.conftest import Server, all_blocks_back

REPLY = ".msg.assistant"


def open_chat(page: Any, server: Server, key: str | None = None, max_tokens: int = 8) -> None:
    """The page with `key` entered (the server's admin key by default), its models
    listed, and `max_tokens` set."""
    page.goto(server.base_url + "/")
    page.fill("#key", key or server.api_key or "")
    page.press("#key", "Tab")  # the change event: the key is kept and the models listed
    page.locator("#model option").first.wait_for(state="attached")
    page.fill("#max-tokens", str(max_tokens))


def send(page: Any, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def last_reply(page: Any) -> Any:
    return page.locator(REPLY).last


def wait_state(page: Any, state: str, timeout_ms: int = 60_000) -> Any:
    reply = page.locator(f"{REPLY}[data-state={state}]").last
    reply.wait_for(timeout=timeout_ms)
    return reply


def test_a_reply_streams_in_with_its_usage_and_stage_waterfall(page: Any, server: Server) -> None:
    open_chat(page, server, max_tokens=12)
    page.fill("#system", "Answer in one short sentence.")
    send(page, "What is the capital of France?")
    reply = wait_state(page, "done")
    assert reply.locator(".body").inner_text().strip()
    meta = reply.locator(".meta").inner_text()
    assert re.search(r"\d+ prompt → \d+ tokens", meta), meta
    assert re.search(r"cost \$\d+\.\d+", meta), meta  # billed: the stream's last event says
    stages = reply.locator(".waterfall .bar-row span:first-child").all_inner_texts()
    # The replica's stages and the gateway's are all there, in request order.
    assert {"auth", "tokenize", "queue", "prefill", "decode"} <= set(stages), stages
    assert stages.index("prefill") < stages.index("decode")
    assert page.locator("#input").is_enabled() and page.locator("#stop").is_disabled()
    assert page.locator("#input").input_value() == ""
    screenshot(page, "chat.png")


def test_stop_aborts_the_stream_and_the_replica_frees_its_blocks(
    page: Any, server: Server,
) -> None:
    def keep_going(route: Any) -> None:  # a reply long enough to be stopped mid-way
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))

    page.route("**/v1/chat/completions", keep_going)
    open_chat(page, server, max_tokens=400)
    send(page, "Tell me a long story about a lighthouse.")
    body = last_reply(page).locator(".body")
    deadline = time.monotonic() + 60
    seen: list[int] = []
    while len(set(seen)) < 3 and time.monotonic() < deadline:  # the text grows, step by step
        seen.append(len(body.inner_text()))
        page.wait_for_timeout(150)
    assert len(set(seen)) >= 3 and seen == sorted(seen), seen
    assert last_reply(page).get_attribute("data-state") == "streaming"
    assert page.locator("#input").is_disabled() and page.locator("#send").is_disabled()
    busy = replica_stats(server)
    assert busy["num_running"] == 1, busy
    page.click("#stop")
    reply = wait_state(page, "stopped", 10_000)
    assert "stopped" in reply.locator(".meta").inner_text()
    assert reply.locator(".body").inner_text().strip()  # what came stays on the page
    assert page.locator("#input").is_enabled()
    deadline = time.monotonic() + 10
    while True:
        stats = replica_stats(server)
        idle = (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and all_blocks_back(stats))
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, stats


def test_a_bad_key_shows_the_servers_401_message(page: Any, server: Server) -> None:
    open_chat(page, server)
    bad = "ty-not-a-key-of-this-server"
    page.fill("#key", bad)
    page.press("#key", "Tab")
    status, _, body = call(server, "POST", "/v1/chat/completions",
                           {"model": server.model, "messages": []}, key=bad)
    assert status == 401
    message = body["error"]["message"]
    page.locator("#models-error", has_text="Error 401").wait_for()
    send(page, "Hello?")
    reply = wait_state(page, "error")
    assert reply.locator(".error").inner_text() == f"Error 401: {message}"
    assert page.locator("#input").input_value() == "Hello?"  # nothing came: send again


def test_a_rate_limited_key_shows_429_with_its_retry_after(page: Any, server: Server) -> None:
    open_chat(page, server, key=new_key(server, "browser-rpm-1", rpm=1), max_tokens=2)
    send(page, "Hi")
    wait_state(page, "done")
    send(page, "Hi again")
    error = wait_state(page, "error").locator(".error").inner_text()
    assert error.startswith("Error 429: "), error
    assert re.search(r"Retry after \d+ s\.$", error), error


def test_a_request_the_server_refuses_shows_its_400_with_the_parameter(
    page: Any, server: Server,
) -> None:
    # The page takes any whole number of tokens; the server refuses one over the window.
    # The same request sent here gives the words the page must show.
    open_chat(page, server, max_tokens=9_999_999)
    same = {"model": page.locator("#model").input_value(),
            "messages": [{"role": "user", "content": "Hello?"}],
            "max_tokens": 9_999_999, "stream": True, "stream_options": {"include_usage": True}}
    status, _, body = call(server, "POST", "/v1/chat/completions", same)
    assert status == 400 and body["error"]["param"], body
    send(page, "Hello?")
    reply = wait_state(page, "error")
    error = body["error"]
    assert reply.locator(".error").inner_text() == (
        f"Error 400: {error['message']} (parameter: {error['param']})")
    assert page.locator("#input").input_value() == "Hello?"  # nothing came: send again


def test_the_page_sends_a_temperature_only_when_the_user_sets_one(
    page: Any, server: Server,
) -> None:
    """It sent 0.7 always, so a deployment's default temperature never applied."""
    open_chat(page, server, max_tokens=2)
    bodies: list[dict[str, Any]] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data or "{}"))
            if r.url.endswith("/v1/chat/completions") else None)
    assert page.locator("#temperature").input_value() == ""
    send(page, "Hi")
    wait_state(page, "done")
    page.fill("#temperature", "0.3")
    send(page, "Hi again")
    page.locator(f"{REPLY}[data-state=done]").nth(1).wait_for(timeout=60_000)
    assert ["temperature" in b for b in bodies] == [False, True]
    assert bodies[1]["temperature"] == 0.3


def test_bad_input_is_refused_in_the_page_without_a_request(page: Any, server: Server) -> None:
    open_chat(page, server)
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url) if "/chat/" in r.url else None)
    page.press("#input", "Enter")
    assert page.locator("#input-error").inner_text() == "Type a message first."
    page.fill("#temperature", "warm")
    send(page, "Hello")
    assert "Temperature must be a number" in page.locator("#input-error").inner_text()
    assert page.locator("#temperature").get_attribute("aria-invalid") == "true"
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "-3")
    page.press("#input", "Enter")
    assert "Max tokens must be a whole number" in page.locator("#input-error").inner_text()
    page.fill("#max-tokens", "4")
    page.fill("#input", "Hello")
    page.press("#input", "Shift+Enter")  # a new line, not a send
    page.keyboard.type("world")
    assert page.locator("#input").input_value() == "Hello\nworld"
    assert page.locator(REPLY).count() == 0 and sent == []


def test_the_pages_are_public_and_carry_a_strict_content_security_policy(
    server: Server,
) -> None:
    for path in ("/", "/dashboard", "/static/chat.js", "/static/app.css"):
        with urllib.request.urlopen(server.base_url + path, timeout=10) as response:
            assert response.status == 200, path
            csp = response.headers["Content-Security-Policy"]
            assert "default-src 'self'" in csp and "unsafe-inline" not in csp, csp
            assert response.headers["X-Content-Type-Options"] == "nosniff"
    with urllib.request.urlopen(server.base_url + "/static/chat.js", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/javascript")
    for path in ("/static/nothing.js", "/static/..%2Fweb.py", "/static/"):
        try:
            urllib.request.urlopen(server.base_url + path, timeout=10)
        except urllib.error.HTTPError as err:
            assert err.code == 404, path
            assert json.loads(err.read())["error"]["type"], path  # the API's error shape
        else:
            raise AssertionError(f"{path} was served")


def test_markdown_renders_without_letting_markup_or_scripts_through(
    page: Any, server: Server,
) -> None:
    text = ("# Title\n**bold** and *it* and `x < y`\n- one\n- two\n"
            "```html\n<b>not bold</b>\n```\n"
            "<img src=x onerror=\"document.title='owned'\"> "
            "[bad](javascript:alert(1)) [good](https://example.com/a?b=1)")
    events = [{"choices": [{"index": 0, "delta": {"content": text}}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9},
               "timings": {"prefill": 5.0, "decode": 20.0}}]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    # Canned: no model can be told to reply with exactly this.
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse))
    open_chat(page, server)
    send(page, "Show me markdown")
    body = wait_state(page, "done").locator(".body")
    assert body.locator("h3").inner_text() == "Title"
    assert body.locator("strong").inner_text() == "bold"
    assert body.locator("em").inner_text() == "it"
    assert body.locator("p code").first.inner_text() == "x < y"
    assert body.locator("li").all_inner_texts() == ["one", "two"]
    assert body.locator("pre code").inner_text() == "<b>not bold</b>"
    assert body.locator("img, b, script").count() == 0
    assert "<img src=x" in body.inner_text()  # shown as text
    links = body.locator("a")
    assert links.count() == 1 and links.get_attribute("href") == "https://example.com/a?b=1"
    assert "[bad](javascript:alert(1))" in body.inner_text()
    assert page.title() != "owned"

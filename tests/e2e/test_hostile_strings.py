"""Stop strings a tenant chooses cost the HTTP process work linear in their length, through
HTTP on the session's server: one longer than the bound is a 400 naming it at once, and a
request at the bound (the most stop strings, each as long as allowed, many choices) is
served while /healthz keeps answering and the process's memory stays flat.

Shown to fail before the fix: `stop: ["z" * 20000]` with `n: 8` was accepted, and every
prefix of every stop string was built once per choice on the event loop (1.5 GB, /healthz
stalled for seconds).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.e2e.conftest import Server
from tests.e2e.test_processes import _listening_pid
from tokenyard.text.stop import MAX_STOP_LENGTH


def _post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        server.base_url + path, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01",
                 **server.headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _rss(pid: int) -> int:
    """The resident set of process `pid`, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass
class _Seen:
    """What a watcher saw of the server: the longest /healthz answer, the peak growth of
    the HTTP process's resident set over its size when the watch began."""

    healthz_s: float = 0.0
    growth: int = 0


@contextlib.contextmanager
def _watching(server: Server, pid: int) -> Iterator[_Seen]:
    """GET /healthz in a loop on its own thread, reading the process's RSS after each."""
    seen, done, before = _Seen(), threading.Event(), _rss(pid)

    def watch() -> None:
        while not done.is_set():
            began = time.perf_counter()
            with urllib.request.urlopen(server.base_url + "/healthz", timeout=30) as answer:
                answer.read()
            seen.healthz_s = max(seen.healthz_s, time.perf_counter() - began)
            seen.growth = max(seen.growth, _rss(pid) - before)
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join(30)


def test_a_stop_string_over_the_bound_is_refused_at_once(server: Server) -> None:
    hello = [{"role": "user", "content": "Hi"}]
    began = time.perf_counter()
    status, body = _post(server, "/v1/chat/completions", {
        "model": server.model, "messages": hello, "n": 8, "max_tokens": 4,
        "stop": ["z" * 20_000]})
    assert time.perf_counter() - began < 2.0
    assert status == 400, body
    assert body["error"]["param"] == "stop.0" and body["error"]["code"] == "invalid_value"
    assert f"at most {MAX_STOP_LENGTH} characters" in body["error"]["message"]

    status, body = _post(server, "/v1/messages", {
        "model": server.model, "messages": hello, "max_tokens": 4,
        "stop_sequences": ["z" * (MAX_STOP_LENGTH + 1)]})
    assert status == 400, body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "stop_sequences.0" in body["error"]["message"]


def test_stop_strings_at_the_bound_are_served_without_stalling_or_growing_the_process(
    server: Server,
) -> None:
    http_pid = _listening_pid(urlsplit(server.base_url).port or 80)
    # The most stop strings a request may send, each as long as allowed and each different
    # from its first character on, so that no two have a prefix in common.
    stops = [chr(ord("A") + i) + "z" * (MAX_STOP_LENGTH - 1) for i in range(16)]
    with _watching(server, http_pid) as seen:
        status, body = _post(server, "/v1/chat/completions", {
            "model": server.model, "n": 32, "max_tokens": 4, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Count to ten."}], "stop": stops})
    assert status == 200, body
    assert len(body["choices"]) == 32
    # Stall and growth bounds, not speed targets: the old matcher built every prefix of
    # every stop once per choice (32 x 16 x 0.5 MB here) on the event loop.
    assert seen.healthz_s < 1.0 and seen.growth < 100 * 2**20, (
        f"/healthz waited up to {seen.healthz_s:.2f} s; the HTTP process grew by "
        f"{seen.growth / 2**20:.0f} MB")

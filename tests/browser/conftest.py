"""The browser tests' fixtures: Debian's Chromium driven by Playwright, one browser per
module, against the session's `server` (tests/conftest.py).

Playwright's own browser download is never used (nothing outside is reachable): the
browser is the system's `chromium`, which `.ci/run` installs. Without it, or without the
playwright package, the tests skip with the reason, and fail when CI is set.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_service
from tests.e2e.conftest import Server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: Where the pages' screenshots go when TOKENYARD_SCREENSHOTS=1 (off in CI: a clean tree).
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "img"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium for the module."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        require_service("Playwright", False, f"the playwright package is missing ({exc})")
    require_service("Chromium", os.access(CHROMIUM, os.X_OK),
                    f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page (its own storage) that fails the test on any script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.set_default_timeout(30_000)
    yield page
    context.close()
    assert not errors, errors


def screenshot(page: Any, name: str) -> None:
    """Keep `docs/img/<name>` when TOKENYARD_SCREENSHOTS=1."""
    if os.environ.get("TOKENYARD_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.mouse.wheel(0, -10_000)  # from the top, the whole page
        page.screenshot(path=str(SCREENSHOTS / name), full_page=True)


def call(server: Server, method: str, path: str, body: Any = None,
         key: str | None = None) -> tuple[int, dict[str, str], Any]:
    """One API call (urllib: the sync Playwright owns this thread's event loop):
    status, headers (lower-case names), JSON body."""
    request = urllib.request.Request(
        server.base_url + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json",
                 "Authorization": f"Bearer {key or server.api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, headers, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        status, headers, raw = err.code, err.headers, err.read()
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(raw or b"null")


def replica_stats(server: Server) -> dict[str, Any]:
    """The replica's engine stats (its own route, with the replica's token)."""
    request = urllib.request.Request(server.replica_url + "/v1/engine/stats",
                                     headers=server.replica_headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


def new_key(server: Server, name: str, **fields: Any) -> str:
    """The secret of a new key of the default org (no admin scope unless `fields` say),
    made through the admin API."""
    _, _, orgs = call(server, "GET", "/admin/v1/orgs")
    org_id = next(o["id"] for o in orgs["data"] if o["name"] == "default")
    status, _, key = call(server, "POST", "/admin/v1/keys",
                          {"org_id": org_id, "name": name, **fields})
    assert status == 201, key
    return str(key["secret"])

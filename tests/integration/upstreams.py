"""One fleet of upstream deployments, shared by the tests that call tokenyard through an
external OpenAI-compatible upstream (tests/integration/test_upstream_served.py and
tests/conformance/test_unavailable.py): a real `tokenyard serve` in OpenAI mode, and the
project's mock OpenAI server whose failures are switched on through its config route.

The gateway's balancer never waits and never ejects, so each injected failure reaches the
client as it happens. A test that injects a failure puts the mock back with
`configure_mock(mock)` in a `finally`.
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.conftest import Server, running_server
from tests.e2e.test_gateway import _mock_replica

REAL = "tokenyard-upstream-2026-11-22"
MOCK = "mock-upstream-2026-11-22"
ALIAS = "up"  # names REAL


def configure_mock(mock_url: str, **changes: float) -> None:
    """Set the mock's failure rates: every one not named goes back to 0."""
    base = {"inject_429": 0.0, "inject_503": 0.0, "inject_500": 0.0,
            "inject_stream_error": 0.0}
    request = urllib.request.Request(
        mock_url + "/mock/config", data=json.dumps({**base, **changes}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@contextmanager
def upstream_fleet() -> Iterator[tuple[Server, str]]:
    """(the gateway, the mock's base URL)."""
    with running_server("--no-auth") as (upstream, _), _mock_replica() as mock, \
            tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tokenyard.toml"
        config.write_text(f"""
[balancer]
queue_timeout_s = 0
eject_after = 1000

[[deployments]]
name = "{REAL}"
kind = "upstream"
urls = ["{upstream.base_url}/v1"]
model = "{upstream.model}"

[[deployments]]
name = "{MOCK}"
kind = "upstream"
urls = ["{mock}/v1"]
model = "mock"

[aliases]
{ALIAS} = "{REAL}"
""")
        with running_server("--config", str(config)) as (server, _):
            yield server, mock

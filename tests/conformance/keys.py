"""Keys for the conformance suites' error cases, made through the admin API."""

from __future__ import annotations

import uuid
from typing import Any

from tests.e2e.conftest import Server
from tests.e2e.test_admin_http import call


def new_key(server: Server, **fields: Any) -> str:
    """A key of a fresh org, with the admin API's key `fields` (scope, limits)."""
    status, org = call(server, "POST", "/admin/v1/orgs",
                       body={"name": f"conf-{uuid.uuid4().hex[:8]}"})
    assert status == 201, org
    status, key = call(server, "POST", "/admin/v1/keys", body={"org_id": org["id"]} | fields)
    assert status == 201, key
    return str(key["secret"])

"""The first admin key from the operator (issue 40, Kubernetes): `TOKENYARD_ADMIN_KEY`
(a Secret's value in deploy/kubernetes/) becomes org "default"'s admin key on an empty
database; no key is generated, written to the state directory or printed; a key of the
wrong shape stops the start with a message naming the variable."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from tests.e2e.conftest import running_server
from tokenyard.config import DEV_KEY_FILE


def _get(url: str, key: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_operators_key_is_the_first_admin_key_and_is_never_written() -> None:
    key = "sk-ty-" + secrets.token_urlsafe(32)
    state = tempfile.mkdtemp(prefix="tokenyard-admin-key-")
    with running_server(env={"TOKENYARD_ADMIN_KEY": key}, state_dir=state) as (server, _):
        assert _get(f"{server.base_url}/admin/v1/orgs", key) == 200
        assert _get(f"{server.base_url}/v1/models", key) == 200
        assert _get(f"{server.base_url}/admin/v1/orgs", "sk-ty-" + "x" * 43) == 401
        output = "".join(server.output)
    assert key not in output and key[-8:] not in output
    assert "TOKENYARD_ADMIN_KEY" in output
    assert not (Path(state) / DEV_KEY_FILE).exists()


def test_a_key_of_the_wrong_shape_stops_the_start() -> None:
    env = {**os.environ, "TOKENYARD_ADMIN_KEY": "replace with the output of the command",
           "TOKENYARD_STATE_DIR": tempfile.mkdtemp(prefix="tokenyard-admin-key-")}
    done = subprocess.run([sys.executable, "-m", "tokenyard.cli", "serve", "--port", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert "TOKENYARD_ADMIN_KEY" in done.stderr + done.stdout

"""Models on demand through HTTP and the official `openai` SDK: `tokenyard serve --config`
with on-demand deployments of the null model (`TOKENYARD_NULL_MODEL=on`: the real engine
around a forward pass that costs nothing, so a load is the replica's start alone; no C++
kernels, so no load waits for another process's kernel build).

- The first request to an unloaded model succeeds, and a burst of 20 concurrent
  streaming requests during its load gets 20 answers and no error.
- An idle model unloads after `idle_unload_s` and the next request loads it again.
- `pinned` is never unloaded; under `max_resident_models` the least recently used
  unpinned model is unloaded for another.
- A key not allowed the model never causes its load (admission before cost).
- The admin API and CLI load, unload, pin and unpin; bad input gets 400/404/409.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import Server, running_server

pytestmark = pytest.mark.slow



def on_demand(name: str, *lines: str) -> str:
    """A fleet file entry: one local replica of the null model, loaded on demand."""
    return "\n".join(["[[deployments]]", f'name = "{name}"', "replicas = 1",
                      'load = "on_demand"', 'engine_args = ["--threads", "1"]', *lines, ""])


FLEET = "\n".join([
    "[balancer]", "queue_timeout_s = 5", "[models]", "max_resident_models = 1",
    # Long enough for a slow start on a loaded machine: the burst must not time out.
    on_demand("od-burst", "idle_unload_s = 600", "load_timeout_s = 300"),
    on_demand("od-idle", "idle_unload_s = 1"),
    on_demand("od-pinned", "pinned = true", "idle_unload_s = 0.5"),
    on_demand("od-guarded"),
    # Not on demand: the admin routes refuse it (409).
    "[[deployments]]", 'name = "elsewhere"', 'kind = "upstream"',
    'urls = ["http://127.0.0.1:9/v1"]', 'model = "m"'])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    fleet = tmp_path_factory.mktemp("on-demand") / "fleet.toml"
    fleet.write_text(FLEET)
    # The null model's replicas need no C++ kernel: none waits on the kernel cache's
    # lock while another process on the machine builds one.
    env = {"TOKENYARD_NULL_MODEL": "on", "TOKENYARD_DISABLE_KERNELS": "1"}
    with running_server("--config", str(fleet), "--log-format", "json", env=env) as (srv, _):
        yield srv


def call(server: Server, method: str, path: str, body: Any = None,
         key: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        server.base_url + path, data=data, method=method,
        headers={"Authorization": f"Bearer {key or server.api_key}",
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def statuses(server: Server) -> dict[str, str | None]:
    status, body = call(server, "GET", "/v1/models")
    assert status == 200, body
    return {card["id"]: card.get("status") for card in body["data"]}


def admin_state(server: Server, name: str) -> dict[str, Any]:
    status, body = call(server, "GET", "/admin/v1/models")
    assert status == 200, body
    return next(row for row in body["data"] if row["name"] == name)


def wait_for(check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def chat(server: Server, model: str) -> str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                           max_retries=0, timeout=300)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
    return reply.choices[0].message.content or ""


async def burst(server: Server, model: str, n: int) -> list[str | BaseException]:
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                                max_retries=0, timeout=300)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=4, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream
                        if c.choices])

    try:
        return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    finally:
        await client.close()


def test_the_first_request_loads_the_model_and_a_burst_during_the_load_succeeds(
        server: Server) -> None:
    assert statuses(server)["od-burst"] == "unloaded"
    answers = asyncio.run(burst(server, "od-burst", 20))
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert errors == [] and len(answers) == 20
    assert statuses(server)["od-burst"] == "loaded"
    state = admin_state(server, "od-burst")
    assert state["loads"] == 1 and state["on_demand"] is True
    assert state["last_load_s"] > 0


def test_lru_makes_room_an_idle_model_unloads_and_the_next_request_reloads_it(
        server: Server) -> None:
    # The budget is one model: od-idle's load unloads od-burst, the least recently used.
    assert chat(server, "od-idle")
    assert statuses(server)["od-burst"] == "unloaded"
    wait_for(lambda: statuses(server)["od-idle"] == "unloaded")
    assert admin_state(server, "od-idle")["unloads"] == 1
    assert chat(server, "od-idle")
    assert admin_state(server, "od-idle")["loads"] == 2


def test_a_pinned_model_stays_and_keeps_its_slot(server: Server) -> None:
    wait_for(lambda: statuses(server)["od-idle"] == "unloaded")
    assert chat(server, "od-pinned")
    time.sleep(1.5)  # three of its idle periods
    assert statuses(server)["od-pinned"] == "loaded"
    # The one slot is the pinned model's: another model's load is refused in the API's
    # shape (503, retry-after), not left hanging, and the pinned model stays.
    with pytest.raises(openai.APIStatusError) as refused:
        chat(server, "od-idle")
    assert refused.value.status_code == 503
    assert refused.value.response.headers.get("retry-after")
    assert "od-idle" in refused.value.message
    assert statuses(server)["od-pinned"] == "loaded"


def test_a_key_without_the_model_never_loads_it(server: Server) -> None:
    status, org = call(server, "POST", "/admin/v1/orgs", {"name": "guarded", "balance": "5"})
    assert status == 201, org
    status, key = call(server, "POST", "/admin/v1/keys",
                       {"org_id": org["id"], "models": ["od-burst"]})
    assert status == 201, key
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key["secret"],
                           max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model="od-guarded", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code in (403, 404)
    assert statuses(server).get("od-guarded", "unloaded") == "unloaded"
    assert admin_state(server, "od-guarded")["loads"] == 0


def test_admin_routes_and_cli_load_unload_and_pin(server: Server) -> None:
    status, body = call(server, "POST", "/admin/v1/models/nope/load", {})
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = call(server, "POST", "/admin/v1/models/elsewhere/load", {})
    assert status == 409 and body["error"]["code"] == "not_on_demand"
    status, body = call(server, "POST", "/admin/v1/models/od-idle/pin", {"forever": True})
    assert status == 400 and "forever" in body["error"]["message"]
    status, body = call(server, "POST", "/admin/v1/models/od-idle/pin", {})
    assert status == 200 and body["pinned"] is True
    status, body = call(server, "POST", "/admin/v1/models/od-idle/unload", {})
    assert status == 409 and body["error"]["code"] == "model_pinned"
    env = {**os.environ, "TOKENYARD_STATE_DIR": str(server.state_dir)}
    cli = [sys.executable, "-m", "tokenyard.cli", "admin", "models"]
    out = subprocess.run([*cli, "unpin", "od-idle", "--url", server.base_url,
                          "--api-key", str(server.api_key), "--format", "json"],
                         capture_output=True, text=True, env=env, timeout=60, check=True)
    assert json.loads(out.stdout)["pinned"] is False
    status, body = call(server, "POST", "/admin/v1/models/od-pinned/unpin", {})
    assert status == 200 and body["pinned"] is False
    status, body = call(server, "POST", "/admin/v1/models/od-pinned/unload", {})
    assert status == 200 and body["status"] == "unloaded"
    status, body = call(server, "POST", "/admin/v1/models/od-burst/load", {})
    assert status == 200 and body["status"] == "loaded", body
    status, spec = call(server, "GET", "/openapi.json")
    assert "/admin/v1/models/{name}/load" in spec["paths"]
    assert Path(str(server.state_dir)).exists()

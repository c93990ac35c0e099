"""Data residency through a real `tokenyard serve --config` (auth on) in front of mock
OpenAI servers as upstream deployments, each declaring its region; every mock counts the
chat requests it received, so "never reaches" is counted where traffic would land.

- An org bound to `eu` (admin API) never reaches a `us` deployment: named directly,
  through a plain alias, a canary split (its draw is made among the eu targets) or a
  shadow copy; a deployment that declares no region is outside every binding too. The
  same requests from an unbound org do reach the us mocks, so the counts can fail.
- A project narrows its org; the ledger, the request record and usage by region carry
  the region that served.
- `serve --region R` lists and serves only R's deployments and says so in /v1/models; an
  org bound to eu is refused there, and reads its captures and stored responses through a
  gateway of its regions (or one without a region), not a us one.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import Server, running_server
from tests.integration.test_canary_shadow import Mocks, admin, new_key, wait_for
from tokenyard.cli.main import main

EU, US, US_SHADOW, NOWHERE = ("eu-2026-11-01", "us-2026-11-01", "us-shadow-2026-11-01",
                              "nowhere-2026-11-01")


def fleet_toml(urls: dict[str, str]) -> str:
    def deployment(name: str, mock: str, region: str | None) -> str:
        where = f'region = "{region}"\n' if region else ""
        return (f'[[deployments]]\nname = "{name}"\nkind = "upstream"\nmodel = "mock"\n'
                f'urls = ["{urls[mock]}"]\n{where}\n')

    return (
        deployment(EU, "eu", "eu") + deployment(US, "us", "us")
        + deployment(US_SHADOW, "us-shadow", "us") + deployment(NOWHERE, "nowhere", None)
        + f'[aliases]\nto-us = "{US}"\n'
        + f'[aliases.split]\nroute = {{ "{US}" = 99, "{EU}" = 1 }}\n'
        + f'[aliases.mirrored]\nroute = {{ "{EU}" = 1 }}\n'
        + f'shadow = {{ deployment = "{US_SHADOW}", share = 1.0 }}\n'
    )


class Fleet:
    def __init__(self, server: Server, mocks: Mocks, path: Path, state: str) -> None:
        self.server, self.mocks, self.path, self.state = server, mocks, path, state


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    mocks = Mocks()
    try:
        urls = {name: mocks.start(name, output_len=4, itl_ms=0.0)
                for name in ("eu", "us", "us-shadow", "nowhere")}
        with tempfile.TemporaryDirectory(prefix="tokenyard-regions-") as state:
            path = Path(state) / "fleet.toml"
            path.write_text(fleet_toml(urls))
            with running_server("--config", str(path), state_dir=state) as (server, _):
                yield Fleet(server, mocks, path, state)
    finally:
        mocks.close()


def bound_key(server: Server, name: str, regions: list[str] | None) -> tuple[str, dict[str, str]]:
    """A new org bound to `regions` (None: unbound) and a key of it."""
    org_id, headers = new_key(server, name)
    if regions is not None:
        status, body = admin(server, "POST", f"/admin/v1/orgs/{org_id}/regions",
                             {"allowed_regions": regions})
        assert status == 200 and body["allowed_regions"] == sorted(regions), body
    return org_id, headers


def client(server: Server, headers: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1",
                         api_key=headers["Authorization"].removeprefix("Bearer "),
                         max_retries=0)


def ask(api: openai.OpenAI, model: str, text: str = "Say hello.") -> Any:
    return api.chat.completions.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": text}])


def refused(api: openai.OpenAI, model: str) -> openai.PermissionDeniedError:
    with pytest.raises(openai.PermissionDeniedError) as caught:
        ask(api, model)
    assert caught.value.code == "region_not_allowed", caught.value.body
    assert caught.value.param == "model"
    return caught.value


def test_an_org_bound_to_eu_never_reaches_a_us_deployment(fleet: Fleet) -> None:
    server, counts = fleet.server, fleet.mocks.counts
    org_id, headers = bound_key(server, "eu-only", ["eu"])
    time.sleep(1.1)  # the key cache's lifetime: the binding applies from here on
    eu = client(server, headers)
    before = dict(counts)
    # Direct, through a plain alias, and a deployment that declares no region: a 403 in
    # the API's error shape naming the region.
    assert "region us" in str(refused(eu, US))
    assert "region us" in str(refused(eu, "to-us"))
    # (It said "served in region none declared".)
    nowhere = str(refused(eu, NOWHERE))
    assert f"`{NOWHERE}` is served without a declared region;" in nowhere, nowhere
    # A canary split 99 % to us: every conversation lands on the eu target.
    for i in range(12):
        assert ask(eu, "split", f"conversation {i}").choices[0].message.content
    # A shadow copy to us is never made; the primary answers.
    for i in range(4):
        ask(eu, "mirrored", f"mirrored {i}")
    raw = eu.chat.completions.with_raw_response.create(
        model=EU, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    time.sleep(1.0)  # a shadow copy would start in the background
    assert counts["us"] == before.get("us", 0)
    assert counts["us-shadow"] == before.get("us-shadow", 0)
    assert counts["nowhere"] == before.get("nowhere", 0)
    assert counts["eu"] == before.get("eu", 0) + 12 + 4 + 1
    # The record, the ledger and usage by region name the region that served.
    status, record = admin(server, "GET", f"/v1/requests/{raw.headers['x-request-id']}")
    assert status == 200 and record["region"] == "eu" and record["deployment"] == EU, record

    def by_region() -> dict[str | None, int] | None:
        status, body = admin(server, "GET",
                             f"/admin/v1/usage?group_by=region&org_id={org_id}")
        assert status == 200, body
        rows = {row["group"]: row["requests"] for row in body["data"]}
        return rows if sum(rows.values()) >= 17 else None

    assert wait_for(by_region) == {"eu": 17}


def test_the_same_requests_from_an_unbound_org_reach_us(fleet: Fleet) -> None:
    """The control: without a binding the split and the shadow do send traffic to us (so
    the counts above could have failed)."""
    server, counts = fleet.server, fleet.mocks.counts
    _, headers = bound_key(server, "anywhere", None)
    api = client(server, headers)
    before = dict(counts)
    for i in range(12):
        ask(api, "split", f"conversation {i}")
    ask(api, "mirrored", "mirrored 0")
    ask(api, US)
    ask(api, NOWHERE)
    assert wait_for(lambda: counts["us-shadow"] > before.get("us-shadow", 0))
    assert counts["us"] >= before.get("us", 0) + 2
    assert counts["nowhere"] == before.get("nowhere", 0) + 1


def test_a_project_narrows_its_org_and_bad_lists_are_refused(fleet: Fleet) -> None:
    server = fleet.server
    org_id, org_headers = bound_key(server, "two-regions", ["eu", "us"])
    status, project = admin(server, "POST", f"/admin/v1/orgs/{org_id}/projects",
                            {"name": "eu-data"})
    assert status == 201, project
    status, body = admin(server, "POST", f"/admin/v1/projects/{project['id']}/regions",
                         {"allowed_regions": ["asia"]})
    assert status == 400 and body["error"]["param"] == "allowed_regions", body
    status, body = admin(server, "POST", f"/admin/v1/orgs/{org_id}/regions",
                         {"allowed_regions": ["EU!"]})
    assert status == 400 and body["error"]["param"] == "allowed_regions", body
    status, body = admin(server, "POST", f"/admin/v1/projects/{project['id']}/regions",
                         {"allowed_regions": ["eu"]})
    assert status == 200 and body["allowed_regions"] == ["eu"], body
    status, key = admin(server, "POST", "/admin/v1/keys",
                        {"org_id": org_id, "project_id": project["id"]})
    assert status == 201, key
    time.sleep(1.1)
    narrowed = client(server, {"Authorization": f"Bearer {key['secret']}"})
    refused(narrowed, US)
    ask(narrowed, EU)
    ask(client(server, org_headers), US)  # the org's own key may use us
    status, orgs = admin(server, "GET", "/admin/v1/orgs")
    assert {o["id"]: o["allowed_regions"] for o in orgs["data"]}[org_id] == ["eu", "us"]


def regional(fleet: Fleet, region: str) -> Any:
    return running_server("--config", str(fleet.path), "--region", region,
                          state_dir=fleet.state)


def test_a_regional_gateway_lists_and_serves_only_its_region(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    org_id, headers = bound_key(fleet.server, "eu-captured", ["eu"])
    status, body = admin(fleet.server, "POST", f"/admin/v1/orgs/{org_id}/capture",
                         {"retention_days": 1})
    assert status == 200, body
    # The CLI binds another org the same way (on the store, as `tokenyard admin` does).
    other, _ = new_key(fleet.server, "cli-bound")
    monkeypatch.setenv("TOKENYARD_STATE_DIR", fleet.state)
    monkeypatch.delenv("TOKENYARD_DATABASE_URL", raising=False)
    assert main(["admin", "--format", "json", "regions", "set", "--org", other, "us"]) == 0
    assert json.loads(capsys.readouterr().out)["allowed_regions"] == ["us"]
    time.sleep(1.1)
    raw = client(fleet.server, headers).chat.completions.with_raw_response.create(
        model=EU, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    request_id = raw.headers["x-request-id"]
    stored = client(fleet.server, headers).responses.create(model=EU, input="Hi",
                                                           max_output_tokens=16)
    auth = {"Authorization": headers["Authorization"]}
    _, unbound = new_key(fleet.server, "unbound")
    with regional(fleet, "us") as (us_gw, _):
        us_models = client(us_gw, unbound).models.list()
        assert {m.id for m in us_models.data} == {US, US_SHADOW, "to-us", "split"}
        assert us_models.model_extra and us_models.model_extra["region"] == "us"
        assert all(m.model_extra and m.model_extra["region"] == "us" for m in us_models.data)
        assert ask(client(us_gw, unbound), "split").model  # an alias keeps its us target
        with pytest.raises(openai.NotFoundError):
            ask(client(us_gw, unbound), EU)  # not served here at all
        refused(client(us_gw, headers), US)  # the eu org on the us endpoint
        # Its captured request is read through a gateway of its regions only (one
        # without a region serves them all).
        status, body = admin(us_gw, "GET", f"/v1/requests/{request_id}", headers=auth)
        assert status == 403 and body["error"]["code"] == "region_not_allowed", body
        assert "region us" in body["error"]["message"]
        with pytest.raises(openai.PermissionDeniedError) as caught:  # its stored response
            client(us_gw, headers).responses.retrieve(stored.id)
        assert caught.value.code == "region_not_allowed"
    status, body = wait_for(lambda: (lambda got: got if got[0] == 200 else None)(
        admin(fleet.server, "GET", f"/v1/requests/{request_id}", headers=auth)))
    assert body["capture"] is not None and body["region"] == "eu", body
    assert client(fleet.server, headers).responses.retrieve(stored.id).id == stored.id


def test_a_fleet_file_region_must_be_a_region_name(tmp_path: Path) -> None:
    from tokenyard.deployments import parse_fleet
    from tokenyard.fleet_values import FleetConfigError

    item = {"name": "a", "kind": "upstream", "model": "m", "urls": ["http://h/v1"]}
    assert parse_fleet({"deployments": [{**item, "region": "eu-west-1"}]}).deployments[
        "a"].region == "eu-west-1"
    with pytest.raises(FleetConfigError, match="region"):
        parse_fleet({"deployments": [{**item, "region": "EU West"}]})

"""The chat page lists only the models that can chat (issue 29 §5): the session's server
also serves an embeddings model, which /v1/models lists with its capabilities and the
page leaves out (picking it used to give a 400)."""

from __future__ import annotations

from typing import Any

from tests.browser.conftest import call
from tests.browser.test_chat_page import open_chat
from tests.e2e.conftest import Server


def test_the_model_list_offers_only_models_that_can_chat(page: Any, server: Server) -> None:
    status, _, models = call(server, "GET", "/v1/models")
    assert status == 200, models
    can = {m["id"]: m.get("capabilities") for m in models["data"]}
    embedders = [name for name, caps in can.items() if caps == ["embeddings"]]
    assert embedders, can  # the server does list one: the page must leave it out
    assert "chat" in can[server.model], can

    open_chat(page, server)
    offered = page.locator("#model option").evaluate_all("options => options.map(o => o.value)")
    assert server.model in offered, offered
    assert not set(embedders) & set(offered), offered
    assert sorted(offered) == sorted(n for n, caps in can.items() if "chat" in caps)


def test_the_picker_offers_only_what_the_key_may_use(page: Any, server: Server) -> None:
    """A key scoped to one model was offered every model, and a 403 when it picked one."""
    status, _, org = call(server, "POST", "/admin/v1/orgs", {"name": "picker"})
    assert status == 201, org
    keys = {}
    for name, models in (("one", [server.model]), ("none", ["not-served-here"])):
        status, _, key = call(server, "POST", "/admin/v1/keys", {
            "org_id": org["id"], "scopes": {"models": models}})
        assert status == 201, key
        keys[name] = key["secret"]
    open_chat(page, server, key=keys["one"])
    offered = page.locator("#model option").evaluate_all("options => options.map(o => o.value)")
    assert offered == [server.model]
    page.fill("#key", keys["none"])
    page.press("#key", "Tab")
    page.wait_for_function("() => !document.querySelector('#model option[value]')"
                           " || document.querySelectorAll('#model option').length === 0")
    offered = page.locator("#model option").evaluate_all(
        "options => options.map(o => o.value).filter(Boolean)")
    assert offered == [], offered

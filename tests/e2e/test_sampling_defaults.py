"""Deployment sampling defaults through HTTP (issue 27): a request that leaves a sampling
parameter out gets the deployment's default (the fleet file's `defaults` over the
model's recommendation), and `/v1/models` says which defaults each deployment applies.

Before, every omitted parameter was the API's (temperature 1): the 135M model answered
"What is the capital of France?" with noise. Here one deployment defaults to greedy
(`defaults = { temperature = 0 }`): two requests without a temperature, with different
seeds, say the same thing, and what a request sets itself still wins.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conformance.spec import Spec
from tests.e2e.conftest import Server, running_server
from tokenyard.text.model_files import EMBEDDED_SAMPLING

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def fleet(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`tokenyard serve --config` over the session server's replica: `greedy` with the
    fleet file's defaults, `plain` with only the embedded model's own."""
    directory = tmp_path_factory.mktemp("sampling")
    config = directory / "tokenyard.toml"
    config.write_text(f"""
[[deployments]]
name = "greedy"
urls = ["{server.replica_url}"]
defaults = {{ temperature = 0.0 }}

[[deployments]]
name = "plain"
urls = ["{server.replica_url}"]
""")
    state = Path(directory / "state")
    state.mkdir()
    with running_server("--config", str(config), state_dir=str(state),
                        env={"TOKENYARD_REPLICA_TOKEN": server.replica_token or ""}) as (
            srv, _):
        yield srv


def _models(srv: Server) -> dict[str, Any]:
    r = httpx.get(srv.base_url + "/v1/models", headers=srv.headers, timeout=30)
    assert r.status_code == 200, r.text
    Spec.load("openai").validate(r.json(), Spec.load("openai").response_schema(
        "/models", 200, "get"), "list")
    return {m["id"]: m for m in r.json()["data"]}


def test_models_say_which_defaults_each_deployment_applies(fleet: Server) -> None:
    models = _models(fleet)
    card = dict.fromkeys(EMBEDDED_SAMPLING, "model card")
    assert models["plain"]["sampling_defaults"] == EMBEDDED_SAMPLING
    assert models["plain"]["sampling_defaults_source"] == card
    assert models["greedy"]["sampling_defaults"] == {**EMBEDDED_SAMPLING, "temperature": 0.0}
    assert models["greedy"]["sampling_defaults_source"] == {**card, "temperature": "fleet"}
    r = httpx.get(fleet.base_url + "/v1/models/greedy", headers=fleet.headers, timeout=30)
    assert r.json()["sampling_defaults"] == models["greedy"]["sampling_defaults"]


def test_an_omitted_temperature_gets_the_deployments_default(fleet: Server) -> None:
    client = openai.OpenAI(base_url=fleet.base_url + "/v1", api_key=fleet.api_key,
                           max_retries=0)

    def ask(**extra: Any) -> str:
        r = client.chat.completions.create(model="greedy", messages=ASK,  # type: ignore[arg-type]
                                           max_tokens=16, **extra)
        return r.choices[0].message.content or ""

    first, second = ask(seed=1), ask(seed=2)
    assert first == second == ask(temperature=0.0, seed=3)
    assert "Paris" in first, first
    # What the request sets wins over the default: at temperature 2, eight seeds do not
    # all give the greedy answer.
    assert {ask(temperature=2.0, seed=s) for s in range(8)} != {first}

    reply = anthropic.Anthropic(base_url=fleet.base_url, api_key=fleet.api_key,
                                max_retries=0).messages.create(
        model="greedy", max_tokens=16, messages=ASK)  # type: ignore[arg-type]
    assert reply.content[0].text == first  # type: ignore[union-attr]


def test_a_response_echoes_the_defaults_it_was_sampled_with(fleet: Server) -> None:
    client = openai.OpenAI(base_url=fleet.base_url + "/v1", api_key=fleet.api_key,
                           max_retries=0)
    for model, temperature in (("greedy", 0.0), ("plain", EMBEDDED_SAMPLING["temperature"])):
        r = client.responses.create(model=model, input="Say hi.", max_output_tokens=8,
                                    store=False)
        assert (r.temperature, r.top_p) == (temperature, EMBEDDED_SAMPLING["top_p"])

"""A deployment's sampling defaults (issue 27): read from the model's files (GGUF
`general.sampling.*`, a Hugging Face folder's generation_config.json), from the model card
of a model tokenyard ships, and from the fleet file's `defaults`, which win; the
converters apply them only to what a request leaves out."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import gguf
import pytest

from tokenyard.api.anthropic.convert import anthropic_request_to_engine
from tokenyard.api.anthropic.schemas import MessagesRequest
from tokenyard.api.errors import parse_body
from tokenyard.api.openai.convert import chat_request_to_engine
from tokenyard.api.openai.schemas import ChatCompletionRequest
from tokenyard.api.responses.convert import request_params, response_shell
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.deployments import FleetSpec, parse_fleet
from tokenyard.fleet_values import FleetConfigError
from tokenyard.sampling_defaults import NONE, SamplingDefaults, fleet_defaults
from tokenyard.text.model_files import EMBEDDED_SAMPLING, recommended_sampling


def _fleet(defaults: str, kind: str = "engine") -> FleetSpec:
    return parse_fleet(tomllib.loads(f"""
[[deployments]]
name = "d"
kind = "{kind}"
urls = ["http://127.0.0.1:9"]
defaults = {defaults}
"""))


def test_fleet_defaults_are_read_and_checked() -> None:
    spec = _fleet("{ temperature = 0, top_k = 40, min_p = 0.05 }").deployments["d"]
    assert spec.defaults.values == {"temperature": 0.0, "top_k": 40, "min_p": 0.05}
    assert set(spec.defaults.sources.values()) == {"fleet"}
    for bad, says in [("{ temprature = 0.5 }", "unknown parameter 'temprature'"),
                      ("{ temperature = 3.0 }", "defaults.temperature: a number in [0, 2]"),
                      ("{ top_p = 0 }", "defaults.top_p: a number in (0, 1]"),
                      ("{ top_k = 2.5 }", "defaults.top_k: an integer"),
                      ('{ temperature = "hot" }', "defaults.temperature")]:
        with pytest.raises(FleetConfigError, match=re.escape(says)):
            _fleet(bad)
    with pytest.raises(FleetConfigError, match="embeddings deployment samples nothing"):
        _fleet("{ temperature = 0 }", kind="embeddings")


def test_the_embedded_model_gets_its_model_cards_sampling() -> None:
    found = recommended_sampling(None)
    assert found.values == EMBEDDED_SAMPLING
    assert set(found.sources.values()) == {"model card"}


def test_a_ggufs_sampling_keys_are_read_and_bad_values_skipped(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_uint32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.top_p", 7.0)  # out of bounds: skipped
    writer.add_float32("general.sampling.penalty_repeat", 1.05)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = recommended_sampling(str(path))
    assert found.values == {"temperature": pytest.approx(0.6), "top_k": 20,
                            "repetition_penalty": pytest.approx(1.05)}
    assert set(found.sources.values()) == {"model"}


def test_a_hugging_face_folders_generation_config_is_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}))
    assert recommended_sampling(str(tmp_path)).values == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (tmp_path / "generation_config.json").write_text("not json")
    assert recommended_sampling(str(tmp_path)) == NONE


def test_the_fleet_file_wins_over_the_model_per_parameter() -> None:
    model = SamplingDefaults({"temperature": 0.2, "top_p": 0.9},
                             {"temperature": "model card", "top_p": "model card"})
    both = fleet_defaults({"temperature": 0.0}, "d.defaults").over(model)
    assert both.values == {"temperature": 0.0, "top_p": 0.9}
    assert both.sources == {"temperature": "fleet", "top_p": "model card"}


def test_converters_apply_defaults_only_where_the_request_sets_none() -> None:
    defaults = SamplingDefaults({"temperature": 0.2, "top_p": 0.9, "top_k": 40},
                                {"temperature": "fleet", "top_p": "fleet", "top_k": "fleet"})
    chat = parse_body(ChatCompletionRequest, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}))
    _, params = chat_request_to_engine(chat, None, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.5, 40)
    _, plain = chat_request_to_engine(chat)
    assert (plain.temperature, plain.top_k) == (1.0, 0)
    msg = parse_body(MessagesRequest, json.dumps(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
         "temperature": 1.0}))
    _, params = anthropic_request_to_engine(msg, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.9, 40)
    resp = parse_body(ResponsesRequest, json.dumps({"model": "m", "input": "hi"}))
    assert (request_params(resp, defaults).temperature, request_params(resp).temperature) == (
        0.2, 1.0)
    shell = response_shell(resp, "m", defaults)
    assert (shell.temperature, shell.top_p) == (0.2, 0.9)
